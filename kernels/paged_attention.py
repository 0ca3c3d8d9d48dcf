"""Paged attention and KV-cache writes, pure torch (the reference the fast kernels test against).

Cache layout, per layer: a dict of named tensors that share their two leading dimensions.

    cache["k"][block, offset, kv_head, :]   (num_blocks, block_size, num_kv_heads, head_dim)
    slot = block * block_size + offset      (the flat index a token's K/V is written to)

With quantized KV (kernels/kv_quant.py) the values are int8, or for int4 KV packed 4-bit
codes on average (head_dim / 2 bytes); each (slot, kv_head) has its scale (and for int4
values an offset) beside them in the same slot:

    cache["k_scale"][block, offset, kv_head]   (num_blocks, block_size, num_kv_heads) fp16
    cache["v_offset"][block, offset, kv_head]  int4 values only; likewise "v", "v_scale"

int4 keys are read through their layer's codebook, three (num_kv_heads, head_dim) tensors
in the same dict that are per layer, not per block (kv_quant.CODEBOOK).

Attention dequantizes only the context it gathers, into the query's dtype.

A step's tokens are packed flat, with no padding: sequence i owns query rows
query_start_loc[i] : query_start_loc[i + 1], which are its last `query_len` positions out of
`seq_len` (everything before them is already in the cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qserve.kernels.kv_quant import dequantize, kv_parts, quantize


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


def _names(cache: dict[str, torch.Tensor], which: str) -> tuple[str, ...]:
    """"k" -> ("k", "k_scale", ...): the tensors that together hold K (or V)."""
    return (which,) + tuple(f"{which}_{p}" for p in kv_parts(cache[which].dtype, which))


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: dict[str, torch.Tensor],
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter new K/V (quantized, if the cache is) into their slots.

    k, v: (T, num_kv_heads, head_dim); slot_mapping: (T,).
    Returns:
        k, v (T, num_kv_heads, head_dim) in k's dtype, exactly as attention will read them
        back from the cache, so a fresh prefill attending to these sees the same values a
        later chunk or decode step gathers.
    """
    out = []
    for which, x in (("k", k), ("v", v)):
        parts = quantize(x, cache[which].dtype, which, cache)
        for name, part in zip(_names(cache, which), parts):
            t = cache[name]
            t.view(-1, *t.shape[2:]).index_copy_(0, slot_mapping, part)
        out.append(dequantize(parts, x.dtype, which, cache))
    return out[0], out[1]


def _gather(cache: dict[str, torch.Tensor], which: str, block_table: torch.Tensor, length: int,
            dtype: torch.dtype) -> torch.Tensor:
    """(n,) block ids -> (length, hkv, d) contiguous, dequantized context of K or V."""
    ids = block_table[: -(-length // cache[which].shape[1])]
    parts = tuple(cache[name][ids].flatten(0, 1)[:length] for name in _names(cache, which))
    return dequantize(parts, dtype, which, cache)


def paged_attention(q: torch.Tensor, cache: dict[str, torch.Tensor],
                    meta: PagedAttentionMetadata, scale: float,
                    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Causal attention of packed queries against each sequence's cached context.

    q: (T, num_heads, head_dim). The cache already holds this step's K/V. `k_new`/`v_new`
    (T, num_kv_heads, head_dim), as write_kv returns them, let a sequence whose whole context
    is new this step (a fresh prefill) skip the gather. `softcap`: scores -> softcap *
    tanh(scores / softcap) before the mask (Gemma 2). `sinks` (num_heads,): each head's sink
    logit, one more term of every softmax with a zero value (gpt-oss). Returns (T, num_heads,
    head_dim).
    """
    if meta.decode_only:
        return _decode_attention(q, cache, meta, scale, softcap, sinks)
    _check_devices(q, cache, meta)
    out = torch.empty_like(q)
    e = 0
    for i, (qlen, slen) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        s, e = e, e + qlen  # query_start_loc[i : i + 2], from the host copy (no sync)
        if qlen == slen and k_new is not None:
            k, v = k_new[s:e], v_new[s:e]
        else:
            k = _gather(cache, "k", meta.block_tables[i], slen, q.dtype)
            v = _gather(cache, "v", meta.block_tables[i], slen, q.dtype)
        if softcap is None and sinks is None:
            out[s:e] = _attend(q[s:e], k, v, scale, meta.sliding_window)
        elif softcap is None and q.device.type == "cpu" and _FLASH_CPU is not None:
            out[s:e] = _attend_sinks(q[s:e], k, v, scale, meta.sliding_window, sinks)
        else:
            out[s:e] = _attend_scored(q[s:e], k, v, scale, meta.sliding_window, softcap, sinks)
    return out


def _check_devices(q: torch.Tensor, cache: dict[str, torch.Tensor],
                   meta: PagedAttentionMetadata) -> None:
    """Every tensor on q's device: torch would compare a CPU index with a CUDA one only to
    fail later, inside an op, with a less helpful message."""
    for name, t in (*cache.items(), ("slot_mapping", meta.slot_mapping),
                    ("query_start_loc", meta.query_start_loc), ("seq_lens", meta.seq_lens),
                    ("block_tables", meta.block_tables)):
        assert t.device == q.device, (name, t.device, q.device)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            window: int | None) -> torch.Tensor:
    """One sequence: q (n, H, d) are the last n positions of k, v (L, Hkv, d).

    The tensors go to SDPA with a batch dimension: on a CPU, torch takes its flash kernel
    only for 4-D inputs, and on 3-D ones its math path, which materializes fp32 scores and
    probabilities (heads x n x L: ~1 GiB at 2,000 tokens and 32 heads) and ran 5x slower at
    1,000 tokens."""
    n, L = q.shape[0], k.shape[0]
    # (1, heads, len, d)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    mask = None
    if window is not None or (n != L and n > 1):
        qpos = torch.arange(L - n, L, device=q.device).unsqueeze(1)
        kpos = torch.arange(L, device=q.device).unsqueeze(0)
        mask = kpos <= qpos  # (n, L)
        if window is not None:
            mask &= kpos > qpos - window
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=mask is None and n > 1, scale=scale,
        enable_gqa=True)
    return out[0].transpose(0, 1)


# torch's CPU flash attention, which returns each row's log-sum-exp beside its output
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """_attend with sinks (H,), on a CPU, in torch's flash kernel (no scores materialized):
    a row's softmax over its context sums to Z = exp(lse); a sink is one more term with a zero
    value, so the output is out * Z / (Z + exp(sink)) = out * sigmoid(lse - sink)."""
    n, H, d = q.shape
    L, hkv = k.shape[:2]
    g = H // hkv
    qh = q.transpose(0, 1).reshape(hkv, g, n, d)  # a batch entry per kv head: its g heads
    kh = k.transpose(0, 1).unsqueeze(1).expand(hkv, g, L, d)  # (views, no copies)
    vh = v.transpose(0, 1).unsqueeze(1).expand(hkv, g, L, d)
    mask = None
    if window is not None or (n != L and n > 1):
        qpos = torch.arange(L - n, L).unsqueeze(1)
        kpos = torch.arange(L).unsqueeze(0)
        keep = kpos <= qpos  # (n, L)
        if window is not None:
            keep &= kpos > qpos - window
        mask = torch.zeros(n, L, dtype=q.dtype).masked_fill_(~keep, float("-inf"))
    out, lse = _FLASH_CPU(qh, kh, vh, 0.0, mask is None and n > 1, attn_mask=mask,
                          scale=scale)  # (hkv, g, n, d), (hkv, g, n) fp32
    share = torch.sigmoid(lse - sinks.float().view(hkv, g, 1)).unsqueeze(-1)
    return (out * share.to(out.dtype)).reshape(H, n, d).transpose(0, 1)


# Query rows a pass of _attend_scored: the scores it materializes are (heads, rows, context)
# fp32, so a long prompt's are computed a block of rows at a time (engine/memory_plan.py
# counts one)
QUERY_BLOCK = 256


def _attend_scored(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   window: int | None, softcap: float | None, sinks: torch.Tensor | None
                   ) -> torch.Tensor:
    """_attend with what SDPA cannot do, soft-capped scores (and sinks, off a CPU): the scores
    computed explicitly, QUERY_BLOCK query rows at a time (each row's scores are its own)."""
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
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(L - n + r0, L - n + r1, device=q.device).unsqueeze(1)
        mask = kpos <= qpos  # (rows, L)
        if window is not None:
            mask &= kpos > qpos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = _softmax(scores, sinks).to(v.dtype)
        out[r0:r1] = torch.matmul(probs, vh).transpose(0, 1)  # (rows, H, d)
    return out


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """fp32 softmax over the last dim of scores (H, ..., L); with sinks (H,), each head's sink
    joins its denominator and is dropped: exp(s) / (exp(sink) + sum exp(s))."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    sink = sinks.float().view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)[..., :-1]


def _decode_attention(q: torch.Tensor, cache: dict[str, torch.Tensor],
                      meta: PagedAttentionMetadata, scale: float,
                      softcap: float | None = None, sinks: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """One query per sequence, batched: gather every context padded to the longest, mask."""
    _check_devices(q, cache, meta)
    B, H, d = q.shape
    bs, hkv = cache["k"].shape[1:3]
    g = H // hkv
    nblk = -(-meta.max_seq_len // bs)
    tables = meta.block_tables[:, :nblk]

    def gather(which: str) -> torch.Tensor:  # (B, nblk * bs, hkv, d), dequantized
        return dequantize(tuple(cache[n][tables].flatten(1, 2) for n in _names(cache, which)),
                          q.dtype, which, cache)

    k = gather("k").permute(0, 2, 3, 1)  # (B, hkv, d, L)
    v = gather("v").transpose(1, 2)  # (B, hkv, L, d)
    scores = torch.matmul(q.view(B, hkv, g, d), k) * scale  # (B, hkv, g, L)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(nblk * bs, device=q.device)
    valid = pos.unsqueeze(0) < meta.seq_lens.unsqueeze(1)  # (B, L)
    if meta.sliding_window is not None:
        valid &= pos.unsqueeze(0) >= (meta.seq_lens - meta.sliding_window).unsqueeze(1)
    scores.masked_fill_(~valid.view(B, 1, 1, -1), float("-inf"))
    # heads first for _softmax: (H, B, L), query head h = kv head h // g, h % g
    heads = scores.view(B, H, -1).transpose(0, 1)
    probs = _softmax(heads, sinks).transpose(0, 1).view(scores.shape).to(v.dtype)
    return torch.matmul(probs, v).reshape(B, H, d)  # (B, H, d)
