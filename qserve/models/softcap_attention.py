"""Paged attention with soft-capped scores (Gemma 2): scores -> cap * tanh(scores / cap)
before the mask and softmax. No fast kernel caps scores, so this is the pure-torch reference
(kernels/paged_attention.py) with the cap added, on every device. The kernels would need a
`softcap` argument (cpu_ops.paged_decode, the Triton decode and prefill kernels) for speed.
"""
from __future__ import annotations

import torch

from qserve.kernels.paged_attention import PagedAttentionMetadata, _gather, write_kv


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cache: dict[str, torch.Tensor], meta: PagedAttentionMetadata, scale: float,
                      softcap: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend, as dispatch.attention does.

    q (T, H, d), k and v (T, Hkv, d), packed as PagedAttentionMetadata describes.
    Returns (T, H, d) in q's dtype.
    """
    k, v = write_kv(k, v, cache, meta.slot_mapping)  # as the cache holds them
    out = torch.empty_like(q)
    start = 0
    for i, (qlen, slen) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        end = start + qlen
        if qlen == slen:  # a fresh prefill: its whole context is this step's
            ks, vs = k[start:end], v[start:end]
        else:
            ks = _gather(cache, "k", meta.block_tables[i], slen, q.dtype)
            vs = _gather(cache, "v", meta.block_tables[i], slen, q.dtype)
        out[start:end] = _attend(q[start:end], ks, vs, scale, softcap, meta.sliding_window)
        start = end
    return out


# Query rows a pass: the scores this attention materializes are (heads, rows, context) fp32,
# so a long prompt's are computed a block of rows at a time (engine/memory_plan.py counts one)
QUERY_BLOCK = 256


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
            window: int | None) -> torch.Tensor:
    """One sequence: q (n, H, d) are the last n positions of k, v (L, Hkv, d) -> (n, H, d),
    QUERY_BLOCK query rows at a time (each row's scores are its own)."""
    n, H, _ = q.shape
    L, hkv = k.shape[:2]
    g = H // hkv
    kh = k.transpose(0, 1).repeat_interleave(g, dim=0)  # (H, L, d): head h reads kv head h // g
    vh = v.transpose(0, 1).repeat_interleave(g, dim=0)
    kpos = torch.arange(L, device=q.device).unsqueeze(0)
    out = torch.empty_like(q)
    for r0 in range(0, n, QUERY_BLOCK):
        r1 = min(n, r0 + QUERY_BLOCK)
        qh = q[r0:r1].transpose(0, 1)  # (H, rows, d)
        scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # (H, rows, L)
        scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(L - n + r0, L - n + r1, device=q.device).unsqueeze(1)
        mask = kpos <= qpos  # (rows, L)
        if window is not None:
            mask &= kpos > qpos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        out[r0:r1] = torch.matmul(probs, vh).transpose(0, 1)  # (rows, H, d)
    return out
