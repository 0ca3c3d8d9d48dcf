"""QuantLinear: the runtime module of a packed weight.

It replaces nn.Linear in the model and holds only the packed tensors. On CPU the fused
dequant-matmul of kernels/cpu_ops.c reads them in place; elsewhere (and as the reference) the
(out, in) matrix is dequantized as a temporary of one forward call, never kept.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from qserve.kernels import cpu_ops
from qserve.kernels.dispatch import packed_linear
from qserve.quant.schemes import QuantizedTensor

SUFFIXES = ("qweight", "scales", "offsets")


class QuantLinear(nn.Module):
    def __init__(self, qt: QuantizedTensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = qt.in_features, qt.qweight.shape[0]
        self.bits, self.group_size = qt.bits, qt.group_size
        self.register_buffer("qweight", qt.qweight)  # (out, in_p) int8 | (out, in_p / 2) uint8
        self.register_buffer("scales", qt.scales)  # (out, G) fp16
        self.register_buffer("offsets", qt.offsets)  # (out, G) fp16, or None: symmetric
        self.register_buffer("bias", bias)  # (out,) or None

    @property
    def packed(self) -> QuantizedTensor:
        return QuantizedTensor(self.qweight, self.scales, self.offsets, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in) -> (..., out)."""
        return packed_linear(x, self.qweight, self.scales, self.offsets, self.in_features,
                             self.bias)

    def extra_repr(self) -> str:
        kind = "asym" if self.offsets is not None else "sym"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits} g{self.group_size} {kind}")


def packed_weight(weights: dict[str, torch.Tensor], prefix: str, in_features: int
                  ) -> QuantizedTensor | None:
    """The packed matrix stored under `prefix.qweight` / `.scales` / `.offsets`, or None when
    `prefix.weight` is a dense one. Shapes are checked against in_features (ModelLoadError)."""
    from qserve.errors import ModelLoadError

    if prefix + ".qweight" not in weights:
        return None
    if prefix + ".scales" not in weights:
        raise ModelLoadError(f"weight {prefix}.scales is missing from the checkpoint")
    qt = QuantizedTensor(weights[prefix + ".qweight"], weights[prefix + ".scales"],
                         weights.get(prefix + ".offsets"), in_features)
    out, G = qt.scales.shape
    ok = (qt.qweight.dtype in (torch.uint8, torch.int8) and qt.qweight.dim() == 2
          and qt.qweight.shape[0] == out and qt.padded_in % G == 0
          and qt.padded_in - qt.group_size < in_features <= qt.padded_in
          and (qt.offsets is None or qt.offsets.shape == qt.scales.shape))
    if not ok:
        raise ModelLoadError(
            f"weight {prefix}: packed shapes qweight {tuple(qt.qweight.shape)} "
            f"{qt.qweight.dtype}, scales {tuple(qt.scales.shape)} do not fit {in_features} inputs")
    return qt


class QuantEmbedding(nn.Module):
    """A packed token embedding (vocab, hidden): a lookup dequantizes only the rows it reads.
    Tied to the output, `logits` dequantizes the table a slice of rows at a time, so the
    full-precision table never exists whole."""

    ROWS_PER_SLICE = 8192

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = qt.qweight.shape[0], qt.in_features, dtype
        self.register_buffer("qweight", qt.qweight)  # (vocab, hidden_p[/ 2])
        self.register_buffer("scales", qt.scales)  # (vocab, G) fp16
        self.register_buffer("offsets", qt.offsets)  # (vocab, G) fp16, or None

    def _rows(self, idx) -> torch.Tensor:
        off = None if self.offsets is None else self.offsets[idx]
        return QuantizedTensor(self.qweight[idx], self.scales[idx], off,
                               self.embedding_dim).dequantize().to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> (T, hidden)."""
        return self._rows(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden) -> (S, vocab) fp32: hidden @ table^T."""
        if hidden.device.type == "cpu" and cpu_ops.lib() is not None:
            return packed_linear(hidden.float(), self.qweight, self.scales, self.offsets,
                                 self.embedding_dim, None)
        V, n = self.num_embeddings, self.ROWS_PER_SLICE
        return torch.cat([F.linear(hidden, self._rows(slice(i, min(i + n, V)))).float()
                          for i in range(0, V, n)], dim=-1)
