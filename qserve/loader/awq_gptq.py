"""AWQ and GPTQ checkpoints (Hugging Face directories) -> qserve int4 / int4z, codes, scales and
zero points as stored.

config.json "quantization_config" names the method; the packed linears are stored as

    AutoAWQ, version "gemm"                        GPTQ (AutoGPTQ / GPTQModel)
    qweight int32 (in, out / 8): 8 outputs a word  qweight int32 (in / 8, out): 8 inputs a word,
            nibble i (bits 4i..4i+3) holds output          nibble i holds input 8r + i
            8c + AWQ_ORDER[i]
    qzeros  int32 (G, out / 8), packed as qweight  qzeros  int32 (G, out / 8), nibble i holds
                                                           output 8c + i; checkpoint_format
                                                           "gptq" (v1) stores zero - 1,
                                                           "gptq_v2" the zero itself
    scales  fp16 (G, out)                          scales  fp16 (G, out);  g_idx int32 (in,)

    w[o, i] = (q[o, i] - z[o, g]) * s[o, g]        g = i // group_size (GPTQ: g_idx[i])

qserve takes the codes and scales unchanged (formats/qtensor.py). GPTQ sym=true (every zero 8)
is qserve's symmetric int4, w = (q - 8) * s; otherwise the integer zero points are kept as
they are in int4z, w = (q - z) * s (z 0..15, or 16 where GPTQ v1 stored -1). Either way the
dequantized weights are the checkpoint's, bit for bit.

A mixture of experts is read the same way, linear by linear: AutoAWQ and GPTQModel pack each
expert's matrices under its own name (Mixtral block_sparse_moe.experts.{e}.w1/w2/w3, Qwen3-MoE
mlp.experts.{e}.gate_proj/up_proj/down_proj) and leave the router (gate) dense.

GPTQ act-order (desc_act with a g_idx that is not i // group_size) groups inputs out of order;
qserve's groups are contiguous, so such a checkpoint is refused rather than re-rounded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from qserve.config import ModelArchConfig
from qserve.errors import ModelLoadError
from qserve.formats import QuantizedTensor, pack_int4
from qserve.loader.weights import LazyWeights, Stored, read_safetensor
from qserve.models.registry import checkpoint_shapes, fused_groups

METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8c + AWQ_ORDER[i]
_AWQ_UNDO = tuple(AWQ_ORDER.index(j) for j in range(8))  # output j of a word is nibble _AWQ_UNDO[j]


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 (..., n) -> uint8 (..., 8n): nibble i of word j (bits 4i..4i+3) at 8j + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 15).to(torch.uint8).flatten(-2)


def _by_output(words: torch.Tensor, method: str) -> torch.Tensor:
    """int32 (rows, out / 8) packed along outputs -> uint8 (rows, out), outputs in order."""
    q = nibbles(words)
    if method == "awq":
        q = q.view(q.shape[0], -1, 8)[..., list(_AWQ_UNDO)].reshape(q.shape)
    return q


class _Spec:
    """A checkpoint's quantization_config, checked: method, group size, symmetry, zeros."""

    def __init__(self, quant: dict, where: Path):
        self.method = quant["quant_method"]
        self.where = where
        bits = quant.get("bits", quant.get("w_bit"))
        if bits != 4:
            raise ModelLoadError(f"{where}: {self.method} checkpoint with bits {bits!r}; qserve "
                                 f"imports 4-bit AWQ/GPTQ only")
        gs = quant.get("group_size", quant.get("q_group_size"))
        if isinstance(gs, bool) or not isinstance(gs, int) or not (gs == -1 or gs > 0):
            raise ModelLoadError(f"{where}: {self.method} group_size {gs!r}; expected a positive "
                                 f"multiple of 32 or -1 (one group per row)")
        self.group_size = gs
        if self.method == "awq":
            version = str(quant.get("version", "gemm")).lower()
            if version != "gemm":
                raise ModelLoadError(f"{where}: AWQ version {version!r}; qserve imports the GEMM "
                                     f"layout (version 'gemm') only")
            self.sym, self.zero_bias = False, 0
        else:
            fmt = quant.get("checkpoint_format", quant.get("format", "gptq"))
            if fmt not in ("gptq", "gptq_v2"):
                raise ModelLoadError(f"{where}: GPTQ checkpoint_format {fmt!r}; qserve imports "
                                     f"'gptq' (v1) and 'gptq_v2'")
            self.sym = bool(quant.get("sym", True))
            self.zero_bias = 1 if fmt == "gptq" else 0  # v1 stores zero - 1
        self.desc_act = bool(quant.get("desc_act", False))

    def expected(self, base: str, out: int, n_in: int) -> dict[str, tuple[tuple, torch.dtype]]:
        gs = n_in if self.group_size == -1 else self.group_size
        if n_in % gs or gs % 32 or out % 8:
            raise ModelLoadError(f"{self.where}: {base} is ({out}, {n_in}); {self.method} group "
                                 f"size {self.group_size} must divide its inputs and be a multiple "
                                 f"of 32, and its outputs a multiple of 8")
        G = n_in // gs
        qweight = (n_in, out // 8) if self.method == "awq" else (n_in // 8, out)
        specs = {"qweight": (qweight, torch.int32), "qzeros": ((G, out // 8), torch.int32),
                 "scales": ((G, out), None)}
        if self.method == "gptq":
            specs["g_idx"] = ((n_in,), torch.int32)
        return specs

    def to_qtensor(self, base: str, t: dict[str, torch.Tensor], n_in: int) -> QuantizedTensor:
        """The stored tensors of linear `base` -> an int4 (symmetric) or int4z QuantizedTensor
        of the same codes, scales and zero points."""
        G, out = t["scales"].shape
        gs = n_in // G
        if "g_idx" in t and not torch.equal(t["g_idx"].long(), torch.arange(n_in) // gs):
            raise ModelLoadError(
                f"{self.where}: {base}.g_idx reorders inputs (GPTQ desc_act / act-order); qserve "
                f"groups inputs contiguously and will not re-round them: export with desc_act "
                f"false")
        scales = t["scales"].to(torch.float16)
        if not torch.equal(scales.to(t["scales"].dtype), t["scales"]):
            raise ModelLoadError(f"{self.where}: {base}.scales ({t['scales'].dtype}) are not "
                                 f"all representable in fp16, qserve's int4 scale type")
        scales = scales.t().contiguous()  # (out, G)
        zeros = _by_output(t["qzeros"], self.method).t().long() + self.zero_bias  # (out, G)
        if self.method == "awq":
            codes = _by_output(t["qweight"], "awq").t()  # (out, in)
        else:
            codes = nibbles(t["qweight"].t().contiguous())  # (out, in)
        if self.sym:
            if not bool((zeros == 8).all()):
                raise ModelLoadError(f"{self.where}: {base}.qzeros are not all 8, though the "
                                     f"config says sym true")
            qt = QuantizedTensor("int4", pack_int4(codes.contiguous()), scales, None, n_in)
        else:  # int4z keeps its zero points where int4 keeps offsets
            qt = QuantizedTensor("int4z", pack_int4(codes.contiguous()), scales,
                                 zeros.to(torch.uint8), n_in)
        problem = qt.validate()
        assert problem is None, problem
        return qt


def quant_config(path: Path) -> dict | None:
    """The quantization_config of the AWQ / GPTQ directory `path` (quant_method awq or gptq),
    else None."""
    try:
        quant = json.loads((path / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return quant if isinstance(quant, dict) and quant.get("quant_method") in METHODS else None


def resident_layout(path: Path) -> tuple[str, dict[str, int]] | None:
    """What read_weights keeps of each packed linear of the AWQ / GPTQ directory `path`, from
    its config.json alone (the memory planner): the format (int4 for symmetric GPTQ, else
    int4z) and, per stored tensor suffix, resident bytes per stored value: qweight's int32
    words as they are, scales as fp16, each qzeros word as 8 uint8 zero points (int4z), no
    g_idx. None where `path` is not such a directory."""
    quant = quant_config(path)
    if quant is None:
        return None
    spec = _Spec(quant, path / "config.json")
    return ("int4" if spec.sym else "int4z",
            {"qweight": 4, "scales": 2, "qzeros": 0 if spec.sym else 8, "g_idx": 0})


def read_weights(path: Path, arch: ModelArchConfig, quant: dict,
                 where: dict[str, Stored], shapes: dict[str, tuple]) -> LazyWeights:
    """The model's weights from an AWQ/GPTQ directory: each packed linear as an int4 / int4z
    QuantizedTensor under `<name>.weight`, the rest as stored. `where` / `shapes`: every
    tensor in the directory's safetensors files -> (its file, stored name) / shape (from the
    headers: hf_loader.tensor_index)."""
    spec = _Spec(quant, path / "config.json")
    expected = checkpoint_shapes(arch)
    parts: dict[str, dict[str, tuple[tuple, torch.dtype | None]]] = {}
    for name, shape in expected.items():
        base = name.removesuffix(".weight")
        if len(shape) == 2 and base + ".qweight" in shapes:
            parts[name] = {base + "." + k: v for k, v in spec.expected(base, *shape).items()}
            if spec.method == "awq":
                parts[name].pop(base + ".g_idx", None)
            elif base + ".g_idx" not in shapes:  # older GPTQ exports without desc_act omit it
                parts[name].pop(base + ".g_idx")
        else:
            parts[name] = {name: (shape, None)}
    for names in parts.values():
        for key, (shape, _) in names.items():
            if key not in shapes:
                raise ModelLoadError(f"{path}: missing tensor {key}")
            if tuple(shapes[key]) != shape:
                raise ModelLoadError(f"{path}: tensor {key} has shape {tuple(shapes[key])}, "
                                     f"expected {shape} from the model's config and "
                                     f"{spec.method} layout")
    for group in fused_groups(arch):  # one matrix at run time: all packed or all dense
        packed = [p for p in group if len(parts[p + ".weight"]) > 1]
        if packed and len(packed) != len(group):
            raise ModelLoadError(f"{path}: {', '.join(group)} run as one matrix, but only "
                                 f"{', '.join(packed)} are quantized")

    def load(key: str, dtype) -> torch.Tensor:
        t = read_safetensor(where, key)
        if dtype is not None and t.dtype != dtype:
            raise ModelLoadError(f"{where[key].file}: tensor {where[key].name} has dtype "
                                 f"{t.dtype}, expected {dtype}")
        return t

    def read(name: str):
        names = parts[name]
        if len(names) == 1 and name in names:
            return load(name, None)
        base = name.removesuffix(".weight")
        t = {k.removeprefix(base + "."): load(k, d) for k, (_, d) in names.items()}
        return spec.to_qtensor(base, t, expected[name][1])

    return LazyWeights(dict(expected), read)
