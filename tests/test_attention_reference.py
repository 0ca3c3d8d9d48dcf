"""The pure-torch attention of one sequence (kernels/paged_attention.py, and its variant with
explicit scores for soft-capping and sinks) against the formula in float64: GQA, a chunk that
attends to context before it, a sliding window, soft-capped scores and sinks computed a block
of query rows at a time; and the batched decode reference with sinks."""
from __future__ import annotations

import math

import pytest
import torch

from qserve.kernels import paged_attention


def _formula(q, k, v, scale, window=None, softcap=None, sinks=None):
    """q (n, H, d) the last n positions of k, v (L, Hkv, d), in float64 -> (n, H, d); a sink
    is one more score, whose value is zero."""
    n, H, _ = q.shape
    L, hkv = k.shape[:2]
    q, k, v = q.double(), k.double(), v.double()
    out = torch.empty(n, H, q.shape[2], dtype=torch.float64)
    for h in range(H):
        s = q[:, h] @ k[:, h // (H // hkv)].T * scale  # (n, L)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(L - n, L).unsqueeze(1)
        kpos = torch.arange(L).unsqueeze(0)
        keep = kpos <= qpos
        if window is not None:
            keep &= kpos > qpos - window
        s = s.masked_fill(~keep, -math.inf)
        if sinks is not None:
            s = torch.cat([s, torch.full((n, 1), float(sinks[h]), dtype=s.dtype)], dim=1)
        p = torch.softmax(s, -1)[:, :L]
        out[:, h] = p @ v[:, h // (H // hkv)]
    return out


CASES = [(37, 37, None), (37, 100, None), (300, 300, None), (40, 300, 64)]  # (n, L, window)


@pytest.mark.parametrize("n,L,window", CASES)
def test_attend_matches_the_formula(n, L, window):
    g = torch.Generator().manual_seed(n + L)
    q = torch.randn(n, 8, 32, generator=g)
    k, v = torch.randn(L, 2, 32, generator=g), torch.randn(L, 2, 32, generator=g)
    got = paged_attention._attend(q, k, v, 32 ** -0.5, window)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), _formula(q, k, v, 32 ** -0.5, window),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap, sinks", [(5.0, False), (None, True), (5.0, True)])
@pytest.mark.parametrize("n,L,window", CASES)
def test_scored_attend_in_blocks_of_rows_matches_the_formula(n, L, window, softcap, sinks,
                                                             monkeypatch):
    """A small QUERY_BLOCK cuts every case into several passes, a last one partial."""
    g = torch.Generator().manual_seed(n * L)
    q = torch.randn(n, 8, 32, generator=g) * 4  # scores large enough for the cap to bite
    k, v = torch.randn(L, 2, 32, generator=g), torch.randn(L, 2, 32, generator=g)
    # sinks around the scores' own range, so they take a visible share of each softmax
    s = torch.randn(8, generator=g) * 3 if sinks else None
    want = _formula(q, k, v, 32 ** -0.5, window, softcap=softcap, sinks=s)
    whole = paged_attention._attend_scored(q, k, v, 32 ** -0.5, window, softcap, s)
    monkeypatch.setattr(paged_attention, "QUERY_BLOCK", 16)
    blocked = paged_attention._attend_scored(q, k, v, 32 ** -0.5, window, softcap, s)
    for got in (whole, blocked):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,L,window", CASES + [(1, 50, None), (1, 50, 8)])
def test_sinks_in_the_cpu_flash_kernel_match_the_formula(n, L, window, dtype):
    """The CPU path for sinks: torch's flash kernel's log-sum-exp gives each row's share
    sigmoid(lse - sink), no scores materialized (GQA 8/2: a batch entry per kv head)."""
    g = torch.Generator().manual_seed(n + 3 * L)
    q = torch.randn(n, 8, 32, generator=g) * 2
    k, v = torch.randn(L, 2, 32, generator=g), torch.randn(L, 2, 32, generator=g)
    sinks = torch.randn(8, generator=g) * 3
    want = _formula(q, k, v, 32 ** -0.5, window, sinks=sinks)
    got = paged_attention._attend_sinks(q.to(dtype), k.to(dtype), v.to(dtype), 32 ** -0.5,
                                        window, sinks)
    assert got.shape == q.shape and got.dtype == dtype
    # bf16 inputs: their own rounding (2^-8 relative) through an O(1) weighted mean
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def _paged(contexts, hkv, d, block_size, generator):
    """An fp32 cache holding each context (L_i, hkv, d) K/V in shuffled blocks, and the
    decode metadata of one query per context: (cache, meta)."""
    from qserve.kernels.paged_attention import PagedAttentionMetadata

    nblocks = [-(-len(k) // block_size) for k, _ in contexts]
    ids = torch.randperm(sum(nblocks) + 1, generator=generator)[1:]  # block 0 unused
    cache = {w: torch.zeros(sum(nblocks) + 1, block_size, hkv, d) for w in "kv"}
    tables = torch.zeros(len(contexts), max(nblocks), dtype=torch.int64)
    start = 0
    for i, ((k, v), nb) in enumerate(zip(contexts, nblocks)):
        tables[i, :nb] = ids[start:start + nb]
        start += nb
        for pos in range(len(k)):
            blk, off = tables[i, pos // block_size], pos % block_size
            cache["k"][blk, off], cache["v"][blk, off] = k[pos], v[pos]
    lens = [len(k) for k, _ in contexts]
    meta = PagedAttentionMetadata(
        slot_mapping=torch.zeros(len(contexts), dtype=torch.int64),
        query_start_loc=torch.arange(len(contexts) + 1), seq_lens=torch.tensor(lens),
        block_tables=tables, query_lens_list=[1] * len(contexts), seq_lens_list=lens,
        max_seq_len=max(lens), decode_only=True)
    return cache, meta


@pytest.mark.parametrize("window", [None, 16])
def test_decode_reference_with_sinks_matches_the_formula(window):
    """Three sequences of different lengths (one shorter than the window), GQA 8/2; each
    query is the last position of its context."""
    g = torch.Generator().manual_seed(7)
    contexts = [(torch.randn(L, 2, 32, generator=g), torch.randn(L, 2, 32, generator=g))
                for L in (5, 40, 77)]
    cache, meta = _paged(contexts, 2, 32, 8, g)
    meta.sliding_window = window
    q = torch.randn(3, 8, 32, generator=g) * 2
    sinks = torch.randn(8, generator=g) * 3
    got = paged_attention._decode_attention(q, cache, meta, 32 ** -0.5, sinks=sinks)
    for i, (k, v) in enumerate(contexts):
        want = _formula(q[i:i + 1], k, v, 32 ** -0.5, window, sinks=sinks)[0]
        torch.testing.assert_close(got[i].double(), want, rtol=1e-5, atol=1e-5)
