"""Cache engine: the KV block pools themselves, on the device and in host memory.

Every cache tensor has the layout (num_layers, num_blocks, ...) so that moving blocks between
pools is one indexed copy per tensor, whatever the tensor holds: "k" and "v"
(num_layers, num_blocks, block_size, num_kv_heads, head_dim), and with int8 / int4 KV their
per-(token, head) scales and offsets beside them, so swap / copy move values and scales together:

    --kv-dtype      "k", "v", per block                 companions, per block: (bs, hkv) fp16
    fp32/fp16/bf16  (bs, hkv, d) float                  -
    int8            (bs, hkv, d) int8                   k_scale, v_scale
    int4            (bs, hkv, d / 2) uint8, 2 per byte  k_scale, k_offset, v_scale, v_offset

The KV "dtype" passed around is the storage dtype of the values: torch.int8 means int8 KV,
torch.uint8 means packed int4 KV (kernels/kv_quant.py).
On a CPU machine both pools are CPU tensors, but they stay separate pools with separate budgets.
"""
from __future__ import annotations

import torch

from qserve.config import CacheConfig, ModelArchConfig
from qserve.errors import ConfigError
from qserve.kernels.kv_quant import SCALE_DTYPE, kv_parts

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# --kv-dtype name -> storage dtype of the K/V values
KV_STORAGE = {**DTYPES, "int8": torch.int8, "int4": torch.uint8}


def kv_torch_dtype(cache: CacheConfig, model_dtype: torch.dtype, suggested: str | None = None
                   ) -> torch.dtype:
    """Storage dtype of the K/V values: --kv-dtype; for "auto", the checkpoint's `suggested`
    kv_dtype (a qserve recipe's) when it has one, else the model's dtype."""
    name = suggested if cache.kv_dtype == "auto" and suggested else cache.kv_dtype
    return model_dtype if name == "auto" else KV_STORAGE[name]


def cache_tensor_specs(arch: ModelArchConfig, block_size: int, dtype: torch.dtype
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-block shape and dtype of each named cache tensor (leading num_layers/num_blocks
    dimensions left out)."""
    d = arch.head_dim // 2 if dtype == torch.uint8 else arch.head_dim
    shape = (block_size, arch.num_kv_heads, d)
    specs = {}
    for which in ("k", "v"):
        specs[which] = (shape, dtype)
        for part in kv_parts(dtype):
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


class CacheEngine:
    def __init__(self, arch: ModelArchConfig, cache: CacheConfig, num_blocks: int,
                 num_host_blocks: int, device: torch.device, dtype: torch.dtype):
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = cache.block_size
        specs = cache_tensor_specs(arch, cache.block_size, dtype)
        L = arch.num_layers
        # zeros, not empty: the decode path reads whole blocks (masked past each sequence's
        # end), and garbage there could dequantize to inf/NaN, which a zero probability times V
        # does not undo. Host blocks are only ever read after a swap-out wrote them.
        self.device_cache = {name: torch.zeros((L, num_blocks, *shape), dtype=dt, device=device)
                             for name, (shape, dt) in specs.items()}
        pin = device.type == "cuda"
        self.host_cache = {name: torch.empty((L, num_host_blocks, *shape), dtype=dt,
                                             pin_memory=pin)
                           for name, (shape, dt) in specs.items()}
        self.bytes_swapped_out = 0
        self.bytes_swapped_in = 0

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's view of every cache tensor, each (num_blocks, ...)."""
        return {name: t[i] for name, t in self.device_cache.items()}

    @staticmethod
    def _move(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor],
              pairs: list[tuple[int, int]]) -> int:
        if not pairs:
            return 0
        moved = 0
        for name, s in src.items():
            d = dst[name]
            src_ids = torch.tensor([a for a, _ in pairs], device=s.device)
            dst_ids = torch.tensor([b for _, b in pairs], device=d.device)
            block = s[:, src_ids].to(d.device, non_blocking=True)  # (L, n, ...)
            d[:, dst_ids] = block
            moved += block.numel() * block.element_size()
        return moved

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs."""
        self.bytes_swapped_out += self._move(self.device_cache, self.host_cache, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        self.bytes_swapped_in += self._move(self.host_cache, self.device_cache, pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) device blocks, for copy-on-write."""
        self._move(self.device_cache, self.device_cache, pairs)


def plan_num_blocks(arch: ModelArchConfig, cache: CacheConfig, dtype: torch.dtype,
                    device: torch.device, max_model_len: int) -> tuple[int, int]:
    """Number of device and host blocks that fit the budgets; refuses a pool too small for
    one full-length sequence."""
    per_block = bytes_per_block(arch, cache.block_size, dtype)
    budget = kv_budget_bytes(cache, device)
    num_blocks = budget // per_block
    need = -(-max_model_len // cache.block_size)
    if num_blocks < need:
        raise ConfigError(
            f"the KV cache budget of {budget / 2**20:.1f} MiB holds {num_blocks * cache.block_size}"
            f" tokens, fewer than one sequence of --max-model-len {max_model_len}; raise "
            f"--kv-cache-memory to at least {need * per_block / 2**20:.1f} MiB or lower "
            f"--max-model-len")
    return int(num_blocks), int(cache.swap_space // per_block)


def kv_budget_bytes(cache: CacheConfig, device: torch.device) -> int:
    """The device KV pool's budget: --kv-cache-memory, else a fraction of free memory."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    return int(_free_memory(device) * cache.kv_cache_fraction)


def _free_memory(device: torch.device) -> int:
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
