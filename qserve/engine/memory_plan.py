"""The memory planner: before any weight is read, what a model will take on its device
(weights as they will be resident, the KV pools, the step's activations) against what the device
has free, so a model that cannot fit is refused with one line that says what would fit, never
an out-of-memory kill halfway through a load.

Weights are counted from the file's header alone: each tensor in the format the loader will
keep it in (qserve/formats; a GGUF's blocks as stored, fp16 kept as fp16 in an fp32 model,
dense tensors at the engine's dtype when dequantized).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from qserve.config import ModelArchConfig
from qserve.errors import ConfigError

GiB = 1 << 30
# The interpreter, torch and the tokenizer before any model: measured ~0.35 GiB RSS here.
CPU_BASELINE_BYTES = 512 << 20
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "I32": 4, "I64": 8}


@dataclass
class MemoryPlan:
    """Bytes each part takes, and what the device has; `check()` refuses what does not fit."""

    model: str
    device: str
    weight_bytes: int
    kv_bytes: int  # the device KV pool
    host_kv_bytes: int  # the swap pool; on a CPU device it is the same memory
    activation_bytes: int  # one step's working set, prefill's dequantized matrix included
    baseline_bytes: int
    available_bytes: int
    weight_formats: dict[str, dict[str, int]] = field(default_factory=dict)  # fmt -> n, bytes

    @property
    def total_bytes(self) -> int:
        host = self.host_kv_bytes + self.baseline_bytes if self.device == "cpu" else 0
        return self.weight_bytes + self.kv_bytes + self.activation_bytes + host

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
            + (f", swap pool {_gib(self.host_kv_bytes)}" if self.device == "cpu" else "")
            + f", activations {_gib(self.activation_bytes)}) but {_gib(self.available_bytes)} "
            f"is available; try {' or '.join(hints)}")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def plan_memory(path: Path, arch: ModelArchConfig, *, device: torch.device,
                dtype: torch.dtype, native: bool, kv_bytes: int, host_kv_bytes: int,
                max_num_batched_tokens: int, max_num_seqs: int,
                available_bytes: int | None = None) -> MemoryPlan:
    """The plan for `path` (a .gguf file or a model directory) run with these settings."""
    from qserve.engine.cache_engine import free_memory

    formats = resident_weights(path, arch, dtype, native)
    plan = MemoryPlan(
        model=str(path), device=device.type,
        weight_bytes=sum(v["bytes"] for v in formats.values()),
        kv_bytes=kv_bytes, host_kv_bytes=host_kv_bytes,
        activation_bytes=activation_bytes(arch, max_num_batched_tokens, max_num_seqs,
                                          dtype.itemsize),
        baseline_bytes=CPU_BASELINE_BYTES if device.type == "cpu" else 0,
        available_bytes=free_memory(device) if available_bytes is None else available_bytes,
        weight_formats=formats)
    return plan


def activation_bytes(arch: ModelArchConfig, tokens: int, seqs: int, itemsize: int) -> int:
    """One step's largest live set: per token the residual, the norm output, q/k/v, the
    gate/up pair and the MLP activation in fp32; logits for up to `seqs` rows (and the
    sampler's copy); and the fp32 copy of the largest layer matrix that a many-row (prefill)
    matmul dequantizes once."""
    h, i = arch.hidden_size, arch.intermediate_size
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    per_token = (3 * h + qkv + 3 * i) * max(itemsize, 4)
    logits = 2 * min(seqs, tokens) * arch.vocab_size * 4
    biggest = max(2 * i * h, qkv * h) * 4
    return tokens * per_token + logits + biggest


def resident_weights(path: Path, arch: ModelArchConfig, dtype: torch.dtype, native: bool
                     ) -> dict[str, dict[str, int]]:
    """Weight format -> {"tensors": count, "bytes": resident bytes}, from headers alone."""
    from qserve.loader.hf_loader import expected_shapes

    wanted = expected_shapes(arch)
    out: dict[str, dict[str, int]] = {}

    def add(fmt: str, nbytes: int) -> None:
        row = out.setdefault(fmt, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += nbytes

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
                raise gguf.error(f"tensor {info.name} has type {type_name}, which qserve "
                                 f"cannot run") from None
            if len(info.shape) == 1:
                add("f32", 4 * numel)
            elif not native or fmt is None:
                add(dense_name, dtype.itemsize * numel)
            elif fmt in ("f16", "bf16"):
                add(fmt if dtype == torch.float32 else dense_name, 2 * numel)
            else:
                add(fmt, info.nbytes)
        return out
    from qserve.loader.checkpoint import WEIGHTS_FILE, quantization_config

    quant = quantization_config(path)
    for name, dt, shape in _safetensors_tensors(path):
        base = name.rsplit(".", 1)[0]
        if quant is not None and name.rsplit(".", 1)[1] in ("qweight", "scales", "offsets"):
            layer = quant.get("layers", {}).get(base, {})
            fmt = layer.get("format") or f"int{layer.get('bits', 8)}"
            row = out.setdefault(fmt, {"tensors": 0, "bytes": 0})
            row["tensors"] += name.endswith(".qweight")
            row["bytes"] += _ITEMSIZE.get(dt, 4) * _numel(shape)
            continue
        if name not in wanted:
            continue
        kept = (native and dtype == torch.float32 and dt in ("F16", "BF16") and len(shape) == 2)
        if kept:
            add(dt.lower(), 2 * _numel(shape))
        elif len(shape) == 1:
            add("f32", 4 * _numel(shape))
        else:
            add(dense_name, dtype.itemsize * _numel(shape))
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _safetensors_tensors(path: Path):
    """(name, dtype string, shape) of every tensor in a directory's safetensors files, read
    from their JSON headers (8-byte length, then the header)."""
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                yield name, meta["dtype"], meta["shape"]
