"""QuantizedTensor: one packed (out, in) weight matrix, its format named explicitly.

qserve's own formats (qserve/quant/schemes.py quantizes into them) group along the input
dimension, so every output row has its own scales and rows of several matrices stack:

    int4   qweight uint8 (out, in_p // 2)  codes 0..15, two a byte: byte j holds input 2j in
                                           its low nibble and 2j + 1 in its high one
                                             symmetric   w = (q - 8) * scale
                                             asymmetric  w = q * scale + offset
    int4z  qweight uint8 (out, in_p // 2)  as int4, w = (q - zero) * scale: AWQ / GPTQ's
                                           asymmetric layout, the checkpoint's own integers
    int8   qweight int8  (out, in_p)       codes -128..127, w = q * scale
           scales  fp16  (out, G)          one per group; G = in_p / group_size
           offsets fp16  (out, G)          int4 asymmetric only
                   uint8 (out, G)          int4z: the zero points (0..15; 16 where GPTQ v1
                                           stored -1), read as such because the format says so

in_p is in_features rounded up to whole groups (padded columns are sliced off).

GGML formats (qserve/formats/ggml.py) keep a GGUF tensor's blocks as the file has them:

    q4_k ...  qweight uint8 (out, row_bytes)   row n = in / block blocks of block_bytes,
                                               codes and scales interleaved as ggml lays them
    f16/bf16  qweight fp16/bf16 (out, in)      a dense matrix kept at its stored precision

scales and offsets are None for those.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qserve.formats.weight_format import get_format
from qserve.heap import weight_buffer


@dataclass
class QuantizedTensor:
    """One packed matrix (see the module docstring for the layouts)."""

    format: str  # a key of qserve.formats.FORMATS
    qweight: torch.Tensor
    scales: torch.Tensor | None
    offsets: torch.Tensor | None
    in_features: int

    @property
    def fmt(self):
        return get_format(self.format)

    @property
    def bits(self) -> int:
        """Code bits (int4/int8); GGML formats report their nominal width (q4_k: 4)."""
        return self.fmt.bits

    @property
    def padded_in(self) -> int:
        if self.format in ("int4", "int4z", "int4_x16"):
            return self.qweight.shape[1] * 2
        if self.format == "int8":
            return self.qweight.shape[1]
        return self.in_features

    @property
    def group_size(self) -> int:
        """Inputs per scale group: int4/int4z/int8 from the scales' shape, GGML its block."""
        if self.scales is not None:
            return self.padded_in // self.scales.shape[1]
        return self.fmt.block

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Suffix -> tensor, as stored in a checkpoint under `<layer>.<suffix>`."""
        out = {"qweight": self.qweight}
        if self.scales is not None:
            out["scales"] = self.scales
        if self.offsets is not None:
            out["offsets"] = self.offsets
        return out

    def rows(self, idx) -> "QuantizedTensor":
        """The matrix of output rows `idx` (an index or slice along out)."""
        if self.fmt.rows is not None:  # interleaved rows: in the base format
            return self.fmt.rows(self, idx)
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return QuantizedTensor(self.format, self.qweight[idx], pick(self.scales),
                               pick(self.offsets), self.in_features)

    def dequantize(self) -> torch.Tensor:
        """-> (out, in_features) fp32, the reference every kernel is tested against."""
        return self.fmt.dequantize(self)

    def validate(self) -> str | None:
        """What is wrong with the tensors' shapes/dtypes for this format, or None."""
        return self.fmt.validate(self)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) uint8 codes in [0, 15], in even -> (out, in // 2) uint8."""
    assert q.dtype == torch.uint8 and q.shape[-1] % 2 == 0
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(out, n) uint8 -> (out, 2n) uint8 codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(*packed.shape[:-1], -1)


def stackable(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Whether b's rows can go under a's in one matrix (cat_quantized): the same format,
    input size, group size and symmetry."""
    return (a.format, a.group_size, a.in_features, a.offsets is None) == (
        b.format, b.group_size, b.in_features, b.offsets is None)


def cat_quantized(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack matrices of one format and input size along the output dim (exact)."""
    first = parts[0]
    if not all(stackable(first, p) for p in parts[1:]):
        raise ValueError("fused matrices must share format, group size and symmetry")
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    codes = [p.qweight for p in parts]
    stack = weight_buffer((sum(c.shape[0] for c in codes), *codes[0].shape[1:]), codes[0].dtype,
                          codes[0].device)  # in 2 MiB pages
    return QuantizedTensor(first.format, torch.cat(codes, out=stack),
                           cat([p.scales for p in parts]), cat([p.offsets for p in parts]),
                           first.in_features)
