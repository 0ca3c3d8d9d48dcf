"""Quantized KV cache: quantize a token's K or V when it is written, dequantize what attention
gathers. Pure torch; this is the reference any fused kernel is tested against.

Grouping is per (token, kv head): each head's head_dim vector gets its own fp16 scale (and,
for int4, an fp16 offset). A token's values and scales therefore live in the same slot, so
paging, copy-on-write, swap and prefix sharing move them together with no extra bookkeeping,
and a token's quantized form does not depend on any other token (batch-, chunking- and
recompute-invariant). Before quantizing, each vector is rotated by an orthonormal Hadamard
matrix H (QuaRot-style; H = H^T = H^-1), which spreads Llama keys' few outlier channels over
all of them, and rotated back after dequantizing:

    int8 (symmetric):  q = round(y / s)            s = max|y| / 127         y = H x
    int4 (asymmetric): q = round((y - m) / s)      s = (max y - m) / 15     m = min y
                       q in [0, 15];  x ~ H (q s + m)

int4 packs two values per byte, element 2j in the low nibble and 2j + 1 in the high one:

    y[..., 0] y[..., 1] | y[..., 2] y[..., 3] | ...    (head_dim values)
    byte 0: hi=q1 lo=q0 | byte 1: hi=q3 lo=q2 | ...    (head_dim / 2 bytes)

Bytes per (token, head) at head_dim 64: fp16 128, int8 64 + 2 = 66, int4 32 + 2 + 2 = 36.

Measured (scripts/kv_grouping.py, SmolLM2-135M, 512 tokens of the eval text): error of the
attention output relative to fp32 K/V, mean over layers; K+V bytes per (token, head):

    int4 per-token g64              72 B   0.242      int8 per-token             132 B  0.020
    int4 per-token g64, Hadamard    72 B   0.159      int8 per-token, Hadamard   132 B  0.010
    int4 per-channel keys (KIVI)    84 B   0.098      int8 per-channel keys      146 B  0.007

KIVI-style per-channel keys (a scale/offset per channel over a 16-token block, values per
token) measure better, but cannot be kept: their stats need the whole block, so a block being
filled token by token must sit in full precision outside the paged pool (what KIVI's residual
does), chunked prefill and recompute would quantize differently from one-token decode, and
at block size 16 the per-channel fp16 scales cost 16 B per token-head, 84 B in all: 3.0x
fp16, short of the 3.5x a 4-bit KV cache is for. Per-token with the rotation keeps 3.55x.
Eval (2048 tokens, context 1024): int4 +15.7% PPL without the rotation, +7.4% with it.
"""
from __future__ import annotations

import functools

import torch

SCALE_DTYPE = torch.float16
_TINY = 2.0 ** -14  # smallest normal fp16: a constant vector still gets a usable scale


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d) float -> values (..., d) int8, scale (...) fp16."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / 127).clamp_min(_TINY).to(SCALE_DTYPE)
    # quantize against the stored (rounded) scale, so the error bound holds for what is read
    q = torch.round(xf / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (..., d) int8, scale (...) -> (..., d) `dtype`."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., d) float, d even -> packed (..., d / 2) uint8, scale (...) fp16,
    offset (...) fp16."""
    assert x.shape[-1] % 2 == 0, f"int4 KV needs an even head_dim, got {x.shape[-1]}"
    xf = x.float()
    lo, hi = xf.amin(-1), xf.amax(-1)
    offset = lo.to(SCALE_DTYPE)
    # the range is measured from the rounded offset, so q = 15 still reaches max x
    scale = ((hi - offset.float()) / 15).clamp_min(_TINY).to(SCALE_DTYPE)
    q = torch.round((xf - offset.float().unsqueeze(-1)) / scale.float().unsqueeze(-1))
    q = q.clamp_(0, 15).to(torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, scale, offset


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """packed (..., d / 2) uint8, scale (...), offset (...) -> (..., d) `dtype`."""
    q = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)  # (..., d)
    return (q.float() * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)).to(dtype)


@functools.lru_cache(maxsize=None)
def hadamard(d: int, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """(d, d) fp32 orthonormal, symmetric Hadamard matrix; for a d that is not a power of two,
    block-diagonal with the largest power-of-two block that divides d."""
    n = d & -d  # largest power of two dividing d
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h / n ** 0.5] * (d // n)).to(device)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> (..., d) fp32 x @ hadamard(d), as butterflies (fast Walsh-Hadamard): only
    elementwise adds, so a row's result never depends on how many rows come with it (a matmul's
    can, through its blocking), which keeps quantized KV batch-invariant."""
    d = x.shape[-1]
    n = d & -d
    blocks = (*x.shape[:-1], d // n)
    y = x.float()
    h = 1
    while h < n:  # y[j], y[j + h] -> y[j] + y[j + h], y[j] - y[j + h] within blocks of 2h
        y = y.reshape(*blocks, n // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(x.shape) * n ** -0.5


# ---- the cache's view: one K or V tensor of a layer, plus its named companions ---------------
def kv_parts(values_dtype: torch.dtype) -> tuple[str, ...]:
    """Names of the companion tensors a K or V cache of this storage dtype carries."""
    if values_dtype == torch.int8:
        return ("scale",)
    if values_dtype == torch.uint8:
        return ("scale", "offset")
    return ()


def quantize(x: torch.Tensor, values_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x (..., d) -> (values, *companions) in the order of kv_parts(values_dtype); int8 and
    int4 quantize H x."""
    if values_dtype == torch.int8:
        return quantize_int8(hadamard_transform(x))
    if values_dtype == torch.uint8:
        return quantize_int4(hadamard_transform(x))
    return (x.to(values_dtype),)


def dequantize(parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """(values, *companions) as quantize() returns or the cache stores them -> (..., d)."""
    values = parts[0]
    if values.dtype == torch.int8:
        y = dequantize_int8(values, parts[1], torch.float32)
    elif values.dtype == torch.uint8:
        y = dequantize_int4(values, parts[1], parts[2], torch.float32)
    else:
        return values.to(dtype)
    return hadamard_transform(y).to(dtype)
