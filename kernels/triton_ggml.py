"""Fused dequant-GEMM in Triton for the GGML formats read in place (Q5_0, Q5_1, Q2_K ... Q6_K,
IQ4_NL, IQ4_XS, MXFP4):
y = x @ W^T (+ bias) with W's GGUF blocks read as the file has them and dequantized in
registers. The reference is `F.linear(x, qt.dequantize().to(x.dtype), bias)`
(qserve/formats/ggml.py has the layouts and the pure-torch dequantization).

Every format runs fused; there is no host-side unpacking. The grid is (M tiles, N tiles, K
splits), as in triton_dequant_gemm.py:

    BLOCK_M = 16 for every M and GGML blocks split over SPLIT_K programs chosen from N and K
    only, the fp32 partials summed in split order: triton_dequant_gemm's plan (split_plan,
    run_split), so a row's result does not depend on its batch.

A program walks its GGML blocks 32 inputs ("a chunk") at a time: for each row of its N tile
it gathers the bytes holding the chunk's codes and scales, forms each weight in fp32 in
gguf-py's order ((d * sc) * q - dmin * mn, ...), rounds it to x's dtype (so a weight is the
very value F.linear sees; bf16 under the interpreter stays fp32, see dot_dtype) and adds
x_chunk (BM, 32) . W_chunk (32, BN) to an fp32 accumulator.
32 inputs is one sub-block of Q4_K/Q5_K/IQ4_XS, one block of Q5_0/Q5_1/IQ4_NL/MXFP4 and two of
Q2_K/Q3_K/Q6_K (their scales are gathered per input); the chunk index is a compile-time
constant, so its byte offsets and shifts fold. The launch turns off fp fusion, so no
multiply-add contracts into an fma and the fp32 weights are gguf-py's bit for bit on the GPU too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.formats import QuantizedTensor, ggml
from qserve.kernels.triton_dequant_gemm import (_TL_DTYPE, BLOCK_M, dot_dtype, run_split,
                                                split_plan)


# ---- reading a chunk of blocks: blk (BN,) pointers to each row's block, j = arange(32) ------
@triton.jit
def _bytes(blk, offs, mask_n):
    """Bytes at offsets offs (L,) of each row's block -> (L, BN) int32."""
    return tl.load(blk[None, :] + offs[:, None], mask=mask_n[None, :], other=0).to(tl.int32)


@triton.jit
def _byte(blk, off: tl.constexpr, mask_n):
    """One byte of each row's block -> (BN,) int32."""
    return tl.load(blk + off, mask=mask_n, other=0).to(tl.int32)


@triton.jit
def _f16(blk, off: tl.constexpr, mask_n):
    """The little-endian fp16 at byte off of each row's block -> (BN,) fp32."""
    lo = tl.load(blk + off, mask=mask_n, other=0).to(tl.uint16)
    hi = tl.load(blk + off + 1, mask=mask_n, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q5_0(blk, j, c: tl.constexpr, mask_n):
    # 0 d | 2 qh (uint32) | 6 qs[16]: input j's low nibble j // 16 of qs[j % 16], fifth bit
    # bit j of qh.  w = d * (q - 16)
    qh = (_bytes(blk, 2 + j // 8, mask_n) >> (j % 8)[:, None]) & 1
    ql = (_bytes(blk, 6 + j % 16, mask_n) >> (4 * (j // 16))[:, None]) & 15
    q = (ql | (qh << 4)) - 16
    return _f16(blk, 0, mask_n)[None, :] * q.to(tl.float32)


@triton.jit
def _q5_1(blk, j, c: tl.constexpr, mask_n):
    # 0 d | 2 m | 4 qh (uint32) | 8 qs[16]: q as Q5_0.  w = d * q + m
    qh = (_bytes(blk, 4 + j // 8, mask_n) >> (j % 8)[:, None]) & 1
    ql = (_bytes(blk, 8 + j % 16, mask_n) >> (4 * (j // 16))[:, None]) & 15
    q = ql | (qh << 4)
    return _f16(blk, 0, mask_n)[None, :] * q.to(tl.float32) + _f16(blk, 2, mask_n)[None, :]


@triton.jit
def _q2_k(blk, j, c: tl.constexpr, mask_n):
    # 0 scales[16] | 16 qs[64] | 80 d | 82 dmin. Chunk c: codes 2-bit field c % 4 of
    # qs[32 (c // 4) + j]; sub-block 2c + j // 16, scales[s] = sc | mn << 4.
    # w = (d * sc) * q - (dmin * mn)
    q = (_bytes(blk, 16 + (c // 4) * 32 + j, mask_n) >> (2 * (c % 4))) & 3
    s = _bytes(blk, 2 * c + j // 16, mask_n)
    dl = _f16(blk, 80, mask_n)[None, :] * (s & 15).to(tl.float32)
    ml = _f16(blk, 82, mask_n)[None, :] * (s >> 4).to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q3_k(blk, j, c: tl.constexpr, mask_n):
    # 0 hmask[32] | 32 qs[64] | 96 scales[12] | 108 d. Chunk c: low 2 bits field c % 4 of
    # qs[32 (c // 4) + j], hbit bit c of hmask[j] (set: no -4). Sub-block s = 2c + j // 16 has
    # a 6-bit scale: low nibble s // 8 (= c // 4) of scales[s % 8], high 2 bits field
    # s // 4 (= c // 2) of scales[8 + s % 4].  w = (d * (sc - 32)) * (q2 - 4 (1 - hbit))
    q2 = (_bytes(blk, 32 + (c // 4) * 32 + j, mask_n) >> (2 * (c % 4))) & 3
    hbit = (_bytes(blk, j, mask_n) >> c) & 1
    lo = (_bytes(blk, 96 + 2 * (c % 4) + j // 16, mask_n) >> (4 * (c // 4))) & 15
    hi = (_bytes(blk, 104 + 2 * (c % 2) + j // 16, mask_n) >> (2 * (c // 2))) & 3
    dl = _f16(blk, 108, mask_n)[None, :] * ((lo | (hi << 4)) - 32).to(tl.float32)
    return dl * (q2 - 4 * (1 - hbit)).to(tl.float32)


@triton.jit
def _k_scale_min(blk, c: tl.constexpr, mask_n):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block c from scales[12] at byte 4
    (ggml.py's _k_scale_min has the packing) -> two (BN,) fp32."""
    if c < 4:
        sc = _byte(blk, 4 + c, mask_n) & 63
        mn = _byte(blk, 8 + c, mask_n) & 63
    else:
        lo = _byte(blk, 8 + c, mask_n)  # scales[8 + (c - 4)]
        sc = (lo & 15) | ((_byte(blk, c, mask_n) >> 6) << 4)
        mn = (lo >> 4) | ((_byte(blk, 4 + c, mask_n) >> 6) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q4_k(blk, j, c: tl.constexpr, mask_n):
    # 0 d | 2 dmin | 4 scales[12] | 16 qs[128]. Chunk c = sub-block c: nibble c % 2 of
    # qs[32 (c // 2) + j].  w = (d * sc) * q - (dmin * mn)
    sc, mn = _k_scale_min(blk, c, mask_n)
    q = (_bytes(blk, 16 + (c // 2) * 32 + j, mask_n) >> (4 * (c % 2))) & 15
    dl = _f16(blk, 0, mask_n) * sc
    ml = _f16(blk, 2, mask_n) * mn
    return dl[None, :] * q.to(tl.float32) - ml[None, :]


@triton.jit
def _q5_k(blk, j, c: tl.constexpr, mask_n):
    # 0 d | 2 dmin | 4 scales[12] | 16 qh[32] | 48 qs[128]. Chunk c = sub-block c: low bits
    # nibble c % 2 of qs[32 (c // 2) + j], fifth bit bit c of qh[j].
    # w = (d * sc) * q - (dmin * mn)
    sc, mn = _k_scale_min(blk, c, mask_n)
    ql = (_bytes(blk, 48 + (c // 2) * 32 + j, mask_n) >> (4 * (c % 2))) & 15
    qh = (_bytes(blk, 16 + j, mask_n) >> c) & 1
    dl = _f16(blk, 0, mask_n) * sc
    ml = _f16(blk, 2, mask_n) * mn
    return dl[None, :] * (ql | (qh << 4)).to(tl.float32) - ml[None, :]


@triton.jit
def _q6_k(blk, j, c: tl.constexpr, mask_n):
    # 0 ql[128] | 128 qh[64] | 192 scales[16] int8 | 208 d. Chunk c: low nibble (c // 2) % 2
    # of ql[64 (c // 4) + 32 (c % 2) + j], high 2 bits field c % 4 of qh[32 (c // 4) + j];
    # sub-block 2c + j // 16.  w = (d * sc) * (q - 32)
    ql = (_bytes(blk, (c // 4) * 64 + (c % 2) * 32 + j, mask_n) >> (4 * ((c // 2) % 2))) & 15
    qh = (_bytes(blk, 128 + (c // 4) * 32 + j, mask_n) >> (2 * (c % 4))) & 3
    s = tl.load(blk[None, :] + (192 + 2 * c + j // 16)[:, None], mask=mask_n[None, :], other=0)
    dl = _f16(blk, 208, mask_n)[None, :] * s.to(tl.int8, bitcast=True).to(tl.float32)
    return dl * ((ql | (qh << 4)) - 32).to(tl.float32)


# The IQ4 table (ggml.IQ4_VALUES) as bytes in two int64 words: values 0-7, then 8-15
_IQ4_LO: tl.constexpr = tl.constexpr(-0x091522304052677F)  # 0xF6EADDCFBFAD9881 as int64
_IQ4_HI: tl.constexpr = tl.constexpr(0x7159453526190D01)


@triton.jit
def _iq4_value(q):
    """4-bit indices (int32) -> their IQ4 table values, fp32 (exact)."""
    word = tl.where(q < 8, _IQ4_LO, _IQ4_HI).to(tl.int64)
    byte = (word >> (8 * (q & 7)).to(tl.int64)) & 0xFF
    return ((byte ^ 0x80) - 0x80).to(tl.float32)  # the byte as int8


@triton.jit
def _iq4_nl(blk, j, mask_n):
    # 0 d | 2 qs[16]: input j nibble j // 16 of qs[j % 16].  w = d * v[q]
    q = (_bytes(blk, 2 + j % 16, mask_n) >> (4 * (j // 16))[:, None]) & 15
    return _f16(blk, 0, mask_n)[None, :] * _iq4_value(q)


@triton.jit
def _iq4_xs(blk, j, c: tl.constexpr, mask_n):
    # 0 d | 2 scales_h (uint16) | 4 scales_l[4] | 8 qs[128]; sub-block c: ls = nibble c % 2 of
    # scales_l[c // 2] | bits 2c, 2c + 1 of scales_h << 4, its inputs as an IQ4_NL block's at
    # qs[16c].  w = (d * (ls - 32)) * v[q]
    lo = (_byte(blk, 4 + c // 2, mask_n) >> (4 * (c % 2))) & 15
    hi = (_byte(blk, 2 + c // 4, mask_n) >> (2 * (c % 4))) & 3
    dl = _f16(blk, 0, mask_n) * ((lo | (hi << 4)) - 32).to(tl.float32)
    q = (_bytes(blk, 8 + 16 * c + j % 16, mask_n) >> (4 * (j // 16))[:, None]) & 15
    return dl[None, :] * _iq4_value(q)


# MXFP4's table (ggml.MXFP4_VALUES) is sign and magnitude: bit 3 of a code the sign, bits 0-2
# pick a magnitude 0, 1, 2, 3 (a byte of _MXFP4_LO) or 4, 6, 8, 12 (_MXFP4_HI)
_MXFP4_LO: tl.constexpr = tl.constexpr(0x03020100)
_MXFP4_HI: tl.constexpr = tl.constexpr(0x0C080604)


@triton.jit
def _mxfp4(blk, j, mask_n):
    # 0 e (E8M0) | 1 qs[16]: input j nibble j // 16 of qs[j % 16].  w = 2^(e - 128) * v[q],
    # the scale's bits as ggml.py's _e8m0_half builds them (e < 2: the subnormals 2^-128,
    # 2^-127, bits 0x00200000 (e + 1))
    e = _byte(blk, 0, mask_n)
    scale = tl.where(e < 2, (e + 1) * 0x00200000, (e - 1) << 23).to(tl.float32, bitcast=True)
    q = (_bytes(blk, 1 + j % 16, mask_n) >> (4 * (j // 16))[:, None]) & 15
    m = q & 7
    mag = (tl.where(m < 4, _MXFP4_LO, _MXFP4_HI) >> (8 * (m & 3))) & 0xFF
    return scale[None, :] * tl.where(q < 8, mag, -mag).to(tl.float32)


@triton.jit
def _dequant_chunk(blk, j, c: tl.constexpr, mask_n, FORMAT: tl.constexpr):
    """Inputs 32c + j of each row's block -> W chunk (32, BN) fp32, bit for bit ggml.py's."""
    if FORMAT == "q5_0":
        w = _q5_0(blk, j, c, mask_n)
    elif FORMAT == "q5_1":
        w = _q5_1(blk, j, c, mask_n)
    elif FORMAT == "q2_k":
        w = _q2_k(blk, j, c, mask_n)
    elif FORMAT == "q3_k":
        w = _q3_k(blk, j, c, mask_n)
    elif FORMAT == "q4_k":
        w = _q4_k(blk, j, c, mask_n)
    elif FORMAT == "q5_k":
        w = _q5_k(blk, j, c, mask_n)
    elif FORMAT == "iq4_nl":
        w = _iq4_nl(blk, j, mask_n)
    elif FORMAT == "iq4_xs":
        w = _iq4_xs(blk, j, c, mask_n)
    elif FORMAT == "mxfp4":
        w = _mxfp4(blk, j, mask_n)
    else:
        tl.static_assert(FORMAT == "q6_k")
        w = _q6_k(blk, j, c, mask_n)
    return w


@triton.jit
def _ggml_matmul_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, out_ptr,
    # sizes
    M, N, n_blocks, blocks_per_split,
    # strides
    stride_xm, stride_xk,
    stride_wn,  # bytes between rows of W
    stride_os, stride_om, stride_on,  # out: (SPLIT_K, M, N)
    # meta-parameters
    FORMAT: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    j = tl.arange(0, 32)
    row_ptrs = w_ptr + offs_n.to(tl.int64) * stride_wn  # (BN,) a vocab-sized W passes 2^31 B
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    b_lo = pid_k * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, n_blocks)
    for b in range(b_lo, b_hi):
        blk = row_ptrs + b * BLOCK_BYTES
        for c in tl.static_range(QK // 32):
            w = _dequant_chunk(blk, j, c, mask_n, FORMAT)  # (32, BN) fp32
            offs_k = b * QK + c * 32 + j
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)  # (BM, 32)
            # w rounded to x's dtype is the weight F.linear(x, W.to(x.dtype)) multiplies
            acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)

    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om \
        + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def ggml_matmul(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None,
                split_k: int | None = None) -> torch.Tensor:
    """x (M, K) fp16/bf16/fp32, qt an (N, K) GGML in-place weight (q5_0 ... q6_k, iq4_nl,
    iq4_xs, mxfp4) with its rows (N, K / block * block_bytes) uint8 -> (M, N) in x's dtype.

    split_k: programs along K, in whole GGML blocks (None picks one from N and K: enough to
    fill the GPU).
    """
    assert x.dim() == 2 and x.dtype in _TL_DTYPE, (x.shape, x.dtype)
    assert qt.format in ggml.IN_PLACE, f"{qt.format} is not a GGML format read in place"
    problem = qt.validate()
    assert problem is None, problem
    M, K = x.shape
    N = qt.qweight.shape[0]
    assert K == qt.in_features, f"x has {K} columns, the weight {qt.in_features}"
    assert qt.qweight.stride(1) == 1, "a row's blocks must be contiguous bytes"
    assert x.device == qt.qweight.device
    assert bias is None or bias.shape == (N,), bias.shape
    t = ggml.TYPES[qt.format]
    n_blocks = K // t.block
    if M == 0:
        return x.new_empty(0, N)

    BLOCK_N = 64
    split_k, per_split = split_plan(x.device, N, n_blocks, BLOCK_N, split_k)

    def launch(xs: torch.Tensor, out: torch.Tensor) -> None:
        # out: (split_k, rows, N) partials, or (1, rows, N) y itself
        grid = (triton.cdiv(xs.shape[0], BLOCK_M), triton.cdiv(N, BLOCK_N), out.shape[0])
        _ggml_matmul_kernel[grid](
            xs, qt.qweight, bias if bias is not None else xs, out,
            xs.shape[0], N, n_blocks, per_split,
            xs.stride(0), xs.stride(1),
            qt.qweight.stride(0),
            out.stride(0), out.stride(1), out.stride(2),
            FORMAT=qt.format, QK=t.block, BLOCK_BYTES=t.block_bytes,
            HAS_BIAS=bias is not None, DOT_DTYPE=dot_dtype(x.dtype),
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32: no tf32 rounding
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            enable_fp_fusion=False,  # no fma in (d * sc) * q - dmin * mn: gguf-py's weights
        )

    return run_split(x, N, split_k, launch)
