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
    int4 (asymmetric): q = round((y - m) / s)      s = (hi - m) / L         m = lo
                       q in [0, L];  x ~ H (q s + m)

int4 KV spends 4 bits a value on average, unevenly: keys get 5-bit codes (L = 31), values 3-bit
(L = 7), because keys carry most of the error (scripts/kv_bits.py). The range [lo, hi] is
min y .. max y, or that range cut by 1/D at each end for the D of CLIP_DIVISORS whose codes
give the least squared error. Codes are packed in bit planes (pack()): a 5-bit code as a
4-bit plane and a 1-bit plane, a 3-bit one as a 2-bit and a 1-bit plane.

Bytes per (token, head) at head_dim 64: fp16 128, int8 64 + 2 = 66; int4 keys 40 + 2 + 2 = 44
and values 24 + 2 + 2 = 28, so K + V take 72 bytes against fp16's 256 (3.56x the tokens).

Measured with 4-bit keys and values, before the 5/3 split and the range cut
(scripts/kv_grouping.py, SmolLM2-135M, 512 tokens of the eval text): error of the attention
output relative to fp32 K/V, mean over layers; K+V bytes per (token, head):

    int4 per-token g64              72 B   0.242      int8 per-token             132 B  0.020
    int4 per-token g64, Hadamard    72 B   0.159      int8 per-token, Hadamard   132 B  0.010
    int4 per-channel keys (KIVI)    84 B   0.098      int8 per-channel keys      146 B  0.007

KIVI-style per-channel keys (a scale/offset per channel over a 16-token block, values per
token) measure better, but cannot be kept: their stats need the whole block, so a block being
filled token by token must sit in full precision outside the paged pool (what KIVI's residual
does), chunked prefill and recompute would quantize differently from one-token decode, and
at block size 16 the per-channel fp16 scales cost 16 B per token-head, 84 B in all: 3.0x
fp16, short of the 3.5x a 4-bit KV cache is for. Per-token with the rotation keeps 3.55x.
Eval (2048 tokens, context 1024), 4-bit keys and values: +15.7% PPL without the rotation,
+7.4% with it.
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


# int4 KV: 4 bits per element on average, split unevenly. Keys carry most of the error
# (scripts/kv_bits.py): at the same 72 bytes per token-head, 5-bit keys with 3-bit values
# cost far less perplexity than 4 and 4.
K_BITS, V_BITS = 5, 3
PACKED_BITS = {"k": K_BITS, "v": V_BITS}


def planes(bits: int) -> tuple[int, ...]:
    """Widths of the bit planes a `bits`-wide code is stored in, low bits first:
    5 -> (4, 1), 3 -> (2, 1), 4 -> (4,)."""
    assert 1 <= bits <= 7, bits
    return tuple(w for w in (4, 2, 1) if bits & w)


def packed_bytes(d: int, bits: int) -> int:
    """Bytes of one packed (token, head) vector of d codes; d % 8 == 0."""
    assert d % 8 == 0, f"packed KV needs a head_dim divisible by 8, got {d}"
    return d * bits // 8


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes q (..., d) uint8 < 2^bits -> (..., d * bits / 8) uint8: the planes of planes(bits)
    one after another; in a plane of width w, element e sits in byte e * w // 8 at bit
    e * w % 8 (so a 4-bit plane has element 2j in the low nibble of byte j)."""
    d = q.shape[-1]
    assert d % 8 == 0, f"packed KV needs a head_dim divisible by 8, got {d}"
    out, shift = [], 0
    for w in planes(bits):
        field = ((q >> shift) & (2 ** w - 1)).view(*q.shape[:-1], d * w // 8, 8 // w)
        out.append(sum(field[..., i] << (i * w) for i in range(8 // w)).to(torch.uint8))
        shift += w
    return torch.cat(out, -1)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """pack()'s inverse: (..., d * bits / 8) uint8 -> codes (..., d) uint8."""
    d = packed.shape[-1] * 8 // bits
    q, start, shift = 0, 0, 0
    for w in planes(bits):
        plane = packed[..., start:start + d * w // 8]
        fields = [(plane >> (i * w)) & (2 ** w - 1) for i in range(8 // w)]
        q = q + (torch.stack(fields, -1).flatten(-2) << shift)
        start += d * w // 8
        shift += w
    return q


# Range cuts tried for each packed vector: 1/D of the range off each end (0: none, plain
# min-max). The one with the least squared error is stored: clipping a few extremes buys a
# finer step for all the rest (5-bit keys and 3-bit values, 12 windows of the eval text:
# +4.8% -> +3.9% PPL).
# Divisions, not products, so no implementation can fuse them into an FMA and round otherwise.
CLIP_DIVISORS = (0, 40, 20, 14, 10, 8, 7)


def quantize_packed(x: torch.Tensor, bits: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., d) float, d % 8 == 0 -> packed codes (..., d * bits / 8) uint8, scale (...)
    fp16, offset (...) fp16: q = round((x - m) / s) in [0, 2^bits - 1], for the range
    [m, m + (2^bits - 1) s] of CLIP_DIVISORS that gives the least squared error (summed in
    fp64, where each residual is exact, so every implementation picks the same one)."""
    levels = 2 ** bits - 1
    xf = x.float()
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    best = None
    for div in CLIP_DIVISORS:
        cut = (hi - lo) / div if div else torch.zeros_like(lo)
        offset = (lo + cut).to(SCALE_DTYPE).float()
        # the range is measured from the rounded offset, so the top code reaches its end
        scale = ((hi - cut - offset) / levels).clamp_min(_TINY).to(SCALE_DTYPE).float()
        q = torch.round((xf - offset) / scale).clamp_(0, levels)
        err = (q.double() * scale.double() + offset.double() - xf.double()).square().sum(-1, True)
        if best is None:
            best = (q, scale, offset, err)
        else:
            better = err < best[3]
            best = tuple(torch.where(better, a, b) for a, b in zip((q, scale, offset, err), best))
    q, scale, offset, _ = best
    return (pack(q.to(torch.uint8), bits), scale.squeeze(-1).to(SCALE_DTYPE),
            offset.squeeze(-1).to(SCALE_DTYPE))


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                      bits: int, dtype: torch.dtype) -> torch.Tensor:
    """packed (..., d * bits / 8) uint8, scale (...), offset (...) -> (..., d) `dtype`."""
    q = unpack(packed, bits)
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


def quantize(x: torch.Tensor, values_dtype: torch.dtype, which: str) -> tuple[torch.Tensor, ...]:
    """x (..., d) keys (which "k") or values ("v") -> (values, *companions) in the order of
    kv_parts(values_dtype); int8 and int4 quantize H x."""
    if values_dtype == torch.int8:
        return quantize_int8(hadamard_transform(x))
    if values_dtype == torch.uint8:
        return quantize_packed(hadamard_transform(x), PACKED_BITS[which])
    return (x.to(values_dtype),)


def dequantize(parts: tuple[torch.Tensor, ...], dtype: torch.dtype, which: str) -> torch.Tensor:
    """(values, *companions) as quantize() returns or the cache stores them -> (..., d)."""
    values = parts[0]
    if values.dtype == torch.int8:
        y = dequantize_int8(values, parts[1], torch.float32)
    elif values.dtype == torch.uint8:
        y = dequantize_packed(values, parts[1], parts[2], PACKED_BITS[which], torch.float32)
    else:
        return values.to(dtype)
    return hadamard_transform(y).to(dtype)
