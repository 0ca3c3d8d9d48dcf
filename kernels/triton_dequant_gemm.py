"""Fused dequant-GEMM in Triton: y = x @ W^T (+ bias) with W read packed (int4 or int8) and
dequantized in registers. The reference is `F.linear(x, qt.dequantize().to(x.dtype), bias)`
(qserve/quant/schemes.py has the layout).

One kernel serves both shapes:

    decode   M <= 32: BLOCK_M = 16 or 32, and K split over SPLIT_K programs so that
             N / BLOCK_N * SPLIT_K fills the GPU; every packed weight byte is read once, the
             fp32 partials (SPLIT_K, M, N) are summed by torch (a few KB).
    prefill  larger M: BLOCK_M = 64, no split; W is re-read once per 64 rows.

Scales are applied per K tile, not per weight: when a tile lies inside one group,

    sum_k x_k (q_k s + m) = s * (x . q) + m * sum_k x_k

so the inner loop dots x with the raw codes (small integers, exact in fp16/bf16) and the
scale costs BLOCK_N multiplies per tile. An int4 tile is two dots, x's even columns with
the low nibbles and its odd columns with the high ones, so packed bytes load as contiguous
runs and are never interleaved. A group the tile cannot lie in (only the "divisor" plan
makes one, e.g. g24) falls back to dequantizing each weight before the dot.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qserve.formats import QuantizedTensor

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtype(dtype: torch.dtype):
    """The tl dtype tiles of `dtype` are multiplied in. Triton 3.9's interpreter computes
    garbage for a bf16 tl.dot, so under it bf16 tiles are multiplied in fp32 instead."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return _TL_DTYPE[dtype]


@triton.jit
def _scaled_dot(acc, x, q, cols, g, offs_n, mask_n, K, s_ptr, o_ptr, stride_sn, stride_sg, GROUP,
                SYM: tl.constexpr, SCALE_PER_TILE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                PRECISION: tl.constexpr):
    """acc (BM, BN) + x (BM, BK') . W where W (BK', BN) = codes q of input columns `cols`
    times their scales (plus offsets). Columns past K meet x = 0 (group padding vanishes)."""
    if SCALE_PER_TILE:  # the tile lies in group g: scale after the dot
        s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=mask_n, other=0.0)
        xq = tl.dot(x.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=PRECISION)  # (BM, BN)
        acc += xq * s.to(tl.float32)[None, :]
        if not SYM:
            m = tl.load(o_ptr + offs_n * stride_sn + g * stride_sg, mask=mask_n, other=0.0)
            acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * m.to(tl.float32)[None, :]
    else:  # each column's own group
        g2 = (cols // GROUP)[:, None] * stride_sg + offs_n[None, :] * stride_sn
        mask = (cols < K)[:, None] & mask_n[None, :]
        w = q * tl.load(s_ptr + g2, mask=mask, other=0.0).to(tl.float32)
        if not SYM:
            w += tl.load(o_ptr + g2, mask=mask, other=0.0).to(tl.float32)
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)
    return acc


@triton.jit
def _dequant_matmul_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr,
    # sizes
    M, N, K, GROUP, k_tiles_per_split,
    # strides
    stride_xm, stride_xk,
    stride_wn, stride_wk,  # over qweight's own columns (bytes for int4)
    stride_sn, stride_sg,  # scales and offsets share theirs
    stride_os, stride_om, stride_on,  # out: (SPLIT_K, M, N)
    # meta-parameters
    BITS: tl.constexpr, SYM: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    k_lo = pid_k * k_tiles_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + k_tiles_per_split * BLOCK_K, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if BITS == 4:
            # Byte j holds input 2j in its low nibble and 2j + 1 in its high one. Rather than
            # interleave nibbles, split x: x . w = x[:, 0::2] . lo + x[:, 1::2] . hi, so the
            # bytes load as one contiguous (vectorisable) run per row of W.
            offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            w_ptrs = w_ptr + offs_j[:, None] * stride_wk + offs_n[None, :] * stride_wn
            packed = tl.load(w_ptrs, mask=(2 * offs_j < K)[:, None] & mask_n[None, :], other=0)
            lo = (packed & 0xF).to(tl.float32)  # (BK / 2, BN)
            hi = (packed >> 4).to(tl.float32)
            if SYM:
                lo -= 8.0
                hi -= 8.0
            for half in tl.static_range(2):
                cols = 2 * offs_j + half  # (BK / 2,) input columns of this nibble
                x_ptrs = x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk
                x = tl.load(x_ptrs, mask=mask_m[:, None] & (cols < K)[None, :], other=0.0)
                acc = _scaled_dot(acc, x, lo if half == 0 else hi, cols, k0 // GROUP, offs_n,
                                  mask_n, K, s_ptr, o_ptr, stride_sn, stride_sg, GROUP,
                                  SYM, SCALE_PER_TILE, DOT_DTYPE, PRECISION)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
            x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
            w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
            q = tl.load(w_ptrs, mask=(offs_k < K)[:, None] & mask_n[None, :], other=0)
            acc = _scaled_dot(acc, x, q.to(tl.float32), offs_k, k0 // GROUP, offs_n, mask_n, K,
                              s_ptr, o_ptr, stride_sn, stride_sg, GROUP,
                              SYM, SCALE_PER_TILE, DOT_DTYPE, PRECISION)

    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om \
        + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so the split path is exercised on CPU too


def split_plan(x: torch.Tensor, M: int, N: int, k_units: int, BLOCK_M: int, BLOCK_N: int,
               split_k: int | None) -> tuple[int, int, torch.Tensor]:
    """How many programs share K (decode: enough to fill the GPU; prefill: one), K units
    each, and the output they write: (split_k, M, N) fp32 partials, or (1, M, N) in x's dtype
    when unsplit. Returns (split_k, units per split, out)."""
    grid_mn = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    if split_k is None:
        split_k = 1 if M > 32 else max(1, min(k_units, 2 * _num_sms(x.device) // grid_mn))
    per_split = triton.cdiv(k_units, split_k)
    split_k = triton.cdiv(k_units, per_split)  # no empty splits
    dtype = x.dtype if split_k == 1 else torch.float32
    return split_k, per_split, torch.empty(split_k, M, N, device=x.device, dtype=dtype)


def dequant_matmul(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None,
                   split_k: int | None = None) -> torch.Tensor:
    """x (M, K) fp16/bf16/fp32, qt packing an (N, K) weight -> (M, N) in x's dtype.

    split_k: programs along K (None picks one: decode shapes split to fill the GPU).
    """
    assert x.dim() == 2 and x.dtype in _TL_DTYPE, (x.shape, x.dtype)
    M, K = x.shape
    N = qt.qweight.shape[0]
    assert K == qt.in_features, f"x has {K} columns, the weight {qt.in_features}"
    assert qt.qweight.dtype in (torch.uint8, torch.int8), qt.qweight.dtype
    assert qt.scales.shape == (N, qt.padded_in // qt.group_size), qt.scales.shape
    assert qt.offsets is None or (qt.bits == 4 and qt.offsets.stride() == qt.scales.stride())
    assert x.device == qt.qweight.device == qt.scales.device
    assert bias is None or bias.shape == (N,), bias.shape
    G = qt.scales.shape[1]
    group = qt.group_size
    if M == 0:
        return x.new_empty(0, N)

    if M <= 32:
        BLOCK_M, BLOCK_N = (16 if M <= 16 else 32), 64
    else:
        BLOCK_M, BLOCK_N = 64, 64
    if G == 1:  # one scale per row: any tile lies in the one group
        BLOCK_K, scale_per_tile = min(128, max(32, triton.next_power_of_2(K))), True
    else:  # a tile inside one group: the largest power of two dividing it, up to 128
        BLOCK_K = min(128, group & -group)
        # tl.dot needs K >= 16, and an int4 tile is two dots over its halves; else scale each
        # weight (any even group: both nibbles of a byte share it)
        scale_per_tile = BLOCK_K >= 16 * (8 // qt.bits)
        BLOCK_K = BLOCK_K if scale_per_tile else 32
    k_tiles = triton.cdiv(K, BLOCK_K)
    split_k, per_split, out = split_plan(x, M, N, k_tiles, BLOCK_M, BLOCK_N, split_k)
    s = qt.scales
    o = qt.offsets if qt.offsets is not None else s  # unread when symmetric
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), split_k)
    _dequant_matmul_kernel[grid](
        x, qt.qweight, s, o, bias if bias is not None else s, out,
        M, N, K, group if G > 1 else qt.padded_in, per_split,
        x.stride(0), x.stride(1),
        qt.qweight.stride(0), qt.qweight.stride(1),
        s.stride(0), s.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BITS=qt.bits, SYM=qt.bits == 8 or qt.offsets is None, HAS_BIAS=bias is not None,
        SCALE_PER_TILE=scale_per_tile, DOT_DTYPE=dot_dtype(x.dtype),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 x: no tf32 rounding
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out[0] if split_k == 1 else out.sum(0).to(x.dtype)
