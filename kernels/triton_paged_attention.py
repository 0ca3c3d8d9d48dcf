"""Paged-attention decode in Triton (FlashDecoding): one query token per sequence against its
context, read through the block table and dequantized in registers. The reference is
`_decode_attention` in kernels/paged_attention.py, whose docstring has the cache layout.

    grid (B, num_kv_heads, S): program (b, h, s) holds the G = H / Hkv query heads that share
    KV head h as the rows of one tile, so each K/V token is read once for the group, and it
    covers tokens [lo + s * split_len, lo + (s + 1) * split_len) of sequence b (lo > 0 only
    under a sliding window). It writes its unnormalised partial (m, l, acc) per head;
    a second kernel merges the S partials of each (b, head):

        out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,     M = max_s m_s

Quantized K/V hold H y (H the orthonormal symmetric Hadamard matrix, kv_quant.py), and
q . (H y) = (H q) . y,  sum_n p_n H y_n = H sum_n p_n y_n: the kernel rotates q once and the
reduction rotates the output once, so no token is ever rotated back. The rotation is the
reference's own butterflies (`hadamard_rows`), the same adds in the same order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.kv_quant import K_BITS, V_BITS, packed_bytes
from qserve.kernels.paged_attention import PagedAttentionMetadata
from qserve.kernels.triton_dequant_gemm import dot_dtype

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # a running max below any real score; exp2(-inf - it) = 0


@triton.jit
def hadamard_rows(y, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_N: tl.constexpr):
    """(ROWS, BLOCK_D) fp32 -> each row times the unnormalised Hadamard matrix: block-diagonal
    blocks of N = 2^LOG2_N, as kv_quant.hadamard_transform (which then scales by N^-1/2):
    stage h pairs element j with j + h inside blocks of 2h, -> (y_j + y_j+h, y_j - y_j+h)."""
    for i in tl.static_range(LOG2_N):
        y = tl.reshape(y, (ROWS, BLOCK_D // (2 << i), 2, 1 << i))  # (.., block, pair, j)
        a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(y, (ROWS, BLOCK_D))


def hadamard_args(d: int) -> tuple[float, int]:
    """(scale, LOG2_N) of hadamard_rows for head_dim d, as kv_quant.hadamard builds it."""
    n = d & -d
    return n ** -0.5, n.bit_length() - 1


@triton.jit
def packed_field(base, offs_d, mask, D, stride_d, BELOW: tl.constexpr, W: tl.constexpr):
    """Bits BELOW .. BELOW + W of packed codes (kv_quant.pack): the plane of width W starts
    after the D * BELOW / 8 bytes of the lower planes, and element e sits in its byte
    e * W // 8 at bit e * W % 8 (neighbouring elements re-read a byte, from cache)."""
    b = tl.load(base + ((D * BELOW) // 8 + (offs_d * W) // 8) * stride_d, mask=mask, other=0)
    return ((b.to(tl.int32) >> ((offs_d * W) % 8)) & ((1 << W) - 1)) << BELOW


@triton.jit
def load_kv_tile(v_ptr, s_ptr, o_ptr, blk, off, kv_head, mask_n, D,
                 stride_vb, stride_vs, stride_vh, stride_vd, stride_sb, stride_ss, stride_sh,
                 QUANT: tl.constexpr, BITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(BLOCK_N,) block ids and offsets -> (BLOCK_N, BLOCK_D) fp32 values of one K or V head.
    QUANT 0: stored as floats; 1: int8 * scale; 2: packed BITS-wide codes * scale + offset.
    Rows outside mask_n read 0 and touch no memory."""
    row = blk * stride_vb + off * stride_vs + kv_head * stride_vh  # (BLOCK_N,)
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_n[:, None] & (offs_d < D)[None, :]
    if QUANT == 2:
        base = v_ptr + row[:, None]
        code = tl.zeros((blk.shape[0], BLOCK_D), tl.int32)
        if BITS & 4:
            code |= packed_field(base, offs_d[None, :], mask, D, stride_vd, 0, 4)
        if BITS & 2:
            code |= packed_field(base, offs_d[None, :], mask, D, stride_vd, BITS & 4, 2)
        if BITS & 1:
            code |= packed_field(base, offs_d[None, :], mask, D, stride_vd, BITS & 6, 1)
        x = code.to(tl.float32)
    else:
        x = tl.load(v_ptr + row[:, None] + offs_d[None, :] * stride_vd, mask=mask,
                    other=0.0).to(tl.float32)
    if QUANT > 0:
        srow = blk * stride_sb + off * stride_ss + kv_head * stride_sh
        x *= tl.load(s_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        if QUANT == 2:
            x += tl.load(o_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    return x


@triton.jit
def _decode_kernel(
    # pointers
    q_ptr, k_ptr, ks_ptr, ko_ptr, v_ptr, vs_ptr, vo_ptr, bt_ptr, seq_lens_ptr,
    acc_ptr, m_ptr, l_ptr,  # partials: (B, H, S, BLOCK_D), (B, H, S), (B, H, S) fp32
    # sizes
    qk_scale, window, split_len, D, G, PAGE, S, had_scale,
    # strides
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_ksb, stride_kss, stride_ksh,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_vsb, stride_vss, stride_vsh,
    stride_btb, stride_btn,
    # meta-parameters
    QUANT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, LOG2_N: tl.constexpr,
):
    pid_b = tl.program_id(0)
    kv_head = tl.program_id(1)
    pid_s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + pid_b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    start = lo + pid_s * split_len
    end = tl.minimum(seq_len, start + split_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * G + offs_g  # (BLOCK_G,) the query heads of this KV head
    mask_g = offs_g < G
    q_ptrs = q_ptr + pid_b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_g[:, None] & (offs_d < D)[None, :], other=0.0)  # (BG, BD)
    if QUANT > 0:  # q . (H y) = (H q) . y
        q = hadamard_rows(q.to(tl.float32), BLOCK_G, BLOCK_D, LOG2_N) * had_scale
    q = q.to(DOT_DTYPE)

    m_i = tl.full((BLOCK_G,), _NEG_BIG, tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        blk = tl.load(bt_ptr + pid_b * stride_btb + (offs_n // PAGE) * stride_btn,
                      mask=mask_n, other=0)  # (BN,)
        off = offs_n % PAGE
        k = load_kv_tile(k_ptr, ks_ptr, ko_ptr, blk, off, kv_head, mask_n, D,
                         stride_kb, stride_ks, stride_kh, stride_kd, stride_ksb, stride_kss,
                         stride_ksh, QUANT, K_BITS, BLOCK_D)  # (BN, BD)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))  # (BG, BN), log2 units
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = load_kv_tile(v_ptr, vs_ptr, vo_ptr, blk, off, kv_head, mask_n, D,
                         stride_vb, stride_vs, stride_vh, stride_vd, stride_vsb, stride_vss,
                         stride_vsh, QUANT, V_BITS, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                            input_precision=PRECISION)
        m_i = m_new

    row = (pid_b * G * tl.num_programs(1) + heads) * S + pid_s  # (BG,) index into (B, H, S)
    tl.store(m_ptr + row, m_i, mask=mask_g)
    tl.store(l_ptr + row, l_i, mask=mask_g)
    tl.store(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_g[:, None])


@triton.jit
def _reduce_kernel(
    # pointers
    acc_ptr, m_ptr, l_ptr, out_ptr,
    # sizes
    D, S, had_scale,
    # strides
    stride_ob, stride_oh, stride_od,
    # meta-parameters
    QUANT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_N: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < S
    row = (pid_b * tl.num_programs(1) + pid_h) * S + offs_s  # (BS,)
    m = tl.load(m_ptr + row, mask=mask_s, other=float("-inf"))
    w = tl.exp2(m - tl.max(m, axis=0))  # (BS,); an empty split has l = 0
    l_sum = tl.sum(tl.load(l_ptr + row, mask=mask_s, other=0.0) * w, axis=0)
    acc = tl.load(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=mask_s[:, None],
                  other=0.0)  # (BS, BD)
    out = tl.sum(acc * w[:, None], axis=0) / l_sum  # (BD,)
    if QUANT > 0:  # sum_n p_n H y_n = H sum_n p_n y_n
        out = tl.reshape(hadamard_rows(tl.reshape(out, (1, BLOCK_D)), 1, BLOCK_D, LOG2_N),
                         (BLOCK_D,)) * had_scale
    out_ptrs = out_ptr + pid_b * stride_ob + pid_h * stride_oh + offs_d * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def kv_quant_code(cache: dict[str, torch.Tensor]) -> int:
    """QUANT of load_kv_tile for this cache: 0 float, 1 int8, 2 int4."""
    return {torch.int8: 1, torch.uint8: 2}.get(cache["k"].dtype, 0)


def kv_args(cache: dict[str, torch.Tensor], which: str) -> tuple:
    """(values, scale, offset, 7 strides) of cache[which], as load_kv_tile takes them; the
    companions of a float cache are the values themselves (never read)."""
    t = cache[which]
    s = cache.get(f"{which}_scale", t)
    o = cache.get(f"{which}_offset", s)
    ss = s.stride()[:3] if s.dim() == 3 else (0, 0, 0)
    return (t, s, o, *t.stride(), *ss)


def check_cache(q: torch.Tensor, cache: dict[str, torch.Tensor]) -> None:
    """Shapes and dtypes a kernel relies on; q (..., H, d)."""
    k = cache["k"]
    v = cache["v"]
    assert k.dim() == 4 and v.shape[:3] == k.shape[:3] and v.dtype == k.dtype
    H, d = q.shape[-2:]
    hkv = k.shape[2]
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert H % hkv == 0, f"{H} query heads over {hkv} KV heads"
    if k.dtype == torch.uint8:
        assert (k.shape[3], v.shape[3]) == (packed_bytes(d, K_BITS), packed_bytes(d, V_BITS))
    else:
        assert k.shape[3] == v.shape[3] == d, (k.shape, v.shape, d)
    for name in ("k_scale", "v_scale", "k_offset", "v_offset"):
        if name in cache:
            assert cache[name].shape == k.shape[:3], (name, cache[name].shape)
            assert cache[name].stride() == cache[name[0] + "_scale"].stride(), name
    assert k.device == q.device


def _num_splits(batch_kv_heads: int, length: int, device: torch.device) -> int:
    """Enough programs for two waves over the SMs, each over >= 256 tokens."""
    if device.type != "cuda":
        return max(1, min(4, triton.cdiv(length, 64)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(2 * sms, batch_kv_heads), triton.cdiv(length, 256)))


def decode_attention(q: torch.Tensor, cache: dict[str, torch.Tensor],
                     meta: PagedAttentionMetadata, scale: float,
                     num_splits: int | None = None) -> torch.Tensor:
    """q (B, H, d), one query per sequence, against its seq_lens[b] cached tokens
    -> (B, H, d) in q's dtype. num_splits: programs per (sequence, KV head) along the
    context (None picks one)."""
    check_cache(q, cache)
    B, H, d = q.shape
    page, hkv = cache["k"].shape[1:3]
    assert meta.seq_lens.shape == (B,) and meta.block_tables.shape[0] == B
    quant = kv_quant_code(cache)
    had_scale, log2_n = hadamard_args(d)
    window = meta.sliding_window
    length = max(1, min(meta.max_seq_len, window or meta.max_seq_len))
    S = num_splits or _num_splits(B * hkv, length, q.device)
    BLOCK_N = 64
    split_len = triton.cdiv(length, S)
    if split_len > BLOCK_N:
        split_len = triton.cdiv(split_len, BLOCK_N) * BLOCK_N
    S = triton.cdiv(length, split_len)
    BLOCK_D = max(16, triton.next_power_of_2(d))
    BLOCK_G = max(16, triton.next_power_of_2(H // hkv))

    acc = torch.empty(B, H, S, BLOCK_D, device=q.device, dtype=torch.float32)
    m = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    l_ = torch.empty_like(m)
    bt = meta.block_tables
    k_args, v_args = kv_args(cache, "k"), kv_args(cache, "v")
    _decode_kernel[(B, hkv, S)](
        q, *k_args[:3], *v_args[:3], bt, meta.seq_lens,
        acc, m, l_,
        scale * _LOG2E, window or 0, split_len, d, H // hkv, page, S, had_scale,
        *q.stride(), *k_args[3:], *v_args[3:], *bt.stride(),
        QUANT=quant, K_BITS=K_BITS, V_BITS=V_BITS, HAS_WINDOW=window is not None,
        DOT_DTYPE=dot_dtype(q.dtype), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, LOG2_N=log2_n,
    )
    out = torch.empty(B, H, d, device=q.device, dtype=q.dtype)
    _reduce_kernel[(B, H)](
        acc, m, l_, out, d, S, had_scale, *out.stride(),
        QUANT=quant, BLOCK_S=triton.next_power_of_2(S), BLOCK_D=BLOCK_D, LOG2_N=log2_n,
    )
    return out
