"""Which kernel runs: the model calls these, and they pick by device, with no flag needed.

    CPU   kernels/cpu_ops.py (compiled C) for packed linears and decode attention, where it
          built; the pure-torch reference otherwise, and for prefill attention.
    CUDA  the Triton kernels (kernels/triton_*.py) where triton imports; the reference
          otherwise.

QSERVE_KERNELS=reference forces the reference everywhere (tests compare the two paths).
"""
from __future__ import annotations

import functools
import os

import torch
from torch.nn import functional as F

from qserve.formats import QuantizedTensor
from qserve.kernels import cpu_ops
from qserve.kernels.paged_attention import PagedAttentionMetadata, paged_attention, write_kv


def _cpu_fast(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and cpu_ops.lib() is not None


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    if os.environ.get("QSERVE_KERNELS", "auto") == "reference":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and _triton_available()


def packed_linear(x: torch.Tensor, segments: list[QuantizedTensor],
                  bias: torch.Tensor | None, cpu_ready: bool | None = None) -> torch.Tensor:
    """x (..., in) @ W^T (+ bias) for W stored as row segments (each (out_i, in), any weight
    format), stacked along out: (..., sum out_i) in x's dtype. `cpu_ready`: whether
    cpu_ops.supports every segment, when the caller knows (None: checked here)."""
    K = segments[0].in_features
    x2 = x.reshape(-1, K)
    if _cpu_fast(x) and (cpu_ready if cpu_ready is not None
                         else all(cpu_ops.supports(s) for s in segments)):
        xf = x2.float().contiguous()
        y = torch.empty(xf.shape[0], sum(s.shape[0] for s in segments), dtype=torch.float32)
        i8, n0 = cpu_ops.int8_activations(), 0
        for seg in segments:  # each writes its own columns of y
            n1 = n0 + seg.shape[0]
            b = None if bias is None else bias[n0:n1].float().contiguous()
            cpu_ops.weight_matmul(xf, seg, b, i8, out=y[:, n0:n1])
            n0 = n1
        return y.to(x.dtype).view(*x.shape[:-1], -1)
    if _triton(x):
        parts = [_triton_matmul(x2, seg) for seg in segments]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.view(*x.shape[:-1], -1)
    w = torch.cat([seg.dequantize() for seg in segments]) if len(segments) > 1 else (
        segments[0].dequantize())
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _triton_matmul(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """x (M, K) @ W^T for one segment on CUDA: the Triton kernel of its format."""
    if qt.format in ("int4", "int4z", "int8"):
        from qserve.kernels.triton_dequant_gemm import dequant_matmul

        return dequant_matmul(x, qt, None)
    if qt.fmt.ggml_type is not None:
        from qserve.kernels.triton_ggml import ggml_matmul

        return ggml_matmul(x, qt, None)
    return F.linear(x, qt.qweight.to(x.dtype))  # f16 / bf16 / f32: dense already


def output_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden (S, hidden) @ weight (vocab, hidden)^T -> (S, vocab) fp32: the output projection,
    the largest matmul of a decode step.

    For fp32 on the CPU, up to FUSED_MAX_ROWS rows run on the C row kernel, which reads the
    table once at DRAM speed. The BLAS in this torch build reads it at about half that, and
    F.linear's layout is 2-3x slower still for 4-64 rows; so more rows go to the BLAS with the
    table as the left operand.
    """
    if hidden.dtype == weight.dtype == torch.float32 and _cpu_fast(hidden):
        x = hidden.contiguous()
        if x.shape[0] <= cpu_ops.FUSED_MAX_ROWS:
            return cpu_ops.f32_matmul(x, weight)
        return torch.mm(weight, x.t()).t().contiguous()
    return F.linear(hidden, weight).float()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: dict[str, torch.Tensor],
              meta: PagedAttentionMetadata, scale: float, softcap: float | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend.

    q (T, H, d), k and v (T, Hkv, d), packed as PagedAttentionMetadata describes. `softcap`
    and `sinks` (H,): as paged_attention takes them. Returns (T, H, d) in q's dtype.

    No fast kernel caps scores (Gemma 2): the reference does. Sinks (gpt-oss) run in the CPU
    decode kernel and the reference, not yet in the Triton kernels.
    """
    if meta.decode_only and softcap is None and _cpu_fast(q) and cpu_ops.supports_cache(cache):
        cpu_ops.write_kv(k, v, cache, meta.slot_mapping)
        out = cpu_ops.paged_decode(q, cache, meta.block_tables, meta.seq_lens, scale,
                                   meta.sliding_window, sinks)
        return out.to(q.dtype)
    if softcap is None and sinks is None and _triton(q):
        from qserve.kernels import triton_kv_write, triton_paged_attention, triton_prefill_attention

        triton_kv_write.write_kv(k, v, cache, meta.slot_mapping)
        if meta.decode_only:
            return triton_paged_attention.decode_attention(q, cache, meta, scale)
        return triton_prefill_attention.prefill_attention(q, cache, meta, scale)
    k, v = write_kv(k, v, cache, meta.slot_mapping)  # as the cache holds them
    return paged_attention(q, cache, meta, scale, k_new=k, v_new=v, softcap=softcap,
                           sinks=sinks)
