"""Integer weight formats: quantize, dequantize and pack one (out, in) weight matrix.

Groups run along the input dimension, so every output row (channel) has its own scales and
rows of different matrices can be stacked (fused q/k/v, gate/up) without changing any value:

    qweight  int8  (out, in_p)       8-bit codes in [-128, 127]         w = q * scale
             uint8 (out, in_p // 2)  4-bit codes in [0, 15], two a byte:
                                       symmetric   w = (q - 8) * scale
                                       asymmetric  w = q * scale + offset
    scales   fp16  (out, G)          one per group of `group_size` inputs; G = in_p / group_size
    offsets  fp16  (out, G)          asymmetric only (the group's minimum)

in_p is in_features rounded up to whole groups; the padded columns dequantize to values that are
sliced off. Byte j of a 4-bit row holds input 2j in its low nibble and 2j + 1 in its high one.
Dequantization is (q * scale) + offset in fp32, two roundings in that order, which is what
gguf-py does for Q4_0/Q4_1/Q8_0, so imported GGUF blocks dequantize bit for bit alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
_FP16_TINY = 2.0 ** -24  # smallest fp16 subnormal: a scale below it would round to zero


@dataclass(frozen=True)
class WeightScheme:
    """How one matrix is quantized. group_size None: one group per output channel."""

    bits: int
    group_size: int | None
    sym: bool

    def __post_init__(self):
        assert self.bits in BITS, self.bits
        assert self.bits == 4 or self.sym, "8-bit is symmetric only"
        assert self.bits == 8 or self.group_size is not None, "4-bit needs groups"

    def __str__(self) -> str:
        groups = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"int{self.bits} {groups} {'sym' if self.sym else 'asym'}"


@dataclass
class QuantizedTensor:
    """One packed matrix (see the module docstring for the layout)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    in_features: int

    @property
    def bits(self) -> int:
        return 4 if self.qweight.dtype == torch.uint8 else 8

    @property
    def padded_in(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def group_size(self) -> int:
        return self.padded_in // self.scales.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Suffix -> tensor, as stored in a checkpoint under `<layer>.<suffix>`."""
        out = {"qweight": self.qweight, "scales": self.scales}
        if self.offsets is not None:
            out["offsets"] = self.offsets
        return out

    def dequantize(self) -> torch.Tensor:
        """-> (out, in_features) fp32."""
        out, G = self.scales.shape
        if self.bits == 4:
            q = unpack_int4(self.qweight).float()
            if self.offsets is None:
                q = q - 8
        else:
            q = self.qweight.float()
        w = q.view(out, G, -1) * self.scales.float()[..., None]  # (out, G, group_size)
        if self.offsets is not None:
            w = w + self.offsets.float()[..., None]
        return w.view(out, -1)[:, :self.in_features]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) uint8 codes in [0, 15], in even -> (out, in // 2) uint8."""
    assert q.dtype == torch.uint8 and q.shape[-1] % 2 == 0
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(out, n) uint8 -> (out, 2n) uint8 codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(*packed.shape[:-1], -1)


def pad_columns(w: torch.Tensor, padded_in: int) -> torch.Tensor:
    """Repeat the last column up to `padded_in` columns: the padding then never widens a
    group's range, so it costs the real weights nothing."""
    extra = padded_in - w.shape[1]
    return w if extra == 0 else torch.cat([w, w[:, -1:].expand(-1, extra)], dim=1)


def quantize(w: torch.Tensor, scheme: WeightScheme, group_size: int | None = None
             ) -> QuantizedTensor:
    """Round-to-nearest. w: (out, in) float; group_size overrides the scheme's (the plan may
    have chosen a divisor of in); a group size that does not divide `in` pads the last group."""
    out, n_in = w.shape
    gs = group_size or scheme.group_size or n_in
    padded_in = -(-n_in // gs) * gs
    wg = pad_columns(w.float(), padded_in).view(out, -1, gs)  # (out, G, gs)
    if scheme.sym:
        qmax = 2 ** (scheme.bits - 1) - 1  # 127 or 7; int4 codes -8..7 are stored as 0..15
        scales = (wg.abs().amax(-1) / qmax).clamp_min(_FP16_TINY).half()
        q = torch.round(wg / scales.float()[..., None]).clamp(-qmax - 1, qmax)
        offsets = None
        if scheme.bits == 8:
            return QuantizedTensor(q.to(torch.int8).view(out, -1), scales, None, n_in)
        q = q + 8
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        offsets = lo.half()
        scales = ((hi - offsets.float()) / 15).clamp_min(_FP16_TINY).half()
        q = torch.round((wg - offsets.float()[..., None]) / scales.float()[..., None]).clamp(0, 15)
    return QuantizedTensor(pack_int4(q.to(torch.uint8).view(out, -1)), scales, offsets, n_in)


def cat_quantized(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack matrices with the same input and format along the output dim (exact)."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.in_features, p.offsets is None) != (
                first.bits, first.group_size, first.in_features, first.offsets is None):
            raise ValueError("fused matrices must share bits, group size and symmetry")
    offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts])
    return QuantizedTensor(torch.cat([p.qweight for p in parts]),
                           torch.cat([p.scales for p in parts]), offsets, first.in_features)
