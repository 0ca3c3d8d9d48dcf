"""The memory planner: before any weight is read, what a model will take on its device
(weights as they will be resident, the KV pools, the step's activations) against what the device
has free, so a model that cannot fit is refused with one line that says what would fit, never
an out-of-memory kill halfway through a load.

Weights are counted from the file's header alone: each tensor in the format the loader will
keep it in (qserve/formats; a GGUF's blocks as stored, fp16 kept as fp16 in an fp32 model,
dense tensors at the engine's dtype when dequantized).

On a CPU the plan is the process's peak RSS, term by term (measured with
/proc/self/smaps_rollup at each stage of `qserve generate`, README "Memory of a plain
`qserve generate`"):

    baseline    the interpreter, torch, qserve, the kernel library, the tokenizer
    weights     as resident
    KV pool     every device block, at the K/V dtype the run uses (resolve_kv_dtype): its
                pages become resident as blocks are first written (cache_engine.zeroed_pool),
                and a full pool is what is planned for; the host pool only where blocks can
                move there (swap preemption, layer-wise offload): untouched, its pages take
                nothing
    scratch     the buffer a prefill matmul dequantizes a block of weight rows into (at most
                about 32 MiB), kept for reuse (kernels/cpu_ops.py _scratch): bf16 where the
                CPU multiplies bf16 fast
    activations one step's transient peak: the larger of the attention (torch's CPU flash
                kernel; soft-capped scores are materialized, heads x 256 rows x context) and the
                MLP's fused gate/up product, beside the residual stream
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from qserve.config import EngineConfig, ModelArchConfig, is_count
from qserve.engine.cache_engine import DTYPES, kv_torch_dtype
from qserve.errors import ConfigError, ModelLoadError
from qserve.kernels import cpu_ops
from qserve.kernels.paged_attention import QUERY_BLOCK

GiB = 1 << 30
# The interpreter, torch (215 MiB of it), qserve and its kernel library before any model, and
# per vocabulary entry the tokenizer (its GGUF strings parsed, the Rust BPE model): measured at
# 49,152 and 128,256 tokens, README "Memory of a plain `qserve generate`".
CPU_BASELINE_BYTES = 256 << 20
CPU_TOKENIZER_BYTES_PER_TOKEN = 350
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "I32": 4, "I64": 8}


@dataclass
class MemoryPlan:
    """Bytes each part takes, and what the device has; `check()` refuses what does not fit."""

    model: str
    device: str
    weight_bytes: int
    kv_bytes: int  # the device KV pool
    host_kv_bytes: int  # the swap pool where blocks can move there; on a CPU the same memory
    scratch_bytes: int  # the reused buffer of prefill's dequantized matrix (CPU)
    activation_bytes: int  # one step's transient peak
    baseline_bytes: int
    available_bytes: int
    weight_formats: dict[str, dict[str, int]] = field(default_factory=dict)  # fmt -> n, bytes
    # an untied token embedding left in its file (embedding_in_file): read a few rows a step,
    # so the page cache holds what is read often and the process none of it
    file_weight_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        host = self.host_kv_bytes + self.baseline_bytes if self.device == "cpu" else 0
        return (self.weight_bytes + self.kv_bytes + self.scratch_bytes + self.activation_bytes
                + host)

    def to_dict(self) -> dict:
        return asdict(self) | {"total_bytes": self.total_bytes,
                               "fits": self.total_bytes <= self.available_bytes}

    def check(self) -> None:
        """Raise ConfigError when the plan does not fit, naming what would."""
        if self.total_bytes <= self.available_bytes:
            return
        other = self.total_bytes - self.kv_bytes
        hints = []
        room = self.available_bytes - other
        if room > 0:
            hints.append(f"--kv-cache-memory {room * 9 // 10 >> 20}MiB")
        if self.device == "cpu" and self.host_kv_bytes:
            hints.append("--swap-space 0")
        if self.weight_bytes > self.available_bytes // 2:
            hints.append("a 4-bit model (qserve quantize --recipe w4g64, or a Q4_K_M GGUF)")
        hints.append("a smaller --max-model-len / --max-num-batched-tokens")
        raise ConfigError(
            f"{self.model} needs {_gib(self.total_bytes)} on {self.device} (weights "
            f"{_gib(self.weight_bytes)}, KV pool {_gib(self.kv_bytes)}"
            + (f", swap pool {_gib(self.host_kv_bytes)}" if self.host_kv_bytes else "")
            + f", activations {_gib(self.scratch_bytes + self.activation_bytes)}) but "
            f"{_gib(self.available_bytes)} is available; try {' or '.join(hints)}")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def plan_memory(path: Path, arch: ModelArchConfig, config: EngineConfig, *,
                device: torch.device, dtype: torch.dtype, kv_bytes: int, host_kv_bytes: int,
                max_model_len: int, available_bytes: int | None = None) -> MemoryPlan:
    """The plan for `path` (a .gguf file or a model directory) run with `config`.

    Args:
        kv_bytes, host_kv_bytes: the device and host KV pools the engine will allocate.
        max_model_len: the longest context a prefill chunk attends to.
        available_bytes: what the device has free (default: read now).
    """
    from qserve.engine.cache_engine import free_memory

    native, sched = config.weights == "native", config.scheduler
    tensors = list(resident_tensors(path, arch, dtype, native))
    cpu = device.type == "cpu"
    in_file = [t for t in tensors if t[0] == "model.embed_tokens.weight"] if embedding_in_file(
        path, arch, device) else []
    tensors = [t for t in tensors if t not in in_file]
    if cpu:  # the bytes of the layouts the CPU kernels run (cpu_ops.runtime_layout: q4_k
        # and q6_k interleaved take a little more); formats are still named as stored
        tensors = [(name, fmt, cpu_ops.runtime_bytes(fmt, nbytes, shape)[1], shape)
                   for name, fmt, nbytes, shape in tensors]
    formats = _by_format(tensors)
    # a step's tokens: several sequences' prompt chunks share one budget, so a context
    # shorter than the budget does not bound it (32 prompts of 128 tokens fill 512)
    tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * max_model_len)
    swaps = sched.preemption_mode == "swap" or config.cache.kv_offload != "off"
    spec = config.speculative  # verifying K drafts takes logits at K + 1 positions a sequence
    logit_rows = sched.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
    return MemoryPlan(
        model=str(path), device=device.type,
        weight_bytes=sum(v["bytes"] for v in formats.values()),
        kv_bytes=kv_bytes, host_kv_bytes=host_kv_bytes if swaps else 0,
        scratch_bytes=scratch_bytes(tensors, arch, dtype, tokens, logit_rows) if cpu else 0,
        activation_bytes=activation_bytes(arch, tokens, max_model_len, logit_rows, cpu),
        baseline_bytes=(CPU_BASELINE_BYTES + CPU_TOKENIZER_BYTES_PER_TOKEN * arch.vocab_size
                        if cpu else 0),
        available_bytes=free_memory(device) if available_bytes is None else available_bytes,
        weight_formats=formats, file_weight_bytes=sum(t[2] for t in in_file))


def embedding_in_file(path: Path, arch: ModelArchConfig, device: torch.device) -> bool:
    """Whether the model leaves its token embedding in the file, reading the rows a step looks
    up (models/base.py load_weights, FileEmbedding): an untied one, on a CPU, from a GGUF,
    unless QSERVE_EMBEDDING_IN_FILE=0. (A safetensors checkpoint's tensors are mapped from
    their file by safetensors, so its table's untouched rows take no memory either.)"""
    from qserve.loader.weights import rows_from_file

    return (device.type == "cpu" and not arch.tie_word_embeddings and not path.is_dir()
            and rows_from_file())


# Stored formats the int8 GEMM takes on every build that has it (AVX2 and AVX-512 VNNI): every
# packed one (the AVX2 build multiplies 8-bit codes as two 4-bit planes); the dense ones keep
# their float GEMM.
INT8_GEMM_FORMATS = frozenset({"int4", "int4z", "int8", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k",
                               "q5_k", "q6_k", "iq4_nl", "iq4_xs", "mxfp4"})


def scratch_bytes(tensors: list[tuple[str, str, int, tuple[int, ...]]], arch: ModelArchConfig,
                  dtype: torch.dtype, tokens: int, logit_rows: int) -> int:
    """The CPU prefill's reused buffer (kernels/cpu_ops.py _scratch): a matmul of more than
    FUSED_MAX_ROWS rows dequantizes its packed matrix, one stacked segment at a time (the
    parts of a fused projection in one format stack into one) and within it a block of about
    cpu_ops.SCRATCH_BYTES at a time (cpu_ops.block_rows), into a buffer kept at the largest
    block's size; the output matrix counts when more than that many logit rows are taken in
    one step. The int8 GEMM (cpu_ops.int8_gemm: AVX2 and AVX-512 VNNI builds without AMX)
    keeps no such buffer for the formats it takes: it rounds 16 weight rows at a time into a
    per-thread tile of at most 16 x K bytes."""
    from qserve.models import registry

    gemm = cpu_ops.int8_activations() and cpu_ops.int8_gemm()
    itemsize = 2 if cpu_ops.int8_activations() and cpu_ops.fast_bf16() else 4
    dense = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]

    def dequantized(fmt: str) -> bool:
        return fmt != dense and not (gemm and fmt in INT8_GEMM_FORMATS)
    packed = {name: (fmt, shape) for name, fmt, _, shape in tensors
              if len(shape) == 2 and dequantized(fmt) and not name.endswith("embed_tokens.weight")}
    head = [n for n in packed if n.startswith("lm_head.")]
    if min(logit_rows, tokens) <= cpu_ops.FUSED_MAX_ROWS:
        for name in head:
            del packed[name]
    elif arch.tie_word_embeddings:  # the embedding is the output matrix
        packed.update({n: (f, s) for n, f, _, s in tensors if n.endswith("embed_tokens.weight")
                       and dequantized(f)})
    if tokens <= cpu_ops.FUSED_MAX_ROWS or not packed:
        return 0
    rows = {name: shape[0] for name, (_, shape) in packed.items()}
    mapping = registry.model_class(arch.architecture).packed_modules_mapping
    for parts in mapping.values():  # neighbours of one format: one segment
        for name in list(rows):
            owner, _, leaf = name.removesuffix(".weight").rpartition(".")
            if leaf != parts[0]:
                continue
            run = f"{owner}.{parts[0]}.weight"
            for part in parts[1:]:
                nxt = f"{owner}.{part}.weight"
                if nxt in packed and run in packed and packed[nxt][0] == packed[run][0]:
                    rows[run] += rows.pop(nxt)
                else:
                    run = nxt
    def block(name: str, n: int) -> int:  # a segment of n rows: its largest block's values
        K = packed[name][1][1]
        return min(n, cpu_ops.block_rows(K, itemsize)) * K
    return max(block(name, n) for name, n in rows.items()) * itemsize


def activation_bytes(arch: ModelArchConfig, tokens: int, context: int, logit_rows: int,
                     cpu: bool) -> int:
    """One step's transient peak for a chunk of `tokens` tokens attending to up to `context`
    positions, activations in fp32: what stays live through a layer, beside the larger of the
    attention and the MLP; plus up to `logit_rows` rows of logits and the sampler's copy.

    Live through a layer: the residual stream (x, residual, normed), q/k/v, and what the
    allocator keeps of the previous MLP: (6 hidden + 3 intermediate) fp32 values a token, as
    measured on the 1B and 8B shapes. The MLP: its fused gate/up product in fp32, with the
    bf16 and fp32 GEMM results it is copied from, and the activation. The attention: q, its
    output and K/V; on a CPU, torch's flash kernel works in blocks (kernels/paged_attention.py
    _attend; with sinks, _attend_sinks), with a chunk's mask as fp32 (tokens x context);
    soft-capped scores, and sinks off a CPU (_attend_scored), are materialized, fp32 scores
    and probabilities (heads, QUERY_BLOCK rows, context): 9 bytes a score, as measured for
    torch's math path at 500-2,000 tokens."""
    h, i, H, d = arch.hidden_size, arch.intermediate_size, arch.num_heads, arch.head_dim
    live = tokens * (6 * h + 3 * i) * 4
    attention = tokens * 3 * H * d * 4
    if arch.attn_logit_softcapping or (arch.attention_sinks and not cpu):
        attention += 9 * H * min(tokens, QUERY_BLOCK) * context
    elif cpu:
        attention += 4 * tokens * context
    mlp = tokens * (2 * i * (4 + 2 + 4) + 2 * h + i * 4)
    logits = 2 * min(logit_rows, tokens) * arch.vocab_size * 4
    return live + max(attention, mlp) + logits


def resolve_kv_dtype(path: Path, arch: ModelArchConfig, config: EngineConfig,
                     loaded=None) -> torch.dtype:
    """The K/V storage dtype a run of the model at `path` with `config` uses (kv_torch_dtype:
    "auto" follows a qserve checkpoint's recipe kv_dtype). `loaded`: the LoadedModel of
    `path` where the caller has one: its quant, and its weights where they are in memory
    already; else the file's headers say how the loader will keep them.

    "auto" on a CPU stores K/V in fp16 (llama.cpp's default: half the pool of fp32; decode
    measured as fast, README "K/V in fp16 on a CPU") where the run's matmuls already work
    below fp32: weights kept in 16 bits or fewer and activations approximated
    (cpu_ops.int8_activations). An fp32 checkpoint, `--weights dense` or
    QSERVE_CPU_ACTIVATIONS=fp32 keeps the model's fp32 end to end."""
    from qserve.loader.checkpoint import quantization_config
    from qserve.loader.weights import LazyWeights

    dtype = DTYPES[config.resolved_dtype()]
    quant = loaded.quant if loaded is not None else quantization_config(path)
    weights = loaded.weights if loaded is not None else None

    def below_fp32() -> bool:
        if weights is not None and not isinstance(weights, LazyWeights):
            return any(not isinstance(w, torch.Tensor) or w.dtype != torch.float32
                       for w in weights.values())
        native = config.weights == "native"
        return any(fmt != "f32" for _, fmt, _, _ in resident_tensors(path, arch, dtype, native))

    half = (config.cache.kv_dtype == "auto" and not (quant or {}).get("kv_dtype")
            and dtype == torch.float32 and config.resolved_device() == "cpu"
            and cpu_ops.int8_activations() and below_fp32())
    return kv_torch_dtype(config.cache, dtype, (quant or {}).get("kv_dtype"), half=half)


def resident_weights(path: Path, arch: ModelArchConfig, dtype: torch.dtype, native: bool
                     ) -> dict[str, dict[str, int]]:
    """Weight format -> {"tensors": count, "bytes": resident bytes}, from headers alone."""
    return _by_format(resident_tensors(path, arch, dtype, native))


def _by_format(tensors) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for _, fmt, nbytes, _ in tensors:
        row = out.setdefault(fmt, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += nbytes
    return out


def resident_tensors(path: Path, arch: ModelArchConfig, dtype: torch.dtype, native: bool):
    """(HF name, format, resident bytes, shape (out, in) or (n,)) of every weight the model
    keeps, from the file's headers alone; a packed linear is one entry: a qserve checkpoint's
    qweight, scales and offsets (int4z: zero points) together, an AWQ / GPTQ one's as the
    importer keeps them (awq_gptq.resident_layout)."""
    from qserve.loader.hf_loader import expected_shapes

    wanted = expected_shapes(arch)
    dense_name = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    if not path.is_dir():
        from qserve.formats import format_for_ggml
        from qserve.loader.gguf_loader import GGUFFile, hf_names, tensor_types

        gguf = GGUFFile(path)
        names = {h: g for g, h in hf_names(arch).items()}
        for hf, type_name in tensor_types(gguf, arch).items():
            info = gguf.tensors[names[hf]]
            numel = _numel(info.shape)
            try:
                fmt = format_for_ggml(type_name)
            except KeyError:
                raise gguf.type_error(info.name, type_name) from None
            if len(info.shape) == 1:
                yield hf, "f32", 4 * numel, info.shape
            elif not native or fmt is None:
                yield hf, dense_name, dtype.itemsize * numel, info.shape
            elif fmt in ("f16", "bf16"):
                yield hf, fmt if dtype == torch.float32 else dense_name, 2 * numel, info.shape
            else:
                yield hf, fmt, info.nbytes, info.shape
        return
    from qserve.loader.awq_gptq import resident_layout
    from qserve.loader.checkpoint import quantization_config

    quant = quantization_config(path)
    imported = resident_layout(path) if quant is None else None  # (format, suffix -> bytes)
    packed: dict[str, list] = {}  # base name -> [format, bytes]
    for name, dt, shape in _model_tensors(path, arch):
        if dt == "MXFP4":  # a family's own quantized tensors (gpt-oss's experts)
            yield name, "mxfp4", _numel(shape) // 32 * 17, tuple(shape)
            continue
        base, _, leaf = name.rpartition(".")
        if quant is not None and leaf in ("qweight", "scales", "offsets"):
            layer = quant.get("layers", {}).get(base, {})
            entry = packed.setdefault(base, [layer.get("format") or
                                             f"int{layer.get('bits', 8)}", 0])
            entry[1] += _ITEMSIZE.get(dt, 4) * _numel(shape)
            continue
        if imported is not None and leaf in imported[1]:
            entry = packed.setdefault(base, [imported[0], 0])
            entry[1] += imported[1][leaf] * _numel(shape)
            continue
        if name not in wanted:
            continue
        kept = (native and dtype == torch.float32 and dt in ("F16", "BF16") and len(shape) == 2)
        if kept:
            yield name, dt.lower(), 2 * _numel(shape), tuple(shape)
        elif len(shape) == 1:
            yield name, "f32", 4 * _numel(shape), tuple(shape)
        else:
            yield name, dense_name, dtype.itemsize * _numel(shape), tuple(shape)
    for base, (fmt, nbytes) in packed.items():
        yield base + ".weight", fmt, nbytes, tuple(wanted.get(base + ".weight", ()))


def _model_tensors(path: Path, arch: ModelArchConfig):
    """(name, dtype string, shape) of the tensors the model reads from a directory's
    safetensors files, from their headers: under the names it reads them by (a
    vision-language checkpoint's text half alone), and as its family splits stored ones up
    (stacked experts; a part of a quantized format has that format for its dtype)."""
    from qserve.loader.hf_loader import language_names
    from qserve.models.registry import model_class

    rename = language_names(path)
    entries = {name: (dt, tuple(shape)) for stored, dt, shape in _safetensors_tensors(path)
               if (name := rename(stored)) is not None}
    shapes = {name: shape for name, (_, shape) in entries.items()}
    split = model_class(arch.architecture).stored_tensors
    for name, (dt, shape) in entries.items():
        parts = split(name, shape, shapes)
        if parts is None:
            yield name, dt, shape
            continue
        for part, part_shape, _, _, fmt in parts:
            yield part, fmt.upper() if fmt else dt, part_shape


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _safetensors_tensors(path: Path):
    """(name, dtype string, shape) of every tensor in a directory's safetensors files, read
    from their JSON headers (8-byte length, then the header)."""
    for file in sorted(path.glob("*.safetensors")):
        try:  # (a corrupt header is the loader's one-line error, not a traceback from here)
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n > os.fstat(f.fileno()).st_size - 8:
                    raise ValueError(f"a {n}-byte header is longer than the file")
                header = json.loads(f.read(n))
            entries = [(name, meta["dtype"], meta["shape"]) for name, meta in header.items()
                       if name != "__metadata__"]
            for name, dt, shape in entries:
                if (not isinstance(dt, str) or not isinstance(shape, list) or
                        not all(is_count(s, 0) for s in shape)):
                    raise ValueError(f"tensor {name} has dtype {dt!r}, shape {shape!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file (header: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__})"
                                 ) from None
        yield from entries
