"""The rows of the weight-format table (weight_format.py), one per format, as llama.cpp keeps
one type-traits row per quantization type. Adding a format is one row here (plus its layout module) and its
kernels keyed by `kind`:

    kernels/cpu_ops.c        wmatmul / wdequant switch on `kind` (the C row kernels)
    kernels/dispatch.py      the Triton kernel per format name on CUDA
    QuantizedTensor          names its format; nothing infers it from a dtype
"""
from __future__ import annotations

import torch

import qserve.formats.ggml as ggml
from qserve.formats.qtensor import QuantizedTensor, unpack_int4
from qserve.formats.weight_format import (GGML_KIND_BASE, KIND_BF16, KIND_F16, KIND_F32,
                                          KIND_INT4, KIND_INT4Z, KIND_INT4_X16, KIND_INT8,
                                          KIND_Q4_K_X16, KIND_Q6_K_X16, WeightFormat,
                                          register)


def _grouped_dequantize(qt: QuantizedTensor) -> torch.Tensor:
    out, G = qt.scales.shape
    if qt.format == "int4":
        q = unpack_int4(qt.qweight).float()
        if qt.offsets is None:
            q = q - 8
    else:
        q = qt.qweight.float()
    w = q.view(out, G, -1) * qt.scales.float()[..., None]  # (out, G, group_size)
    if qt.offsets is not None:
        w = w + qt.offsets.float()[..., None]
    return w.view(out, -1)[:, :qt.in_features]


def _int4z_dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """(q - z) * s in fp32, exact: q - z (8 bits for any uint8 z) times s (fp16, 11
    significant bits) fits fp32's 24, and so do q s and -z s, so a kernel that computes
    q s + o with o = -z s in fp32 gets these values bit for bit."""
    out, G = qt.scales.shape
    q = unpack_int4(qt.qweight).float().view(out, G, -1)  # (out, G, group_size)
    w = (q - qt.offsets.float()[..., None]) * qt.scales.float()[..., None]
    return w.view(out, -1)[:, :qt.in_features]


def _grouped_validate(qt: QuantizedTensor) -> str | None:
    want = torch.int8 if qt.format == "int8" else torch.uint8
    if qt.qweight.dtype != want or qt.qweight.dim() != 2:
        return f"qweight must be a 2-D {want} tensor, got {qt.qweight.dtype} {tuple(qt.qweight.shape)}"
    if qt.scales is None or qt.scales.dim() != 2 or qt.scales.dtype != torch.float16:
        return "scales must be a 2-D fp16 tensor"
    out, G = qt.scales.shape
    if qt.qweight.shape[0] != out or qt.padded_in % G:
        return (f"qweight {tuple(qt.qweight.shape)} and scales {tuple(qt.scales.shape)} "
                f"do not agree")
    if not qt.padded_in - qt.group_size < qt.in_features <= qt.padded_in:
        return f"packed width {qt.padded_in} does not fit {qt.in_features} inputs"
    if qt.format == "int4z":
        z = qt.offsets
        if z is None or z.dtype != torch.uint8 or z.shape != qt.scales.shape:
            return "int4z zero points (offsets) must be a uint8 tensor shaped as the scales"
        return None
    if qt.offsets is not None and (qt.format == "int8" or qt.offsets.shape != qt.scales.shape
                                   or qt.offsets.dtype != torch.float16):
        return "offsets must be fp16 and match scales (int4 asymmetric only)"
    return None


def _dense_validate(dtype: torch.dtype):
    def validate(qt: QuantizedTensor) -> str | None:
        w = qt.qweight
        if w.dtype != dtype or w.dim() != 2 or w.shape[1] != qt.in_features:
            return f"expected a ({w.shape[0]}, {qt.in_features}) {dtype} matrix"
        return None
    return validate


def _ggml_dequantize(qt: QuantizedTensor) -> torch.Tensor:
    out = qt.qweight.shape[0]
    t = ggml.TYPES[qt.format]
    blocks = qt.qweight.reshape(-1, t.block_bytes)
    return ggml.dequantize_blocks(qt.format, blocks).view(out, qt.in_features)


def _ggml_validate(qt: QuantizedTensor) -> str | None:
    t = ggml.TYPES[qt.format]
    if qt.in_features % t.block:
        return f"{qt.in_features} inputs are not a multiple of {qt.format}'s block of {t.block}"
    want = qt.in_features // t.block * t.block_bytes
    w = qt.qweight
    if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != want:
        return (f"{qt.format} rows of {qt.in_features} inputs take {want} bytes, got "
                f"{w.dtype} {tuple(w.shape)}")
    return None


register(WeightFormat("int4", KIND_INT4, 4, 0, _grouped_dequantize, _grouped_validate,
                      description="qserve int4, groups of 32/64/128, sym or asym"))
register(WeightFormat("int4z", KIND_INT4Z, 4, 0, _int4z_dequantize, _grouped_validate,
                      description="int4 with integer zero points, w = (q - z) * s: AWQ/GPTQ "
                                  "asymmetric, as the checkpoint stores it"))
register(WeightFormat("int8", KIND_INT8, 8, 0, _grouped_dequantize, _grouped_validate,
                      description="qserve int8, per channel or grouped, sym"))
register(WeightFormat("f32", KIND_F32, 32, 1, lambda qt: qt.qweight.float(),
                      _dense_validate(torch.float32), description="fp32 (a dense segment)"))
register(WeightFormat("f16", KIND_F16, 16, 1, lambda qt: qt.qweight.float(),
                      _dense_validate(torch.float16), description="fp16 kept as stored"))
register(WeightFormat("bf16", KIND_BF16, 16, 1, lambda qt: qt.qweight.float(),
                      _dense_validate(torch.bfloat16), description="bf16 kept as stored"))
for _name in ggml.IN_PLACE:
    _t = ggml.TYPES[_name]
    register(WeightFormat(_name, GGML_KIND_BASE + _t.type_id, 8 * _t.block_bytes / _t.block,
                          _t.block, _ggml_dequantize, _ggml_validate, ggml_type=_t.type_id,
                          description=f"GGML {_name.upper()} blocks read in place"))



def _x16_validate(qt: QuantizedTensor) -> str | None:
    base, row_bytes = ggml.INTERLEAVED[qt.format][:2]
    w = qt.qweight
    if qt.in_features % 256:
        return f"{qt.in_features} inputs are not a multiple of {base}'s block of 256"
    want = qt.in_features // 256 * row_bytes
    if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != want:
        return (f"{qt.format} rows of {qt.in_features} inputs take {want} bytes, got "
                f"{w.dtype} {tuple(w.shape)}")
    if w.shape[0] % ggml.X16_ROWS:
        return f"{qt.format} needs a multiple of {ggml.X16_ROWS} rows, got {w.shape[0]}"
    return None


# Not a file's type: how the CPU kernels run a q4_k / q6_k / int4 matrix (kernels/cpu_ops.py
# runtime_layout), never stored.
def _int4_x16_validate(qt: QuantizedTensor) -> str | None:
    problem = _grouped_validate(qt)
    if problem is None and qt.qweight.shape[0] % ggml.X16_ROWS:
        return f"int4_x16 needs a multiple of {ggml.X16_ROWS} rows, got {qt.qweight.shape[0]}"
    if problem is None and qt.group_size % 32:
        return f"int4_x16 needs groups of a multiple of 32 inputs, got {qt.group_size}"
    return problem


register(WeightFormat("int4_x16", KIND_INT4_X16, 4, 0,
                      lambda qt: ggml.deinterleave(qt).dequantize(), _int4_x16_validate,
                      description="qserve int4, 16 rows interleaved (the CPU's runtime layout)",
                      rows=ggml.interleaved_rows))
for _name, _kind in (("q4_k_x16", KIND_Q4_K_X16), ("q6_k_x16", KIND_Q6_K_X16)):
    _base, _row_bytes = ggml.INTERLEAVED[_name][:2]
    register(WeightFormat(_name, _kind, 8 * _row_bytes / 256, 256,
                          lambda qt: ggml.deinterleave(qt).dequantize(), _x16_validate,
                          description=f"GGML {_base.upper()} blocks, 16 rows interleaved (the "
                                      f"CPU's runtime layout)",
                          rows=ggml.interleaved_rows))

def format_for_ggml(type_name: str) -> str | None:
    """The format a GGUF tensor of GGML type `type_name` (e.g. 'Q4_K') runs in: repacked
    losslessly (Q4_0 -> int4, Q8_0 -> int8), in place (Q4_K -> q4_k), kept at its stored
    precision (F16 -> f16), or None for F32 (a plain fp32 tensor). Raises KeyError for a type
    qserve cannot run (IQ*, TQ*)."""
    name = type_name.lower()
    if name == "f32":
        return None
    if name in ("f16", "bf16"):
        return name
    if name in ggml.REPACKED:
        return ggml.REPACKED[name]
    if name in ggml.IN_PLACE:
        return name
    raise KeyError(type_name)
