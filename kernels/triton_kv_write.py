"""KV-cache write in Triton: quantize this step's K and V per (token, kv head) and scatter
codes and their fp16 companions into their slots. The reference is `write_kv` in
kernels/paged_attention.py, with the formats of kernels/kv_quant.py; the codes and scales
written are bit for bit the reference's (same roundings, in the same order):

    int8 K and V:  s = fp16(max|y| / 127)         q = rint(y / s)  in [-127, 127]     y = H x
    int4 V:        m = fp16(lo)  s = fp16((hi - m) / 15)   q = rint((y - m) / s)  in [0, 15]
                   [lo, hi] the range of y, or that range cut by 1/D at each end for the D of
                   kv_quant.CLIP_DIVISORS with the least fp64 squared error; 4-bit codes packed
                   as kv_quant.pack (two a byte, the even element in the low nibble)
    int4 K:        z = x / sigma   t = fp16(max |z| over coded channels, clamped to fp16's
                   normal range)   step = t / 2^(b - 1)
                   q = floor((z + t) / step)  in [0, 2^b - 1], with the layer's codebook
                   (per channel sigma and width b, load_key_codebook), as the bit stream of
                   kv_quant.pack_keys

y = H x is the Hadamard rotation, done in the kernel with the reference's own butterflies
(`hadamard_rows`: the same adds in the same order), so y too is the reference's to the bit;
the values returned are dequantized (and rotated back, where rotated) the same way. Divisions
are `div_rn` (IEEE round-to-nearest, as torch divides; a plain `/` in Triton may be
approximate on GPUs), and the launch disables FMA contraction (`enable_fp_fusion=False`), so
every multiply and add rounds on its own, as torch's separate ops do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.kv_quant import KEY_BITS, SCALE_DTYPE, VALUE_BITS, kv_parts, packed_bytes
from qserve.kernels.triton_paged_attention import (codebook_args, dequant_key, hadamard_args,
                                                   hadamard_rows, key_fields, kv_args,
                                                   kv_quant_code, load_key_codebook)

_TINY = tl.constexpr(2.0 ** -14)  # kv_quant._TINY
_FP16_MAX = tl.constexpr(65504.0)
_RINT = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + it) - it rounds |v| < 2^22 half to even
_V_LEVELS = tl.constexpr(2.0 ** VALUE_BITS - 1)  # int4 values' top code, a float for div_rn


@triton.jit
def _clip_candidate(y, mask, lo, hi, div: tl.constexpr):
    """One range cut of kv_quant.quantize_packed: (codes, scale, offset, fp64 squared error)
    for the range [lo, hi] less 1/div of it at each end (div 0: no cut)."""
    if div > 0:
        m = (lo + tl.math.div_rn(hi - lo, div)).to(tl.float16).to(tl.float32)
        top = hi - tl.math.div_rn(hi - lo, div)
    else:
        m = lo.to(tl.float16).to(tl.float32)
        top = hi
    s = tl.maximum(tl.math.div_rn(top - m, _V_LEVELS), _TINY).to(tl.float16).to(tl.float32)
    q = (tl.math.div_rn(y - m, s) + _RINT) - _RINT
    q = tl.where(mask, tl.minimum(tl.maximum(q, 0.0), _V_LEVELS), 0.0)
    r = q.to(tl.float64) * s.to(tl.float64) + m.to(tl.float64) - y.to(tl.float64)
    return q, s, m, tl.sum(tl.where(mask, r * r, 0.0), axis=0)


@triton.jit
def _keep_better(q, s, m, err, y, mask, lo, hi, div: tl.constexpr):
    """The cut of 1/div if its error is smaller than err's (the earlier cuts' best)."""
    q2, s2, m2, err2 = _clip_candidate(y, mask, lo, hi, div)
    better = err2 < err
    return (tl.where(better, q2, q), tl.where(better, s2, s), tl.where(better, m2, m),
            tl.where(better, err2, err))


@triton.jit
def _quantize_values(y, mask, D, v_ptr, stride_vd, o_ptr, BLOCK_D: tl.constexpr):
    """int4 values: y (BLOCK_D,) fp32 rotated -> codes stored at v_ptr, offset at o_ptr;
    returns (codes, scale, offset) as fp32."""
    lo = tl.min(tl.where(mask, y, float("inf")), axis=0)
    hi = tl.max(tl.where(mask, y, float("-inf")), axis=0)
    # kv_quant.CLIP_DIVISORS, in order; a later cut wins only with a smaller error
    q, s, m, err = _clip_candidate(y, mask, lo, hi, 0.0)
    q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 40.0)
    q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 20.0)
    q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 14.0)
    q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 10.0)
    q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 8.0)
    q, s, m, err = _keep_better(q, s, m, err, y, mask, lo, hi, 7.0)
    even, odd = tl.split(tl.reshape(q.to(tl.int32), (BLOCK_D // 2, 2)))
    offs_b = tl.arange(0, BLOCK_D // 2)
    tl.store(v_ptr + offs_b * stride_vd, (even | (odd << 4)).to(tl.uint8), mask=offs_b < D // 2)
    tl.store(o_ptr, m.to(tl.float16))
    return q, s, m


@triton.jit
def _quantize_keys(x, D, v_ptr, stride_vd, sigma, width, start, BLOCK_D: tl.constexpr):
    """int4 keys: x (BLOCK_D,) fp32, not rotated, and a codebook row -> the bit stream stored
    at v_ptr; returns the keys dequantized (BLOCK_D,) and t, fp32."""
    z = tl.math.div_rn(x, sigma)
    t = tl.max(tl.where(width > 0, tl.abs(z), 0.0), axis=0)
    t = tl.minimum(tl.maximum(t, _TINY), _FP16_MAX).to(tl.float16).to(tl.float32)
    first, shift, top, step_units = key_fields(width, start, D)
    q = tl.floor(tl.math.div_rn(z + t, t * step_units))  # t * step_units = step, exactly
    q = tl.minimum(tl.maximum(q, 0.0), top.to(tl.float32))  # width 0: top 0, code 0
    # Each code, shifted into the two bytes from `first`, is < 2^16; stored byte j is the sum
    # (the fields do not overlap: an OR) of what every code puts there, over a
    # (BLOCK_D, BLOCK_D / 2) grid of (channel, byte).
    field = q.to(tl.int32) << shift
    rel = tl.arange(0, BLOCK_D // 2)[None, :] - first[:, None]
    part = tl.where(rel == 0, field[:, None] & 255, tl.where(rel == 1, field[:, None] >> 8, 0))
    offs_b = tl.arange(0, BLOCK_D // 2)
    tl.store(v_ptr + offs_b * stride_vd, tl.sum(part, axis=0).to(tl.uint8),
             mask=offs_b < D // 2)
    return dequant_key(q, t, step_units, sigma), t


@triton.jit
def _kv_write_kernel(
    # pointers
    x_ptr, slot_ptr, v_ptr, s_ptr, o_ptr, deq_ptr,
    sigma_ptr, width_ptr, start_ptr,  # int4 keys' codebook, (Hkv, D) each
    # sizes
    D, PAGE, had_scale,
    # strides
    stride_xt, stride_xh, stride_xd,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_sb, stride_ss, stride_sh,
    # meta-parameters
    QUANT: tl.constexpr, KEYS: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_N: tl.constexpr,
):
    """Program (t, h) writes token t's head h of K (KEYS) or V, and its dequantized values
    (rotated back, where rotated) to deq (T, Hkv, D) fp32; QUANT as load_kv_tile's."""
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < D
    x = tl.load(x_ptr + pid_t * stride_xt + head * stride_xh + offs_d * stride_xd,
                mask=mask, other=0.0)
    slot = tl.load(slot_ptr + pid_t)
    if slot < 0:  # a padding row (cuda_graph.PAD_SLOT): no slot, and deq is not read
        return
    row = (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs + head * stride_vh
    srow = (slot // PAGE) * stride_sb + (slot % PAGE) * stride_ss + head * stride_sh
    deq_ptrs = deq_ptr + (pid_t * tl.num_programs(1) + head) * D + offs_d
    if QUANT == 0:
        tl.store(v_ptr + row + offs_d * stride_vd, x, mask=mask)  # already cache dtype
    elif QUANT == 2 and KEYS:
        sigma, width, start = load_key_codebook(sigma_ptr, width_ptr, start_ptr, head, D,
                                                QUANT, BLOCK_D)
        deq, t = _quantize_keys(x.to(tl.float32), D, v_ptr + row, stride_vd, sigma, width,
                                start, BLOCK_D)
        tl.store(s_ptr + srow, t.to(tl.float16))
        tl.store(deq_ptrs, deq, mask=mask)
    else:
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
            q, s, m = _quantize_values(y, mask, D, v_ptr + row, stride_vd, o_ptr + srow,
                                       BLOCK_D)
            deq = q * s + m
        tl.store(s_ptr + srow, s.to(tl.float16))
        deq = hadamard_rows(tl.reshape(deq, (1, BLOCK_D)), 1, BLOCK_D, LOG2_N) * had_scale
        tl.store(deq_ptrs, tl.reshape(deq, (BLOCK_D,)), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: dict[str, torch.Tensor],
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (T, num_kv_heads, head_dim), slot_mapping (T,) -> k, v (T, num_kv_heads, head_dim)
    in k's dtype as attention will read them back (see paged_attention.write_kv). Slots must
    be distinct: which of two writes to one slot lands is unspecified. A negative slot (a
    padding row of a CUDA-graph batch) writes nothing, and its returned row is undefined."""
    T, hkv, d = k.shape
    assert v.shape == k.shape and v.dtype == k.dtype, (k.shape, v.shape)
    assert slot_mapping.shape == (T,) and not slot_mapping.is_floating_point()
    values = cache["k"]
    quant = kv_quant_code(cache)
    for which, bits in (("k", KEY_BITS), ("v", VALUE_BITS)):
        width = packed_bytes(d, bits) if quant == 2 else d
        assert cache[which].shape[2:] == (hkv, width), (which, cache[which].shape, k.shape)
        for part in kv_parts(values.dtype, which):
            assert cache[f"{which}_{part}"].dtype == SCALE_DTYPE, (which, part)
    assert k.device == values.device == slot_mapping.device
    page = values.shape[1]
    codebook = codebook_args(cache)

    had_scale, log2_n = hadamard_args(d)
    out = []
    for which, x in (("k", k), ("v", v)):
        if quant:
            deq = torch.empty(T, hkv, d, device=x.device, dtype=torch.float32)
        else:  # torch casts (the interpreter's fp32 -> bf16 truncates); the kernel scatters
            x = deq = x.to(values.dtype)
        if T:
            args = kv_args(cache, which)
            _kv_write_kernel[(T, hkv)](
                x, slot_mapping, *args[:3], deq, *codebook,
                d, page, had_scale, *x.stride(), *args[3:],
                QUANT=quant, KEYS=which == "k", BLOCK_D=max(8, triton.next_power_of_2(d)),
                LOG2_N=log2_n,
                # No FMA contraction: (y - m) / s and q * s + m round twice, as the reference
                # does; a fused multiply-add would round once and flip codes near a tie.
                enable_fp_fusion=False,
            )
        out.append(deq.to(k.dtype))
    return out[0], out[1]
