"""Cache engine: the KV block pools themselves, on the device and in host memory.

Every cache tensor has the layout (num_layers, num_blocks, ...) so that moving blocks between
pools is one indexed copy per tensor, whatever the tensor holds: "k" and "v"
(num_layers, num_blocks, block_size, num_kv_heads, head_dim), and with int8 / int4 KV their
per-(token, head) scales and offsets beside them, so swap / copy move values and scales together:

    --kv-dtype      "k", "v", per block                 companions, per block: (bs, hkv) fp16
    fp32/fp16/bf16  (bs, hkv, d) float                  -
    int8            (bs, hkv, d) int8                   k_scale, v_scale
    int4            (bs, hkv, d / 2) uint8 packed       k_scale, v_scale, v_offset

int4 keys also need their layer's codebook (kv_quant.CODEBOOK: per-channel RMS and code
widths, calibrated per model by qserve/engine/kv_codebook.py). It is per layer, not per block,
so it sits outside the pools and no block move touches it; `layer(i)` hands it out with
layer i's blocks.

The KV "dtype" passed around is the storage dtype of the values: torch.int8 means int8 KV,
torch.uint8 means packed int4 KV (kernels/kv_quant.py).
On a CPU machine both pools are CPU tensors, but they stay separate pools with separate budgets.

Block moves run off the compute path, in order, one layer at a time (CopyQueue): on CUDA on a
side stream, on the CPU in a copy thread. The forward pass waits for layer i's moves just
before layer i, so moving layer 5 overlaps computing layer 4.
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import os

import queue
import threading

import torch

from qserve.config import CacheConfig, ModelArchConfig
from qserve.errors import ConfigError
from qserve.kernels import cpu_ops
from qserve.kernels.kv_quant import (KEY_BITS, SCALE_DTYPE, VALUE_BITS, kv_parts, packed_bytes,
                                     uniform_key_codebook)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# --kv-dtype name -> storage dtype of the K/V values
KV_STORAGE = {**DTYPES, "int8": torch.int8, "int4": torch.uint8}


def dtype_name(dtype: torch.dtype) -> str:
    """fp32 / fp16 / bf16 / int8 / int4: a storage dtype as --dtype and --kv-dtype name it."""
    return {v: k for k, v in KV_STORAGE.items()}[dtype]


def kv_torch_dtype(cache: CacheConfig, model_dtype: torch.dtype, suggested: str | None = None,
                   *, half: bool = False) -> torch.dtype:
    """Storage dtype of the K/V values: --kv-dtype; for "auto", the checkpoint's `suggested`
    kv_dtype (a qserve recipe's) when it has one, else fp16 where `half`
    (memory_plan.resolve_kv_dtype says when), else the model's dtype."""
    name = suggested if cache.kv_dtype == "auto" and suggested else cache.kv_dtype
    if name == "auto":
        return torch.float16 if half else model_dtype
    return KV_STORAGE[name]


def cache_tensor_specs(arch: ModelArchConfig, block_size: int, dtype: torch.dtype
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-block shape and dtype of each named cache tensor (leading num_layers/num_blocks
    dimensions left out)."""
    specs = {}
    for which in ("k", "v"):
        d = arch.head_dim
        if dtype == torch.uint8:
            if d % 8:
                raise ConfigError(f"--kv-dtype int4 needs a head_dim divisible by 8; this "
                                  f"model's is {d}")
            d = packed_bytes(d, KEY_BITS if which == "k" else VALUE_BITS)
        shape = (block_size, arch.num_kv_heads, d)
        specs[which] = (shape, dtype)
        for part in kv_parts(dtype, which):
            specs[f"{which}_{part}"] = (shape[:2], SCALE_DTYPE)
    return specs


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers and all cache tensors."""
    total = 0
    for shape, dt in cache_tensor_specs(arch, block_size, dtype).values():
        n = 1
        for s in shape:
            n *= s
        total += n * dt.itemsize
    return total * arch.num_layers


# one block move: (src rows, dst rows, src row ids, dst row ids), dst[dst ids] = src[src ids]
RowCopy = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class CopyQueue:
    """Runs jobs of block moves in submission order, beside the compute: on a side stream on
    CUDA, in one worker thread on the CPU (the C row copy, no OpenMP). `submit` returns a
    ticket; `wait(ticket)` returns once that job and every earlier one is done (on CUDA: makes
    the compute stream wait for them)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.submitted = 0
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._events: dict[int, torch.cuda.Event] = {}
        else:
            self._done = 0
            self._error: BaseException | None = None
            self._cv = threading.Condition()
            self._jobs: queue.SimpleQueue = queue.SimpleQueue()
            self._thread: threading.Thread | None = None

    def submit(self, job: list[RowCopy]) -> int:
        self.submitted += 1
        ticket = self.submitted
        if self.device.type == "cuda":
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for src, dst, si, di in job:
                    rows = src[si.to(src.device)]
                    # device -> host: a blocking copy, which waits for the side stream only
                    rows = rows.to(dst.device, non_blocking=dst.device.type == "cuda")
                    dst[di.to(dst.device)] = rows
                event = torch.cuda.Event()
                event.record(self._stream)
            self._events[ticket] = event
        elif cpu_ops.lib() is None:  # no copy thread without the C copy: do it now
            self.wait(ticket - 1)
            _run_on_cpu(job)
            with self._cv:
                self._done = ticket
        else:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="qserve-kv-copy",
                                                daemon=True)
                self._thread.start()
            self._jobs.put((ticket, job))
        return ticket

    def wait(self, ticket: int) -> None:
        if self.device.type == "cuda":
            for t in [t for t in self._events if t <= ticket]:
                torch.cuda.current_stream(self.device).wait_event(self._events.pop(t))
            return
        with self._cv:
            while self._done < ticket and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise self._error

    def wait_all(self) -> None:
        self.wait(self.submitted)

    def _work(self) -> None:
        while True:
            ticket, job = self._jobs.get()
            error = None
            try:
                _run_on_cpu(job)
            except BaseException as e:  # handed to the waiting thread, which raises it
                error = e
            del job  # the thread outlives its engine: keep no reference to the pools
            with self._cv:
                self._done, self._error = ticket, self._error or error
                self._cv.notify_all()


def _run_on_cpu(job: list[RowCopy]) -> None:
    for src, dst, si, di in job:
        if cpu_ops.lib() is not None:
            cpu_ops.copy_rows(src, dst, si, di)
        else:
            dst[di] = src[si]


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """A zeroed tensor for the KV pool. On the CPU it lies on fresh anonymous pages, which read
    as zeros and become resident only as they are first written: the pool takes memory as
    sequences fill it, not all at startup (torch.zeros writes every page). The memory plan
    still reserves the whole pool, so a full pool fits as before."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: a read maps the kernel's zero page (a shared mapping's read allocates, and a
    # forked child would share the pool). The tensor holds the mapping; it is unmapped when the
    # last view of the pool goes.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


class CacheEngine:
    def __init__(self, arch: ModelArchConfig, cache: CacheConfig, num_blocks: int,
                 num_host_blocks: int, device: torch.device, dtype: torch.dtype,
                 key_codebook: dict[str, torch.Tensor] | None = None):
        """key_codebook: int4 KV's, tensors (num_layers, num_kv_heads, head_dim); None: the
        uncalibrated kv_quant.uniform_key_codebook for every layer."""
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = cache.block_size
        specs = cache_tensor_specs(arch, cache.block_size, dtype)
        L = arch.num_layers
        # zeros, not empty: the decode path reads whole blocks (masked past each sequence's
        # end), and garbage there could dequantize to inf/NaN, which a zero probability times V
        # does not undo. Host blocks are only ever read after a swap-out wrote them.
        self.device_cache = {name: zeroed_pool((L, num_blocks, *shape), dt, device)
                             for name, (shape, dt) in specs.items()}
        pin = device.type == "cuda"
        self.host_cache = {name: torch.empty((L, num_host_blocks, *shape), dtype=dt,
                                             pin_memory=pin)
                           for name, (shape, dt) in specs.items()}
        self.num_layers = L
        self.codebooks: list[dict[str, torch.Tensor]] = [{} for _ in range(L)]
        if dtype == torch.uint8:
            if key_codebook is None:
                uniform = uniform_key_codebook(arch.num_kv_heads, arch.head_dim)
                key_codebook = {n: t.expand(L, *t.shape) for n, t in uniform.items()}
            self.codebooks = [{n: t[i].to(device).contiguous() for n, t in key_codebook.items()}
                              for i in range(L)]
        # the device pool seen as L * num_blocks per-layer slices: slice l * num_blocks + b is
        # layer l of block b; layer-wise staging puts any layer's K/V in any slice it borrowed
        self.flat_cache = {name: t.view(L * num_blocks, *t.shape[2:])
                           for name, t in self.device_cache.items()}
        # one layer of one block, values and scales
        self.layer_block_bytes = sum(t[0, 0].numel() * t.element_size()
                                     for t in self.device_cache.values())
        self.copier = CopyQueue(device)
        self.bytes_swapped_out = 0
        self.bytes_swapped_in = 0
        self.bytes_offloaded = 0  # layer-wise prefill K/V written to host blocks
        self.bytes_fetched = 0  # and read back from them into staging

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's view of every cache tensor, each (num_blocks, ...), and its codebook."""
        return {**{name: t[i] for name, t in self.device_cache.items()}, **self.codebooks[i]}

    def flat_layer(self, i: int) -> dict[str, torch.Tensor]:
        """flat_cache (every layer's slices) with layer i's codebook: what a layer reads when
        layer-wise staging put its K/V in borrowed slices."""
        return {**self.flat_cache, **self.codebooks[i]}

    def start_moves(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                    copies: list[tuple[int, int]]) -> list[int] | None:
        """Submit a step's block moves, one job per layer, in the order swap out (device ->
        host), swap in (host -> device), copy-on-write (device -> device).

        Returns:
            the ticket of each layer's job, or None when there is nothing to move.
        """
        if not (swap_out or swap_in or copies):
            return None
        plan = [(self.device_cache, self.host_cache, swap_out),
                (self.host_cache, self.device_cache, swap_in),
                (self.device_cache, self.device_cache, copies)]
        plan = [(src, dst, _ids(pairs, 0), _ids(pairs, 1)) for src, dst, pairs in plan if pairs]
        per_block = self.layer_block_bytes * self.num_layers
        self.bytes_swapped_out += len(swap_out) * per_block
        self.bytes_swapped_in += len(swap_in) * per_block
        return [self.copier.submit([(src[name][i], dst[name][i], si, di)
                                    for src, dst, si, di in plan for name in src])
                for i in range(self.num_layers)]

    def fetch_layer(self, layer: int, host_ids: torch.Tensor, slices: torch.Tensor) -> int:
        """Submit: host blocks' layer `layer` -> device slices (flat ids). Returns a ticket."""
        self.bytes_fetched += host_ids.numel() * self.layer_block_bytes
        return self.copier.submit([(self.host_cache[name][layer], self.flat_cache[name],
                                    host_ids, slices) for name in self.host_cache])

    def offload_layer(self, layer: int, slices: torch.Tensor, host_ids: torch.Tensor) -> int:
        """Submit: device slices (flat ids) -> host blocks' layer `layer`. Returns a ticket."""
        self.bytes_offloaded += host_ids.numel() * self.layer_block_bytes
        return self.copier.submit([(self.flat_cache[name], self.host_cache[name][layer],
                                    slices, host_ids) for name in self.host_cache])


def _ids(pairs: list[tuple[int, int]], which: int) -> torch.Tensor:
    return torch.tensor([p[which] for p in pairs], dtype=torch.int64)


def plan_num_blocks(arch: ModelArchConfig, cache: CacheConfig, dtype: torch.dtype,
                    device: torch.device, max_model_len: int, max_num_seqs: int | None = None,
                    requested: bool = True) -> tuple[int, int]:
    """Number of device and host blocks that fit the budgets; refuses a pool too small for
    one full-length sequence. Without --kv-cache-memory the pool holds `max_num_seqs`
    full-length sequences, capped by free memory (kv_budget_bytes). requested: whether
    max_model_len is the user's --max-model-len (else fit_context's, for the refusal)."""
    per_block = bytes_per_block(arch, cache.block_size, dtype)
    need = -(-max_model_len // cache.block_size)
    budget = kv_budget_bytes(cache, device, _want_bytes(cache, per_block, max_model_len,
                                                        max_num_seqs))
    num_blocks = budget // per_block
    if num_blocks < need:
        least = max_model_len if requested else min(max_model_len, MIN_FIT_CONTEXT)
        short = (f"one sequence of --max-model-len {least}" if requested
                 else f"the {least} a run needs")
        raise ConfigError(
            f"the KV cache budget of {budget / 2**20:.1f} MiB holds {num_blocks * cache.block_size}"
            f" tokens, fewer than {short}; raise --kv-cache-memory to at least "
            f"{-(-least // cache.block_size) * per_block / 2**20:.1f} MiB or "
            f"{'lower' if requested else 'set a shorter'} --max-model-len")
    host = host_memory_bytes()
    if host is not None and cache.swap_space > host:  # (its pool is reserved, not touched,
        # until blocks move there; one past the machine's memory cannot even be reserved)
        raise ConfigError(f"--swap-space={cache.swap_space / 2**30:.1f} GiB is more than this "
                          f"machine's {host / 2**30:.1f} GiB of memory")
    return int(num_blocks), int(cache.swap_space // per_block)


def host_memory_bytes() -> int | None:
    """The machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _want_bytes(cache: CacheConfig, per_block: int, max_model_len: int,
                max_num_seqs: int | None) -> int | None:
    """Bytes of `max_num_seqs` full-length sequences above the blocks admission keeps free."""
    if max_num_seqs is None:
        return None
    keep = max(cache.watermark, cache.kv_offload_reserve if cache.kv_offload != "off" else 0)
    return math.ceil(max_num_seqs * -(-max_model_len // cache.block_size) / (1 - keep)) * per_block


# The shortest context a run without --max-model-len is shrunk to (or the model's own, if
# shorter); a budget holding less is refused, as a chat turn or two would not fit.
MIN_FIT_CONTEXT = 1024


def fit_context(context: int, cache: CacheConfig, per_block: int, device: torch.device,
                max_num_seqs: int | None = None) -> tuple[int, CacheConfig]:
    """The context length of a run without --max-model-len, and the cache config to plan it
    with. The model's own `context` (a draft model's, if shorter) where one sequence of it
    fits the KV budget; else (Llama 3's 131,072 tokens against a tenth of free memory) the
    longest whole number of blocks that does, at least MIN_FIT_CONTEXT, with the budget fixed
    in the returned config so the pool planned next is the one measured here. A budget below
    that keeps `context`, which plan_num_blocks then refuses with its one-line error.

    per_block: the bytes one block costs, every cache that grows with it (a draft model's) in.
    """
    want = _want_bytes(cache, per_block, context, max_num_seqs)
    budget = kv_budget_bytes(cache, device, want)
    tokens = budget // per_block * cache.block_size
    if tokens >= context or tokens < min(context, MIN_FIT_CONTEXT):
        return context, cache
    return tokens, dataclasses.replace(cache, kv_cache_memory=budget)


def kv_budget_bytes(cache: CacheConfig, device: torch.device, want: int | None = None) -> int:
    """The device KV pool's budget: --kv-cache-memory; else what the workload can use,
    `want` bytes (max_num_seqs full-length sequences), capped at kv_cache_fraction of the
    memory free now (without `want`, that cap)."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    cap = int(free_memory(device) * cache.kv_cache_fraction)
    return cap if want is None else min(want, cap)


def free_memory(device: torch.device) -> int:
    """Bytes the device has available now (CPU: MemAvailable)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
