"""The pure-torch attention of one sequence (kernels/paged_attention.py, and its soft-capped
variant in models/softcap_attention.py) against the formula in float64: GQA, a chunk that
attends to context before it, a sliding window, and soft-capped scores computed a block of
query rows at a time."""
from __future__ import annotations

import math

import pytest
import torch

from qserve.kernels import paged_attention
from qserve.models import softcap_attention


def _formula(q, k, v, scale, window=None, softcap=None):
    """q (n, H, d) the last n positions of k, v (L, Hkv, d), in float64 -> (n, H, d)."""
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
        out[:, h] = torch.softmax(s, -1) @ v[:, h // (H // hkv)]
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


@pytest.mark.parametrize("n,L,window", CASES)
def test_softcap_attend_in_blocks_of_rows_matches_the_formula(n, L, window, monkeypatch):
    """A small QUERY_BLOCK cuts every case into several passes, a last one partial."""
    g = torch.Generator().manual_seed(n * L)
    q = torch.randn(n, 8, 32, generator=g) * 4  # scores large enough for the cap to bite
    k, v = torch.randn(L, 2, 32, generator=g), torch.randn(L, 2, 32, generator=g)
    want = _formula(q, k, v, 32 ** -0.5, window, softcap=5.0)
    whole = softcap_attention._attend(q, k, v, 32 ** -0.5, 5.0, window)
    monkeypatch.setattr(softcap_attention, "QUERY_BLOCK", 16)
    blocked = softcap_attention._attend(q, k, v, 32 ** -0.5, 5.0, window)
    for got in (whole, blocked):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
