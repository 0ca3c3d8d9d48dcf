"""KV-cache write in Triton: quantize this step's K and V per (token, kv head) and scatter
values, scales and offsets into their slots. The reference is `write_kv` in
kernels/paged_attention.py, with the formats of kernels/kv_quant.py; the codes and scales
written are bit for bit the reference's (same roundings, in the same order):

    int8:  s = fp16(max|y| / 127)           q = rint(y / s)         in [-127, 127]
    int4:  m = fp16(min y)  s = fp16((max y - m) / 15)   q = rint((y - m) / s)  in [0, 15]

y = H x is the Hadamard rotation, done in the kernel with the reference's own butterflies
(`hadamard_rows`: the same adds in the same order), so y too is the reference's to the bit;
the values returned are dequantized and rotated back the same way. Divisions are `div_rn`
(IEEE round-to-nearest, as torch divides; a plain `/` in Triton may be approximate on GPUs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.kv_quant import SCALE_DTYPE
from qserve.kernels.triton_paged_attention import (hadamard_args, hadamard_rows, kv_args,
                                                   kv_quant_code)

_TINY = tl.constexpr(2.0 ** -14)  # kv_quant._TINY
_RINT = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + it) - it rounds |v| < 2^22 half to even


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
    QUANT: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_N: tl.constexpr,
):
    """Program (t, h) writes token t's head h, and its dequantized values rotated back to
    deq (T, Hkv, D) fp32. Quantization works on the d values as (BLOCK_D / 2, 2) pairs,
    element 2p + j at [p, j], which is how int4 packs them into byte p."""
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + pid_t * stride_xt + head * stride_xh + offs_d * stride_xd,
                mask=offs_d < D, other=0.0)
    slot = tl.load(slot_ptr + pid_t)
    row = (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs + head * stride_vh
    if QUANT == 0:
        tl.store(v_ptr + row + offs_d * stride_vd, x, mask=offs_d < D)  # already cache dtype
    else:
        srow = (slot // PAGE) * stride_sb + (slot % PAGE) * stride_ss + head * stride_sh
        y = hadamard_rows(tl.reshape(x.to(tl.float32), (1, BLOCK_D)), 1, BLOCK_D, LOG2_N)
        y = tl.reshape(y * had_scale, (BLOCK_D // 2, 2))  # y = H x, the reference's bits
        offs_p = tl.arange(0, BLOCK_D // 2)
        offs_e = 2 * offs_p[:, None] + tl.arange(0, 2)[None, :]  # (BD / 2, 2) element index
        mask = offs_e < D
        if QUANT == 1:
            amax = tl.max(tl.max(tl.abs(y), axis=1), axis=0)
            s = tl.maximum(tl.math.div_rn(amax, 127.0), _TINY).to(tl.float16).to(tl.float32)
            q = (tl.math.div_rn(y, s) + _RINT) - _RINT
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            tl.store(v_ptr + row + offs_e * stride_vd, q.to(tl.int8), mask=mask)
            deq = q * s
        else:
            lo = tl.min(tl.min(tl.where(mask, y, float("inf")), axis=1), axis=0)
            hi = tl.max(tl.max(tl.where(mask, y, float("-inf")), axis=1), axis=0)
            m = lo.to(tl.float16).to(tl.float32)
            s = tl.maximum(tl.math.div_rn(hi - m, 15.0), _TINY).to(tl.float16).to(tl.float32)
            q = (tl.math.div_rn(y - m, s) + _RINT) - _RINT
            q = tl.minimum(tl.maximum(q, 0.0), 15.0)
            packed = tl.sum(q.to(tl.int32) << (4 * offs_e % 8), axis=1)  # (BD / 2,) lo | hi << 4
            tl.store(v_ptr + row + offs_p * stride_vd, packed.to(tl.uint8), mask=2 * offs_p < D)
            tl.store(o_ptr + srow, m.to(tl.float16))
            deq = q * s + m
        tl.store(s_ptr + srow, s.to(tl.float16))
        deq = hadamard_rows(tl.reshape(deq, (1, BLOCK_D)), 1, BLOCK_D, LOG2_N) * had_scale
        deq_ptrs = deq_ptr + (pid_t * tl.num_programs(1) + head) * D + offs_d
        tl.store(deq_ptrs, tl.reshape(deq, (BLOCK_D,)), mask=offs_d < D)


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
    assert values.shape[2:] == (hkv, d // 2 if quant == 2 else d), (values.shape, k.shape)
    assert quant != 2 or d % 2 == 0, f"int4 KV needs an even head_dim, got {d}"
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
                QUANT=quant, BLOCK_D=max(2, triton.next_power_of_2(d)), LOG2_N=log2_n,
            )
        out.append(deq.to(k.dtype))
    return out[0], out[1]
