"""Quantized KV cache: quantize a token's K or V when it is written, dequantize what attention
gathers. Pure torch; this is the reference any fused kernel is tested against.

Grouping is per (token, kv head): each head's head_dim vector gets its own fp16 scale (and
an fp16 offset for int4 values). A token's codes and scales therefore live in the same slot,
so paging, copy-on-write, swap and prefix sharing move them together with no extra
bookkeeping, and a token's quantized form does not depend on any other token (batch-,
chunking- and recompute-invariant). int8 K/V and int4 V are first rotated by an orthonormal
Hadamard matrix H (QuaRot-style; H = H^T = H^-1), which spreads a vector's few outlier
channels over all of them, and rotated back after dequantizing:

    int8 (symmetric):  q = round(y / s)            s = max|y| / 127         y = H x
    int4 (asymmetric): q = round((y - m) / s)      s = (hi - m) / 15        m = lo
                       q in [0, 15];  x ~ H (q s + m)

For int4 values the range [lo, hi] is min y .. max y, or that range cut by 1/D at each end
for the D of CLIP_DIVISORS whose codes give the least squared error; codes are packed two a
byte (pack()). int4 keys are not rotated: each channel gets its own calibrated width, 4 bits
on average, and one fp16 range per token ("int4 keys" below), because keys carry most of
the error and their channels matter unequally (scripts/kv_bits.py, 12 windows of the eval
text: +3.95% PPL for 5-bit rotated keys and 3-bit values, +2.1% for allocated 4-bit keys and
4-bit values).

Bytes per (token, head) at head_dim 64: fp16 128, int8 64 + 2 = 66; int4 keys 32 + 2 and
values 32 + 2 + 2, so K + V take 70 bytes against fp16's 256 (3.66x the tokens).

Measured with rotated 4-bit keys and values, before the range cut and the keys' codebook
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
+7.4% with it. The keys' codebook keeps KIVI's point, that key channels differ, but makes it
static: calibrated once per model, so a token's codes still depend on that token alone.
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


# int4 KV: 4 bits a value. Values: rotated, asymmetric 4-bit codes with a range cut
# (quantize_packed). Keys: calibrated per-channel widths (quantize_keys), 4 bits on average.
KEY_BITS = VALUE_BITS = 4
MAX_KEY_WIDTH = 8


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
# finer step for all the rest (with 5-bit keys and 3-bit values, 12 windows of the eval
# text: +4.8% -> +3.9% PPL).
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


# ---- int4 keys: calibrated per-channel widths ----------------------------------------------
# A key channel's share of the q . k error is its energy times that of the queries reading
# it, and on Llama keys that varies by orders of magnitude across channels (RoPE's slow
# pairs carry most of it; qserve/engine/kv_codebook.py). So each (layer, kv head) has a
# calibrated codebook: per channel j an RMS sigma_j and a width b_j in 0..MAX_KEY_WIDTH,
# KEY_BITS on average. A key x is stored as one fp16 t and the codes
#
#     z_j = x_j / sigma_j      t = fp16(max |z_j| over coded channels)    step_j = t / 2^(b_j - 1)
#     q_j = floor((z_j + t) / step_j)  in [0, 2^b_j - 1]     x_j ~ sigma_j ((q_j + 1/2) step_j - t)
#
# (2^b_j midrise levels over +-t sigma_j; b_j = 0 stores nothing and reads 0). The codes are
# a bit stream: channel j's b_j bits start at bit start_j = b_0 + ... + b_(j-1), low bit
# first, bit p of the vector being bit p % 8 of byte p // 8. A codebook is three per-layer
# tensors in a layer's cache dict, beside the per-block ones:
#
#     cache["k_sigma"]   (num_kv_heads, head_dim) fp32
#     cache["k_width"]   (num_kv_heads, head_dim) int32, each head's widths sum to KEY_BITS d
#     cache["k_start"]   (num_kv_heads, head_dim) int32, exclusive prefix sums of k_width
CODEBOOK = ("k_sigma", "k_width", "k_start")


def key_codebook(sigma: torch.Tensor, width: torch.Tensor) -> dict[str, torch.Tensor]:
    """sigma, width (..., hkv, d) -> the codebook tensors of CODEBOOK (with the same leading
    dimensions)."""
    width = width.to(torch.int32)
    assert sigma.shape == width.shape and bool((sigma > 0).all()), "sigma must be positive"
    assert bool(((width >= 0) & (width <= MAX_KEY_WIDTH)).all()), "widths outside 0..8"
    assert bool((width.sum(-1) == KEY_BITS * width.shape[-1]).all()), "widths must sum to 4 d"
    start = (width.cumsum(-1) - width).to(torch.int32)
    return {"k_sigma": sigma.float().contiguous(), "k_width": width.contiguous(),
            "k_start": start.contiguous()}


def uniform_key_codebook(num_kv_heads: int, d: int, device: torch.device | str = "cpu"
                         ) -> dict[str, torch.Tensor]:
    """KEY_BITS on every channel over +-t (sigma 1): the codebook of an uncalibrated cache."""
    shape = (num_kv_heads, d)
    return key_codebook(torch.ones(shape, device=device),
                        torch.full(shape, KEY_BITS, dtype=torch.int32, device=device))


def _bit_positions(width: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """(hkv, d) -> (hkv, d * MAX_KEY_WIDTH) int64: where bit i of channel j's code goes,
    start_j + i, or the dump position KEY_BITS d past the end for i >= b_j."""
    i = torch.arange(MAX_KEY_WIDTH, device=width.device)
    pos = start.long().unsqueeze(-1) + i
    pos = torch.where(i < width.unsqueeze(-1), pos, KEY_BITS * width.shape[-1])
    return pos.flatten(-2)


def pack_keys(q: torch.Tensor, width: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Codes q (..., hkv, d) < 2^width -> (..., hkv, KEY_BITS d / 8) uint8, the bit stream."""
    *lead, hkv, d = q.shape
    nbits = KEY_BITS * d
    bit = (q.long().unsqueeze(-1) >> torch.arange(MAX_KEY_WIDTH, device=q.device)) & 1
    pos = _bit_positions(width, start).expand(*lead, hkv, d * MAX_KEY_WIDTH)
    stream = torch.zeros(*lead, hkv, nbits + 1, dtype=torch.long, device=q.device)
    stream.scatter_(-1, pos, bit.flatten(-2))  # every real position once; the dump many times
    byte = stream[..., :nbits].unflatten(-1, (nbits // 8, 8))
    return (byte << torch.arange(8, device=q.device)).sum(-1).to(torch.uint8)


def unpack_keys(packed: torch.Tensor, width: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """pack_keys()'s inverse: (..., hkv, KEY_BITS d / 8) uint8 -> codes (..., hkv, d) int64."""
    *lead, hkv, nbytes = packed.shape
    d = width.shape[-1]
    stream = (packed.long().unsqueeze(-1) >> torch.arange(8, device=packed.device)) & 1
    stream = torch.cat([stream.flatten(-2), stream.new_zeros(*lead, hkv, 1)], -1)
    pos = _bit_positions(width, start).expand(*lead, hkv, d * MAX_KEY_WIDTH)
    bit = stream.gather(-1, pos).unflatten(-1, (d, MAX_KEY_WIDTH))
    return (bit << torch.arange(MAX_KEY_WIDTH, device=packed.device)).sum(-1)


def quantize_keys(x: torch.Tensor, k_sigma: torch.Tensor, k_width: torch.Tensor,
                  k_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., hkv, d) float -> packed codes (..., hkv, KEY_BITS d / 8) uint8, t (..., hkv)
    fp16, with the codebook of (hkv, d) tensors. Every step is one IEEE operation (divisions,
    no products to fuse), so the C and Triton writes store the same bits."""
    z = x.float() / k_sigma
    coded = k_width > 0
    t = torch.where(coded, z.abs(), 0.0).amax(-1, keepdim=True)
    t = t.clamp(_TINY, 65504.0).to(SCALE_DTYPE).float()  # 65504: the largest fp16
    half = torch.exp2(k_width.float() - 1)  # 2^(b - 1); powers of two, so t / half is exact
    levels = torch.where(coded, 2 * half - 1, 0.0)
    q = torch.floor((z + t) / (t / half)).clamp_(min=0)
    q = torch.minimum(q, levels)
    return pack_keys(q.long(), k_width, k_start), t.squeeze(-1).to(SCALE_DTYPE)


def dequantize_keys(packed: torch.Tensor, t: torch.Tensor, k_sigma: torch.Tensor,
                    k_width: torch.Tensor, k_start: torch.Tensor) -> torch.Tensor:
    """quantize_keys()'s output -> keys (..., hkv, d) fp32."""
    q = unpack_keys(packed, k_width, k_start).float()
    t = t.float().unsqueeze(-1)
    step = t / torch.exp2(k_width.float() - 1)
    z = torch.where(k_width > 0, (q + 0.5) * step - t, 0.0)
    return z * k_sigma


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
def kv_parts(values_dtype: torch.dtype, which: str) -> tuple[str, ...]:
    """Names of the per-slot companion tensors a K ("k") or V ("v") cache of this storage
    dtype carries."""
    if values_dtype == torch.int8:
        return ("scale",)
    if values_dtype == torch.uint8:
        return ("scale",) if which == "k" else ("scale", "offset")
    return ()


def quantize(x: torch.Tensor, values_dtype: torch.dtype, which: str,
             codebook: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """x (..., hkv, d) keys (which "k") or values ("v") -> (values, *companions) in the order
    of kv_parts(values_dtype, which). int8 quantizes H x; int4 values H x, int4 keys x with
    the layer's codebook (the CODEBOOK tensors of its cache dict)."""
    if values_dtype == torch.int8:
        return quantize_int8(hadamard_transform(x))
    if values_dtype == torch.uint8:
        if which == "k":
            return quantize_keys(x, *(codebook[n] for n in CODEBOOK))
        return quantize_packed(hadamard_transform(x), VALUE_BITS)
    return (x.to(values_dtype),)


def dequantize(parts: tuple[torch.Tensor, ...], dtype: torch.dtype, which: str,
               codebook: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """(values, *companions) as quantize() returns or the cache stores them -> (..., hkv, d)."""
    values = parts[0]
    if values.dtype == torch.int8:
        y = dequantize_int8(values, parts[1], torch.float32)
    elif values.dtype == torch.uint8 and which == "k":
        return dequantize_keys(*parts, *(codebook[n] for n in CODEBOOK)).to(dtype)
    elif values.dtype == torch.uint8:
        y = dequantize_packed(values, parts[1], parts[2], VALUE_BITS, torch.float32)
    else:
        return values.to(dtype)
    return hadamard_transform(y).to(dtype)
