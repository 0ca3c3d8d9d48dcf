"""KV-cache write in Triton: quantize this step's K and V per (token, kv head) and scatter
values, scales and offsets into their slots. The reference is `write_kv` in
kernels/paged_attention.py, with the formats of kernels/kv_quant.py; the codes and scales
written are bit for bit the reference's (same roundings, in the same order):

    int8:  s = fp16(max|y| / 127)           q = rint(y / s)         in [-127, 127]
    int4:  m = fp16(min y)  s = fp16((max y - m) / L)    q = rint((y - m) / s)  in [0, L]
           L = 2^bits - 1, bits 5 for keys and 3 for values, codes packed as kv_quant.pack

y = H x is the Hadamard rotation, done in the kernel with the reference's own butterflies
(`hadamard_rows`: the same adds in the same order), so y too is the reference's to the bit;
the values returned are dequantized and rotated back the same way. Divisions are `div_rn`
(IEEE round-to-nearest, as torch divides; a plain `/` in Triton may be approximate on GPUs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.kv_quant import PACKED_BITS, SCALE_DTYPE, packed_bytes
from qserve.kernels.triton_paged_attention import (hadamard_args, hadamard_rows, kv_args,
                                                   kv_quant_code)

_TINY = tl.constexpr(2.0 ** -14)  # kv_quant._TINY
_RINT = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + it) - it rounds |v| < 2^22 half to even


@triton.jit
def _store_plane(base, code, D, stride_d, BELOW: tl.constexpr, W: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Write bits BELOW .. BELOW + W of codes (BLOCK_D,) int32 as their plane of kv_quant.pack:
    8 / W elements a byte, element e at bit e * W % 8, after the lower planes' bytes."""
    field = tl.reshape((code >> BELOW) & ((1 << W) - 1), (BLOCK_D * W // 8, 8 // W))
    byte = tl.sum(field << (tl.arange(0, 8 // W) * W)[None, :], axis=1)
    offs = tl.arange(0, BLOCK_D * W // 8)
    tl.store(base + ((D * BELOW) // 8 + offs) * stride_d, byte.to(tl.uint8),
             mask=offs < D * W // 8)


@triton.jit
def _clip_candidate(y, mask, lo, hi, div: tl.constexpr, levels: tl.constexpr):
    """One range cut of kv_quant.quantize_packed: (codes, scale, offset, fp64 squared error)
    for the range [lo, hi] less 1/div of it at each end (div 0: no cut)."""
    if div > 0:
        m = (lo + tl.math.div_rn(hi - lo, div)).to(tl.float16).to(tl.float32)
        top = hi - tl.math.div_rn(hi - lo, div)
    else:
        m = lo.to(tl.float16).to(tl.float32)
        top = hi
    s = tl.maximum(tl.math.div_rn(top - m, levels), _TINY).to(tl.float16).to(tl.float32)
    q = (tl.math.div_rn(y - m, s) + _RINT) - _RINT
    q = tl.where(mask, tl.minimum(tl.maximum(q, 0.0), levels), 0.0)
    r = q.to(tl.float64) * s.to(tl.float64) + m.to(tl.float64) - y.to(tl.float64)
    return q, s, m, tl.sum(tl.where(mask, r * r, 0.0), axis=0)


@triton.jit
def _keep_better(q, s, m, err, y, mask, lo, hi, div: tl.constexpr, levels: tl.constexpr):
    """The cut of 1/div if its error is smaller than err's (the earlier cuts' best)."""
    q2, s2, m2, err2 = _clip_candidate(y, mask, lo, hi, div, levels)
    better = err2 < err
    return (tl.where(better, q2, q), tl.where(better, s2, s), tl.where(better, m2, m),
            tl.where(better, err2, err))


@triton.jit
def _kv_write_kernel(
    # pointers
    x_ptr, slot_ptr, v_ptr, s_ptr, o_ptr, deq_ptr,
    # sizes
    D, PAGE, had_scale,
    # strides
    stride_xt, stride_xh, stride_xd,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_sb, stride_ss, stride_sh,
    # meta-parameters
    QUANT: tl.constexpr, BITS: tl.constexpr, LEVELS: tl.constexpr, BLOCK_D: tl.constexpr,
    LOG2_N: tl.constexpr,
):
    """Program (t, h) writes token t's head h, and its dequantized values rotated back to
    deq (T, Hkv, D) fp32; QUANT as load_kv_tile's, BITS the width of int4 KV's codes and
    LEVELS = 2^BITS - 1 as a float (what div_rn takes)."""
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < D
    x = tl.load(x_ptr + pid_t * stride_xt + head * stride_xh + offs_d * stride_xd,
                mask=mask, other=0.0)
    slot = tl.load(slot_ptr + pid_t)
    row = (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs + head * stride_vh
    if QUANT == 0:
        tl.store(v_ptr + row + offs_d * stride_vd, x, mask=mask)  # already cache dtype
    else:
        srow = (slot // PAGE) * stride_sb + (slot % PAGE) * stride_ss + head * stride_sh
        y = hadamard_rows(tl.reshape(x.to(tl.float32), (1, BLOCK_D)), 1, BLOCK_D, LOG2_N)
        y = tl.reshape(y * had_scale, (BLOCK_D,))  # y = H x, the reference's bits
        if QUANT == 1:
            amax = tl.max(tl.abs(y), axis=0)
            s = tl.maximum(tl.math.div_rn(amax, 127.0), _TINY).to(tl.float16).to(tl.float32)
            q = (tl.math.div_rn(y, s) + _RINT) - _RINT
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            tl.store(v_ptr + row + offs_d * stride_vd, q.to(tl.int8), mask=mask)
            deq = q * s
        else:
            lo = tl.min(tl.where(mask, y, float("inf")), axis=0)
            hi = tl.max(tl.where(mask, y, float("-inf")), axis=0)
            # kv_quant.CLIP_DIVISORS, in order; a later cut wins only with a smaller error
            q, s, m, err = _clip_candidate(y, mask, lo, hi, 0.0, LEVELS)
            q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 40.0, LEVELS)
            q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 20.0, LEVELS)
            q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 14.0, LEVELS)
            q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 10.0, LEVELS)
            q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 8.0, LEVELS)
            q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 7.0, LEVELS)
            code = q.to(tl.int32)
            if BITS & 4:
                _store_plane(v_ptr + row, code, D, stride_vd, 0, 4, BLOCK_D)
            if BITS & 2:
                _store_plane(v_ptr + row, code, D, stride_vd, BITS & 4, 2, BLOCK_D)
            if BITS & 1:
                _store_plane(v_ptr + row, code, D, stride_vd, BITS & 6, 1, BLOCK_D)
            tl.store(o_ptr + srow, m.to(tl.float16))
            deq = q * s + m
        tl.store(s_ptr + srow, s.to(tl.float16))
        deq = hadamard_rows(tl.reshape(deq, (1, BLOCK_D)), 1, BLOCK_D, LOG2_N) * had_scale
        deq_ptrs = deq_ptr + (pid_t * tl.num_programs(1) + head) * D + offs_d
        tl.store(deq_ptrs, tl.reshape(deq, (BLOCK_D,)), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: dict[str, torch.Tensor],
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (T, num_kv_heads, head_dim), slot_mapping (T,) -> k, v (T, num_kv_heads, head_dim)
    in k's dtype as attention will read them back (see paged_attention.write_kv). Slots must
    be distinct: which of two writes to one slot lands is unspecified."""
    T, hkv, d = k.shape
    assert v.shape == k.shape and v.dtype == k.dtype, (k.shape, v.shape)
    assert slot_mapping.shape == (T,) and not slot_mapping.is_floating_point()
    values = cache["k"]
    quant = kv_quant_code(cache)
    for which, bits in PACKED_BITS.items():
        width = packed_bytes(d, bits) if quant == 2 else d
        assert cache[which].shape[2:] == (hkv, width), (which, cache[which].shape, k.shape)
    assert all(cache[n].dtype == SCALE_DTYPE for n in cache if "_" in n)
    assert k.device == values.device == slot_mapping.device
    page = values.shape[1]

    had_scale, log2_n = hadamard_args(d)
    out = []
    for which, x in (("k", k), ("v", v)):
        if quant:
            deq = torch.empty(T, hkv, d, device=x.device, dtype=torch.float32)
        else:  # torch casts (the interpreter's fp32 -> bf16 truncates); the kernel scatters
            x = deq = x.to(values.dtype)
        if T:
            _kv_write_kernel[(T, hkv)](
                x, slot_mapping, *kv_args(cache, which)[:3], deq,
                d, page, had_scale, *x.stride(), *kv_args(cache, which)[3:],
                QUANT=quant, BITS=PACKED_BITS[which], LEVELS=2.0 ** PACKED_BITS[which] - 1,
                BLOCK_D=max(8, triton.next_power_of_2(d)), LOG2_N=log2_n,
            )
        out.append(deq.to(k.dtype))
    return out[0], out[1]
