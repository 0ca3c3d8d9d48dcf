"""Paged attention and KV-cache writes, pure torch (the reference the fast kernels test against).

Cache layout, per layer (one tensor each for K and V):

    cache[block, offset, kv_head, :]      (num_blocks, block_size, num_kv_heads, head_dim)
    slot = block * block_size + offset    (the flat index a token's K/V is written to)

A step's tokens are packed flat, with no padding: sequence i owns query rows
query_start_loc[i] : query_start_loc[i + 1], which are its last `query_len` positions out of
`seq_len` (everything before them is already in the cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: cache slot of each packed token
    query_start_loc: torch.Tensor  # (B + 1,) int64: prefix sums of query lengths
    seq_lens: torch.Tensor  # (B,) int64: context length of each sequence after this step
    block_tables: torch.Tensor  # (B, max_blocks) int64, padded with 0
    query_lens_list: list[int]  # host copies, so the reference path need not sync
    seq_lens_list: list[int]
    max_seq_len: int
    decode_only: bool  # every query_len is 1
    sliding_window: int | None = None


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V into their slots.

    k, v: (T, num_kv_heads, head_dim); k_cache, v_cache: (num_blocks, block_size, num_kv_heads,
    head_dim); slot_mapping: (T,).
    """
    nb, bs, hkv, d = k_cache.shape
    k_cache.view(nb * bs, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """(num_blocks, bs, hkv, d) cache, (n,) block ids -> (length, hkv, d) contiguous context."""
    nb, bs, hkv, d = cache.shape
    return cache[block_table[: -(-length // bs)]].reshape(-1, hkv, d)[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float,
                    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Causal attention of packed queries against each sequence's cached context.

    q: (T, num_heads, head_dim). The caches already hold this step's K/V. `k_new`/`v_new`
    (T, num_kv_heads, head_dim), when given, let a sequence whose whole context is new this step
    (a fresh prefill) skip the gather. Returns (T, num_heads, head_dim).
    """
    if meta.decode_only:
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, (qlen, slen) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        s, e = starts[i], starts[i + 1]
        if qlen == slen and k_new is not None:
            k, v = k_new[s:e], v_new[s:e]
        else:
            k = _gather(k_cache, meta.block_tables[i], slen)
            v = _gather(v_cache, meta.block_tables[i], slen)
        out[s:e] = _attend(q[s:e], k, v, scale, meta.sliding_window)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            window: int | None) -> torch.Tensor:
    """One sequence: q (n, H, d) are the last n positions of k, v (L, Hkv, d)."""
    n, L = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, len, d)
    mask = None
    if window is not None or (n != L and n > 1):
        qpos = torch.arange(L - n, L).unsqueeze(1)
        kpos = torch.arange(L).unsqueeze(0)
        mask = kpos <= qpos  # (n, L)
        if window is not None:
            mask &= kpos > qpos - window
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=mask is None and n > 1, scale=scale,
        enable_gqa=True)
    return out.transpose(0, 1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence, batched: gather every context padded to the longest, mask."""
    B, H, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    g = H // hkv
    nblk = -(-meta.max_seq_len // bs)
    tables = meta.block_tables[:, :nblk]
    k = k_cache[tables].reshape(B, nblk * bs, hkv, d).permute(0, 2, 3, 1)  # (B, hkv, d, L)
    v = v_cache[tables].reshape(B, nblk * bs, hkv, d).transpose(1, 2)  # (B, hkv, L, d)
    scores = torch.matmul(q.view(B, hkv, g, d), k) * scale  # (B, hkv, g, L)
    pos = torch.arange(nblk * bs)
    valid = pos.unsqueeze(0) < meta.seq_lens.unsqueeze(1)  # (B, L)
    if meta.sliding_window is not None:
        valid &= pos.unsqueeze(0) >= (meta.seq_lens - meta.sliding_window).unsqueeze(1)
    scores.masked_fill_(~valid.view(B, 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(B, H, d)  # (B, H, d)
