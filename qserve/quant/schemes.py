"""Round-to-nearest quantization into qserve's int4 / int8 formats (the layouts are in
qserve/formats/qtensor.py).

Groups run along the input dimension, so every output row has its own scales and rows of
different matrices stack (fused q/k/v, gate/up) without changing any value. A group size that
does not divide the inputs pads the last group by repeating the last column.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qserve.formats import QuantizedTensor, pack_int4
from qserve.formats.qtensor import cat_quantized  # noqa: F401  (re-exported)

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
            return QuantizedTensor("int8", q.to(torch.int8).view(out, -1), scales, None, n_in)
        q = q + 8
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        offsets = lo.half()
        scales = ((hi - offsets.float()) / 15).clamp_min(_FP16_TINY).half()
        q = torch.round((wg - offsets.float()[..., None]) / scales.float()[..., None]).clamp(0, 15)
    return QuantizedTensor("int4", pack_int4(q.to(torch.uint8).view(out, -1)), scales, offsets,
                           n_in)
