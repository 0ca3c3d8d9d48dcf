"""Prefill / chunked-prefill attention in Triton: each sequence's packed query rows against its
whole cached context (prefix-cache hits, earlier chunks and this step's tokens alike, since
write_kv has already stored them), causal, read through the block table. The reference is
`paged_attention` in kernels/paged_attention.py, whose docstring has the layouts.

    grid (B, cdiv(max query_len, BLOCK_M), Hkv): program (b, i, h) holds query rows i *
    BLOCK_M ... of sequence b for all G = H / Hkv query heads that share KV head h, as the R
    = BLOCK_M * BLOCK_G rows of one tile (row r: query row r // BLOCK_G, head h * G + r %
    BLOCK_G), so each K/V tile is loaded and dequantized once for the group (GQA sharing). R
    stays 64 (the register budget of acc), so long chunks read as much K/V as one head per
    program would; chunks shorter than 64 rows and decode rows in a mixed batch, which used
    to fill a 64-row tile alone, read it G times less. Query rows are positions L - n + row
    (n = query_len, L = seq_len), so a row sees keys [lo, L - n + row] with lo = 0, or the
    window's start. Keys stream in BLOCK_N tiles with an online softmax (FlashAttention-2,
    online_softmax_step), stopping at the tile's last row's position, so a chunk after a
    long prefix pays for the prefix once per row tile and the causal triangle only up to the
    diagonal.

Quantized K/V as in triton_paged_attention: the kernel rotates q by H for int8 keys (int4
keys are not rotated; they are read through their codebook), and the output for both int8
and int4 values.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.paged_attention import PagedAttentionMetadata
from qserve.kernels.triton_dequant_gemm import dot_dtype
from qserve.kernels.triton_paged_attention import (_LOG2E, _NEG_BIG, check_cache,
                                                   codebook_args, hadamard_args, hadamard_rows,
                                                   kv_args, kv_quant_code, load_key_codebook,
                                                   load_kv_tile, online_softmax_step)


@triton.jit
def _prefill_kernel(
    # pointers
    q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, vo_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    sigma_ptr, width_ptr, start_ptr,  # int4 keys' codebook, (Hkv, D) each
    # sizes
    qk_scale, window, D, G, PAGE, had_scale,
    # strides
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_ksb, stride_kss, stride_ksh,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_vsb, stride_vss, stride_vsh,
    stride_btb, stride_btn,
    stride_ot, stride_oh, stride_od,
    # meta-parameters
    QUANT: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_N: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_m = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + pid_b)
    n_q = tl.load(qsl_ptr + pid_b + 1) - q_start
    if pid_m * BLOCK_M >= n_q:
        return
    seq_len = tl.load(seq_lens_ptr + pid_b)

    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)  # (R,) tile rows: (query row, head in group)
    offs_m = pid_m * BLOCK_M + offs_r // BLOCK_G  # query rows within the sequence
    offs_g = offs_r % BLOCK_G
    heads = kv_head * G + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = (offs_m < n_q) & (offs_g < G)
    q_pos = seq_len - n_q + offs_m  # (R,) their positions in the context
    q_ptrs = q_ptr + (q_start + offs_m)[:, None] * stride_qt + heads[:, None] * stride_qh \
        + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_r[:, None] & (offs_d < D)[None, :], other=0.0)  # (R, BD)
    if QUANT == 1:  # q . (H y) = (H q) . y
        q = hadamard_rows(q.to(tl.float32), BLOCK_M * BLOCK_G, BLOCK_D, LOG2_N) * had_scale
    q = q.to(DOT_DTYPE)
    k_sigma, k_width, k_start = load_key_codebook(sigma_ptr, width_ptr, start_ptr, kv_head, D,
                                                  QUANT, BLOCK_D)

    hi = tl.minimum(seq_len, seq_len - n_q + (pid_m + 1) * BLOCK_M)  # past the last row's key
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - n_q + pid_m * BLOCK_M - window + 1, 0)
    m_i = tl.full((BLOCK_M * BLOCK_G,), _NEG_BIG, tl.float32)
    l_i = tl.zeros((BLOCK_M * BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_M * BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # key positions
        mask_n = offs_n < hi
        blk = tl.load(bt_ptr + pid_b * stride_btb + (offs_n // PAGE) * stride_btn,
                      mask=mask_n, other=0)
        off = offs_n % PAGE
        k, k_scale, _ = load_kv_tile(k_ptr, ks_ptr, ks_ptr, blk, off, kv_head, mask_n, D,
                                     stride_kb, stride_ks, stride_kh, stride_kd, stride_ksb,
                                     stride_kss, stride_ksh, k_sigma, k_width, k_start, QUANT,
                                     True, BLOCK_D)  # (BN, BD): no offset for keys
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) \
            * (k_scale * qk_scale)[None, :]
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])  # (R, BN) causal
        if HAS_WINDOW:
            visible &= offs_n[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        v, v_scale, v_offset = load_kv_tile(
            v_ptr, vs_ptr, vo_ptr, blk, off, kv_head, mask_n, D, stride_vb, stride_vs,
            stride_vh, stride_vd, stride_vsb, stride_vss, stride_vsh, k_sigma, k_width, k_start,
            QUANT, False, BLOCK_D)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, v_scale, v_offset, QUANT == 2,
                                            DOT_DTYPE, PRECISION)

    out = acc / tl.where(mask_r, l_i, 1.0)[:, None]  # a real row sees its own key: l_i > 0
    if QUANT > 0:  # values hold H y: sum_n p_n H y_n = H sum_n p_n y_n
        out = hadamard_rows(out, BLOCK_M * BLOCK_G, BLOCK_D, LOG2_N) * had_scale
    out_ptrs = out_ptr + (q_start + offs_m)[:, None] * stride_ot + heads[:, None] * stride_oh \
        + offs_d[None, :] * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty),
             mask=mask_r[:, None] & (offs_d < D)[None, :])


def prefill_attention(q: torch.Tensor, cache: dict[str, torch.Tensor],
                      meta: PagedAttentionMetadata, scale: float,
                      k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """q (T, H, d), packed per meta.query_start_loc -> (T, H, d) in q's dtype; any mix of
    query lengths (a decode step is query_len 1). The cache already holds this step's K/V;
    k_new / v_new are accepted for paged_attention's signature and not read, since they
    equal what the cache reads back (write_kv's contract)."""
    check_cache(q, cache)
    T, H, d = q.shape
    B = meta.seq_lens.shape[0]
    page, hkv = cache["k"].shape[1:3]
    assert meta.query_start_loc.shape == (B + 1,) and meta.block_tables.shape[0] == B
    quant = kv_quant_code(cache)
    had_scale, log2_n = hadamard_args(d)
    out = torch.empty(T, H, d, device=q.device, dtype=q.dtype)
    if T == 0:
        return out

    BLOCK_G = triton.next_power_of_2(H // hkv)
    BLOCK_M, BLOCK_N = max(1, 64 // BLOCK_G), 64  # tiles of 64 rows (BLOCK_G heads each)
    BLOCK_D = max(16, triton.next_power_of_2(d))
    max_q = max(meta.query_lens_list)
    window = meta.sliding_window
    bt = meta.block_tables
    k_args, v_args = kv_args(cache, "k"), kv_args(cache, "v")
    _prefill_kernel[(B, triton.cdiv(max_q, BLOCK_M), hkv)](
        q, *k_args[:2], *v_args[:3], bt, meta.seq_lens, meta.query_start_loc, out,
        *codebook_args(cache),
        scale * _LOG2E, window or 0, d, H // hkv, page, had_scale,
        *q.stride(), *k_args[3:], *v_args[3:], *bt.stride(),
        *out.stride(),
        QUANT=quant, HAS_WINDOW=window is not None,
        DOT_DTYPE=dot_dtype(q.dtype), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, LOG2_N=log2_n,
    )
    return out
