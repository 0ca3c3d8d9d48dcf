"""Paged-attention decode in Triton (FlashDecoding): one query token per sequence against its
context, read through the block table and dequantized in registers. The reference is
`_decode_attention` in kernels/paged_attention.py, whose docstring has the cache layout.

    grid (B, num_kv_heads, S): program (b, h, s) holds the G = H / Hkv query heads that share
    KV head h as the rows of one tile, so each K/V token is read once for the group, and it
    covers tokens [lo + s * split_len, lo + (s + 1) * split_len) of sequence b (lo > 0 only
    under a sliding window). It writes its unnormalised partial (m, l, acc) per head;
    a second kernel merges the S partials of each (b, head):

        out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,     M = max_s m_s

A quantized tile is dotted as its codes (small integers, exact in fp16/bf16), and the
per-token scales (and int4 values' offsets) are applied after the dots: a key's scale to its
score column, a value's to its probability (load_kv_tile, online_softmax_step).

Quantized values hold H y (H the orthonormal symmetric Hadamard matrix, kv_quant.py), and
sum_n p_n H y_n = H sum_n p_n y_n: the reduction rotates the output once, so no value is ever
rotated back. int8 keys hold H y too, and q . (H y) = (H q) . y: the kernel rotates q once.
int4 keys are not rotated (their per-channel codebook gives outlier channels the bits that
the rotation would have spread them over), so q is used as it is, and each key is
dequantized in the tile through its layer's codebook, loaded once per program. The rotation
is the reference's own butterflies (`hadamard_rows`), the same adds in the same order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.kv_quant import CODEBOOK, KEY_BITS, VALUE_BITS, packed_bytes
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
def load_key_codebook(sigma_ptr, width_ptr, start_ptr, kv_head, D,
                      QUANT: tl.constexpr, BLOCK_D: tl.constexpr):
    """KV head `kv_head`'s row of an int4 cache's key codebook (kv_quant.CODEBOOK, each
    (Hkv, D) contiguous) -> sigma (BLOCK_D,) fp32, width, start (BLOCK_D,) int32. Padding
    channels read as width 0, sigma 1 (so they code and read 0); other caches read nothing."""
    offs_d = tl.arange(0, BLOCK_D)
    sigma = tl.full((BLOCK_D,), 1.0, tl.float32)
    width = tl.zeros((BLOCK_D,), tl.int32)
    start = width
    if QUANT == 2:
        mask = offs_d < D
        sigma = tl.load(sigma_ptr + kv_head * D + offs_d, mask=mask, other=1.0)
        width = tl.load(width_ptr + kv_head * D + offs_d, mask=mask, other=0)
        start = tl.load(start_ptr + kv_head * D + offs_d, mask=mask, other=0)
    return sigma, width, start


@triton.jit
def key_fields(width, start, D):
    """Per channel of a key codebook: where its code lies in the D / 2-byte stream of
    kv_quant.pack_keys, and the step of its levels in units of t.

    A code of width <= 8 at bit `start` lies within the two bytes from
    base = min(start // 8, D / 2 - 2), shifted right by start - 8 base (a code that starts in
    the last byte ends there, so the clamped base still covers it). Returns (base, shift,
    2^width - 1: the bit mask and the top code, 2^(1 - width): t / step). The last is
    2^(8 - width) * 2^-7, exact, with no division for a GPU to approximate; at width 0 it
    is 2, so a channel without bits reads (0 + 1/2) 2 t - t = 0."""
    base = tl.minimum(start >> 3, D // 2 - 2)
    return base, start - 8 * base, (1 << width) - 1, (256 >> width).to(tl.float32) * 0.0078125


@triton.jit
def dequant_key(code, t, step_units, sigma):
    """kv_quant.dequantize_keys for broadcastable codes (float), t, 2^(1 - width) and sigma:
    sigma ((code + 1/2) step - t) with step = t 2^(1 - width). step is exact and so is
    (code + 1/2) step (at most 9 + 11 significant bits): with or without an FMA the result
    is the reference's fp32, rounded the same twice."""
    return ((code + 0.5) * (t * step_units) - t) * sigma


@triton.jit
def load_kv_tile(v_ptr, s_ptr, o_ptr, blk, off, kv_head, mask_n, D,
                 stride_vb, stride_vs, stride_vh, stride_vd, stride_sb, stride_ss, stride_sh,
                 cb_sigma, cb_width, cb_start,
                 QUANT: tl.constexpr, KEYS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(BLOCK_N,) block ids and offsets -> (x, scale, offset) of one K or V head: x
    (BLOCK_N, BLOCK_D) fp32, and per token scale and offset (BLOCK_N,) fp32 for the caller
    to apply after its dot (x . w scaled per token is (x * scale) . w, and a per-token offset
    adds offset * sum(w)), so a tile is never scaled element by element:
    QUANT 0: x the stored floats, scale 1, offset 0; 1: x the int8 codes; 2, values (KEYS
    false): x the 4-bit codes (kv_quant.pack: element e in byte e // 2 at bit 4 (e % 2)),
    with scale and offset; 2, keys: x dequantized through the codebook cb_*
    (load_key_codebook, per channel: it cannot move past the dot), scale 1, offset 0.
    Codes are small integers, exact in fp16 and bf16. Rows outside mask_n read 0 (scale 0)
    and touch no memory."""
    row = blk * stride_vb + off * stride_vs + kv_head * stride_vh  # (BLOCK_N,)
    srow = blk * stride_sb + off * stride_ss + kv_head * stride_sh
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_n[:, None] & (offs_d < D)[None, :]
    base = v_ptr + row[:, None]
    scale = tl.where(mask_n, 1.0, 0.0)  # (BN,)
    offset = tl.zeros_like(scale)
    if QUANT == 2:  # the token's D / 2 packed bytes, one contiguous (vectorised) run
        offs_b = tl.arange(0, BLOCK_D // 2)
        packed = tl.load(base + offs_b[None, :] * stride_vd,
                         mask=mask_n[:, None] & (offs_b < D // 2)[None, :], other=0)
        packed = packed.to(tl.int32)  # (BN, BD / 2)
    if QUANT == 2 and KEYS:
        first, shift, bits, step_units = key_fields(cb_width, cb_start, D)
        # each channel's two bytes, gathered from the row in registers rather than loaded
        # one byte per element from memory
        at = first[None, :] + tl.zeros_like(blk)[:, None]  # (BN, BD)
        lo = tl.gather(packed, at, axis=1)
        hi = tl.gather(packed, at + 1, axis=1)
        code = (((hi << 8) | lo) >> shift[None, :]) & bits[None, :]  # (BN, BD)
        code = tl.where(mask, code, 0)
        t = tl.load(s_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        x = dequant_key(code.to(tl.float32), t, step_units[None, :], cb_sigma[None, :])
    else:
        if QUANT == 2:  # element e at bit 4 (e % 2) of byte e // 2: the nibbles interleaved
            x = tl.reshape(tl.join(packed & 15, packed >> 4), (blk.shape[0], BLOCK_D))
            x = x.to(tl.float32)
        else:
            x = tl.load(base + offs_d[None, :] * stride_vd, mask=mask, other=0.0).to(tl.float32)
        if QUANT > 0:
            scale = tl.load(s_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
            if QUANT == 2:
                offset = tl.load(o_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
    return x, scale, offset


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v, v_scale, v_offset, HAS_OFFSET: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of FlashAttention-2's online softmax, shared by the decode and prefill
    kernels. s (R, BN): scores in log2 units, -inf where hidden; the tile's values are
    v (BN, BD) times v_scale plus v_offset (BN,) per token (load_kv_tile); running max m_i,
    sum l_i (R,) and unnormalised output acc (R, BD), fp32:

        m' = max(m, max_n s_n)    l' = 2^(m - m') l + sum_n 2^(s_n - m')
        acc' = 2^(m - m') acc + sum_n p_n (v_n scale_n + offset_n),   p_n = 2^(s_n - m')
             = 2^(m - m') acc + (p * scale) . v + (p . offset)

    A row with every key hidden keeps m (never -inf: it starts at _NEG_BIG), and adds exactly
    0 to l and acc, so tiles past a row's last key change nothing, bit for bit."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = tl.dot((p * v_scale[None, :]).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    if HAS_OFFSET:
        pv += tl.sum(p * v_offset[None, :], axis=1)[:, None]
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _decode_kernel(
    # pointers
    q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, vo_ptr, bt_ptr, seq_lens_ptr,
    sigma_ptr, width_ptr, start_ptr,  # int4 keys' codebook, (Hkv, D) each
    acc_ptr, m_ptr, l_ptr,  # partials: (B, H, S, BLOCK_D), (B, H, S), (B, H, S) fp32
    # sizes
    qk_scale, window, split_len, D, G, PAGE, S, had_scale,
    # strides
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_ksb, stride_kss, stride_ksh,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_vsb, stride_vss, stride_vsh,
    stride_btb, stride_btn,
    # meta-parameters
    QUANT: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr,
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
    if QUANT == 1:  # q . (H y) = (H q) . y
        q = hadamard_rows(q.to(tl.float32), BLOCK_G, BLOCK_D, LOG2_N) * had_scale
    q = q.to(DOT_DTYPE)
    k_sigma, k_width, k_start = load_key_codebook(sigma_ptr, width_ptr, start_ptr, kv_head, D,
                                                  QUANT, BLOCK_D)

    m_i = tl.full((BLOCK_G,), _NEG_BIG, tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        blk = tl.load(bt_ptr + pid_b * stride_btb + (offs_n // PAGE) * stride_btn,
                      mask=mask_n, other=0)  # (BN,)
        off = offs_n % PAGE
        k, k_scale, _ = load_kv_tile(k_ptr, ks_ptr, ks_ptr, blk, off, kv_head, mask_n, D,
                                     stride_kb, stride_ks, stride_kh, stride_kd, stride_ksb,
                                     stride_kss, stride_ksh, k_sigma, k_width, k_start, QUANT,
                                     True, BLOCK_D)  # (BN, BD): no offset for keys
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) \
            * (k_scale * qk_scale)[None, :]
        s = tl.where(mask_n[None, :], s, float("-inf"))  # (BG, BN), log2 units
        v, v_scale, v_offset = load_kv_tile(
            v_ptr, vs_ptr, vo_ptr, blk, off, kv_head, mask_n, D, stride_vb, stride_vs,
            stride_vh, stride_vd, stride_vsb, stride_vss, stride_vsh, k_sigma, k_width, k_start,
            QUANT, False, BLOCK_D)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, v_scale, v_offset, QUANT == 2,
                                            DOT_DTYPE, PRECISION)

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
    QUANT: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_N: tl.constexpr,
):
    """Merge the S partials of (b, head) in split order, one at a time: a split past the
    sequence's end (m = _NEG_BIG, l = 0, acc = 0) adds exactly 0, so the result does not
    depend on how many splits the batch's longest sequence needed."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    row = (pid_b * tl.num_programs(1) + pid_h) * S  # partial s of this (b, head): row + s
    m_max = tl.load(m_ptr + row)
    for s in range(1, S):
        m_max = tl.maximum(m_max, tl.load(m_ptr + row + s))
    l_sum = 0.0
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s in range(S):
        w = tl.exp2(tl.load(m_ptr + row + s) - m_max)
        l_sum += tl.load(l_ptr + row + s) * w
        acc += tl.load(acc_ptr + (row + s) * BLOCK_D + offs_d) * w
    out = acc / l_sum  # (BD,)
    if QUANT > 0:  # values hold H y: sum_n p_n H y_n = H sum_n p_n y_n
        out = tl.reshape(hadamard_rows(tl.reshape(out, (1, BLOCK_D)), 1, BLOCK_D, LOG2_N),
                         (BLOCK_D,)) * had_scale
    out_ptrs = out_ptr + pid_b * stride_ob + pid_h * stride_oh + offs_d * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def kv_quant_code(cache: dict[str, torch.Tensor]) -> int:
    """QUANT of load_kv_tile for this cache: 0 float, 1 int8, 2 int4."""
    return {torch.int8: 1, torch.uint8: 2}.get(cache["k"].dtype, 0)


def kv_args(cache: dict[str, torch.Tensor], which: str) -> tuple:
    """(values, scale, offset, 7 strides) of cache[which], as load_kv_tile takes them; a
    companion the cache lacks (a float cache's, int4 keys' offset) is a stand-in, never read."""
    t = cache[which]
    s = cache.get(f"{which}_scale", t)
    o = cache.get(f"{which}_offset", s)
    ss = s.stride()[:3] if s.dim() == 3 else (0, 0, 0)
    return (t, s, o, *t.stride(), *ss)


def codebook_args(cache: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The key codebook's (sigma, width, start), each (Hkv, d) contiguous, of an int4 cache,
    as load_key_codebook takes them; stand-ins (never read) for any other cache."""
    k = cache["k"]
    if k.dtype != torch.uint8:
        return (k, k, k)
    hkv, d = k.shape[2], 8 * k.shape[3] // KEY_BITS
    for name, dtype in zip(CODEBOOK, (torch.float32, torch.int32, torch.int32)):
        t = cache[name]
        assert t.shape == (hkv, d) and t.dtype == dtype and t.is_contiguous(), (name, t.shape)
        assert t.device == k.device, name
    return tuple(cache[name] for name in CODEBOOK)


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
        widths = (packed_bytes(d, KEY_BITS), packed_bytes(d, VALUE_BITS))
        assert (k.shape[3], v.shape[3]) == widths, (k.shape, v.shape, d)
    else:
        assert k.shape[3] == v.shape[3] == d, (k.shape, v.shape, d)
    for name in ("k_scale", "v_scale", "v_offset"):
        if name in cache:
            assert cache[name].shape == k.shape[:3], (name, cache[name].shape)
            assert cache[name].stride() == cache[name[0] + "_scale"].stride(), name
    assert k.device == q.device


def split_len(device: torch.device) -> int:
    """Context tokens per program: fixed, so a sequence's splits (and the order its partials
    are merged in) are the same whatever else is in the batch. 256 tokens on a GPU keeps a
    program's loop long enough to hide the merge; the interpreter uses 64 so small tests
    split too."""
    return 256 if device.type == "cuda" else 64


def decode_attention(q: torch.Tensor, cache: dict[str, torch.Tensor],
                     meta: PagedAttentionMetadata, scale: float,
                     num_splits: int | None = None) -> torch.Tensor:
    """q (B, H, d), one query per sequence, against its seq_lens[b] cached tokens
    -> (B, H, d) in q's dtype. num_splits: programs per (sequence, KV head) along the
    context (None: one per split_len tokens, fixed, so a row's result is the same in any
    batch)."""
    check_cache(q, cache)
    B, H, d = q.shape
    page, hkv = cache["k"].shape[1:3]
    assert meta.seq_lens.shape == (B,) and meta.block_tables.shape[0] == B
    quant = kv_quant_code(cache)
    had_scale, log2_n = hadamard_args(d)
    window = meta.sliding_window
    length = max(1, min(meta.max_seq_len, window or meta.max_seq_len))
    BLOCK_N = 64
    if num_splits is None:
        tokens = split_len(q.device)
    else:  # a given count (tests): tokens from the batch's longest, whole tiles when > 1
        tokens = triton.cdiv(length, num_splits)
        if tokens > BLOCK_N:
            tokens = triton.cdiv(tokens, BLOCK_N) * BLOCK_N
    S = triton.cdiv(length, tokens)
    BLOCK_D = max(16, triton.next_power_of_2(d))
    BLOCK_G = max(16, triton.next_power_of_2(H // hkv))

    acc = torch.empty(B, H, S, BLOCK_D, device=q.device, dtype=torch.float32)
    m = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    l_ = torch.empty_like(m)
    bt = meta.block_tables
    k_args, v_args = kv_args(cache, "k"), kv_args(cache, "v")
    _decode_kernel[(B, hkv, S)](
        q, *k_args[:2], *v_args[:3], bt, meta.seq_lens, *codebook_args(cache),
        acc, m, l_,
        scale * _LOG2E, window or 0, tokens, d, H // hkv, page, S, had_scale,
        *q.stride(), *k_args[3:], *v_args[3:], *bt.stride(),
        QUANT=quant, HAS_WINDOW=window is not None,
        DOT_DTYPE=dot_dtype(q.dtype), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, LOG2_N=log2_n,
    )
    out = torch.empty(B, H, d, device=q.device, dtype=q.dtype)
    _reduce_kernel[(B, H)](
        acc, m, l_, out, d, S, had_scale, *out.stride(),
        QUANT=quant, BLOCK_D=BLOCK_D, LOG2_N=log2_n,
    )
    return out
