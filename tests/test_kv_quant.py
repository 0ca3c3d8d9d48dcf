"""Quantized KV cache: quantize/dequantize bounds, packing, the paged write/attend path with
int8 and int4 (keys coded per channel by a codebook, rotated 4-bit values) blocks against
attention over the dequantized values, block moves, and the byte accounting behind
`qserve info` (int4 holds >= 3.5x the tokens of fp16)."""
import os
from pathlib import Path

import pytest
import torch

from qserve.config import CacheConfig, ModelArchConfig
from qserve.errors import ConfigError
from qserve.engine.cache_engine import (CacheEngine, KV_STORAGE, bytes_per_block,
                                        cache_tensor_specs, plan_num_blocks)
from qserve.kernels import kv_quant
from qserve.kernels.paged_attention import PagedAttentionMetadata, paged_attention, write_kv
from qserve.engine.kv_codebook import codebook_from_energy

from kv_codebooks import random_key_codebook

# (tokens, kv heads, head_dim): odd token counts, one head, head_dims that are not powers of two
SHAPES = [(1, 1, 8), (7, 3, 64), (83, 2, 80), (5, 4, 128), (33, 1, 96)]
STORAGE = {"int8": torch.int8, "int4": torch.uint8}


def sample(shape, dtype=torch.float32, seed=0):
    """Llama-like K: Gaussian with a few large outlier channels and a per-channel offset."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., :: max(1, shape[-1] // 4)] *= 8
    return (x + torch.randn(shape[-1], generator=g)).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_error_is_half_a_step(shape, dtype):
    x = sample(shape, dtype)
    q, s = kv_quant.quantize_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert s.dtype == torch.float16 and s.shape == x.shape[:-1]
    err = (kv_quant.dequantize_int8(q, s, torch.float32) - x.float()).abs()
    # |y - q s| <= s / 2: round-to-nearest on the stored scale; the fp16 rounding of s moves
    # max|y| / s by at most 2^-11 * 127 < 0.5, so the clamp at 127 never adds error.
    # 1e-6 relative covers fp32 rounding of y / s and q * s.
    assert (err <= s.float().unsqueeze(-1) / 2 + 1e-6 * x.float().abs()).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [3, 4, 5])
def test_packed_error_is_half_a_step_inside_the_range(shape, dtype, bits, monkeypatch):
    x = sample(shape, dtype)
    packed, s, m = kv_quant.quantize_packed(x, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*x.shape[:-1], x.shape[-1] * bits // 8)
    out = kv_quant.dequantize_packed(packed, s, m, bits, torch.float32)
    err = (out - x.float()).abs()
    # inside the stored range, round-to-nearest on the stored scale: half a step, plus the
    # offset's fp16 rounding (2^-11 relative: rounded above min x, the smallest values clamp
    # at q = 0 by up to that much); 1e-6 relative covers fp32 rounding of y / s and q * s
    sf, mf = s.float().unsqueeze(-1), m.float().unsqueeze(-1)
    inside = (x.float() >= mf) & (x.float() <= mf + (2 ** bits - 1) * sf)
    bound = sf / 2 + 2 ** -11 * mf.abs()
    assert (err <= bound + 1e-6 * x.float().abs())[inside].all()
    # the clipped range is chosen because it costs less than plain min-max, never more
    monkeypatch.setattr(kv_quant, "CLIP_DIVISORS", (0,))
    plain = kv_quant.dequantize_packed(*kv_quant.quantize_packed(x, bits), bits, torch.float32)
    sq = lambda y: (y.double() - x.double()).square().sum(-1)  # noqa: E731
    assert (sq(out) <= sq(plain)).all()
    if x.shape[-1] >= 64 and x.shape[0] > 1:  # and on Gaussian data some vectors do clip
        assert (sq(out) < sq(plain)).any()


def test_packing_layout():
    """Plane by plane, low bits first; within a plane of width w, element e at byte e * w / 8,
    bit e * w % 8."""
    q = torch.arange(16, dtype=torch.uint8).view(1, 16)
    assert kv_quant.pack(q, 4).tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]
    # 5 bits: the low nibbles as above, then the plane of bit 4: element e at bit e % 8 of
    # byte e / 8 (set here for elements 0, 7 and 15)
    q5 = q + 16 * torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1] + [0] * 7 + [1]], dtype=torch.uint8)
    assert kv_quant.pack(q5, 5).tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE,
                                              0x81, 0x80]]
    # 3 bits: element 4j + i's low two bits at bits 2i of byte j, then the bit-2 plane
    q3 = torch.tensor([[1, 2, 3, 0, 7, 6, 5, 4]], dtype=torch.uint8)
    assert kv_quant.pack(q3, 3).tolist() == [[0b00111001, 0b00011011, 0b11110000]]
    for bits in (1, 2, 3, 4, 5, 6, 7):
        codes = torch.randint(0, 2 ** bits, (5, 3, 40), dtype=torch.uint8)
        assert torch.equal(kv_quant.unpack(kv_quant.pack(codes, bits), bits), codes)


def test_key_bit_stream_layout():
    """Channel j's b_j bits from bit start_j on, low bit first; bit p in byte p / 8 at p % 8."""
    book = kv_quant.key_codebook(torch.ones(1, 4), torch.tensor([[3, 5, 0, 8]]))
    assert book["k_start"].tolist() == [[0, 3, 8, 8]]
    codes = torch.tensor([[[5, 17, 0, 0xA7]]])
    # byte 0 = 101 (channel 0) | 10001 << 3 (channel 1); byte 1 = channel 3
    packed = kv_quant.pack_keys(codes, book["k_width"], book["k_start"])
    assert packed.tolist() == [[[0b10001101, 0xA7]]]
    for seed in range(3):
        book = random_key_codebook(3, 40, seed)
        codes = torch.randint(0, 256, (5, 3, 40)) % 2 ** book["k_width"]
        packed = kv_quant.pack_keys(codes, book["k_width"], book["k_start"])
        assert packed.shape == (5, 3, 20)
        assert torch.equal(kv_quant.unpack_keys(packed, book["k_width"], book["k_start"]), codes)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_int4_key_error_is_half_a_step_per_channel(shape, seed):
    """In z = x / sigma, a coded channel is within half its step t / 2^(b - 1) of its value,
    plus what t's fp16 rounding left outside +-t; a channel with no bits reads 0."""
    T, hkv, d = shape
    book = random_key_codebook(hkv, d, seed)
    x = sample(shape, seed=seed) * book["k_sigma"]
    packed, t = kv_quant.quantize_keys(x, **book)
    assert packed.dtype == torch.uint8 and packed.shape == (T, hkv, d // 2)
    assert t.dtype == torch.float16 and t.shape == (T, hkv)
    out = kv_quant.dequantize_keys(packed, t, **book)
    z, zq = x / book["k_sigma"], out / book["k_sigma"]
    coded = book["k_width"] > 0
    tf = t.float().unsqueeze(-1)
    step = tf / 2.0 ** (book["k_width"] - 1)
    outside = (z.abs() - tf).clamp_min(0)
    # 1e-5 relative: fp32 rounding of z and of the dequantized value
    assert ((z - zq).abs() <= step / 2 + outside + 1e-5 * tf)[coded.expand_as(z)].all()
    assert (zq == 0)[(~coded).expand_as(z)].all()
    # t is the largest coded |z|, to fp16's rounding (2^-11 relative)
    top = torch.where(coded, z.abs(), 0).amax(-1)
    torch.testing.assert_close(t.float(), top, rtol=2 ** -11, atol=0)


def test_key_codebook_rejects_bad_widths():
    with pytest.raises(AssertionError, match="sum"):
        kv_quant.key_codebook(torch.ones(1, 8), torch.full((1, 8), 3))
    with pytest.raises(AssertionError, match="0..8"):
        kv_quant.key_codebook(torch.ones(1, 4), torch.tensor([[9, 7, 0, 0]]))


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_constant_and_zero_vectors(name, which):
    x = torch.tensor([[0.0] * 8, [3.0] * 8, [-1e-9] * 8])
    book = kv_quant.uniform_key_codebook(1, 8)
    out = kv_quant.dequantize(kv_quant.quantize(x, STORAGE[name], which, book), torch.float32,
                              which, book)
    # int4 keys: 16 midrise levels over +-t read back t (1 - 1/16) for t, and +-t / 16 for 0
    # (t at least 2^-14); the rest: fp16 offset / scale rounding
    midrise = name == "int4" and which == "k"
    atol = 3 / 16 if midrise else 3 * 2 ** -11
    assert out[0].abs().max() <= (2 ** -14 / 16 if midrise else 1e-6)
    torch.testing.assert_close(out[1], x[1], atol=atol, rtol=0)
    assert out.isfinite().all()


@pytest.mark.parametrize("d", [2, 64, 80, 96, 128])
def test_hadamard_is_orthonormal_and_symmetric(d):
    h = kv_quant.hadamard(d)
    torch.testing.assert_close(h @ h, torch.eye(d), atol=1e-6, rtol=0)
    assert torch.equal(h, h.T)


@pytest.mark.parametrize("d", [2, 64, 80, 96, 128])
def test_fast_hadamard_transform_matches_the_matrix(d):
    x = sample((13, 3, d))
    # butterflies vs a matmul: same sums in a different order, fp32 rounding apart
    torch.testing.assert_close(kv_quant.hadamard_transform(x), x @ kv_quant.hadamard(d),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_quantization_is_per_token(name, which):
    """A token's stored bytes and what is read back do not depend on the tokens beside it."""
    x = sample((83, 3, 64))
    book = random_key_codebook(3, 64)
    full = kv_quant.quantize(x, STORAGE[name], which, book)
    rows = [kv_quant.quantize(x[i:i + 1], STORAGE[name], which, book) for i in range(83)]
    for j, part in enumerate(full):
        assert torch.equal(torch.cat([r[j] for r in rows]), part)
    read = [kv_quant.dequantize(r, torch.float32, which, book) for r in rows]
    assert torch.equal(torch.cat(read), kv_quant.dequantize(full, torch.float32, which, book))


ROTATED = [("int8", "k"), ("int8", "v"), ("int4", "v")]  # int4 keys are coded unrotated


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,which", ROTATED)
def test_rotated_roundtrip_bound(shape, name, which, monkeypatch):
    """quantize/dequantize work on y = H x; H is orthonormal, so the error in x has the same
    2-norm as in y, where each element is within half a step: ||x - x^|| <= sqrt(d) s / 2.
    int4 clips when that costs less: its error is at most min-max's, whose step bounds it."""
    x = sample(shape)
    parts = kv_quant.quantize(x, STORAGE[name], which)
    out = kv_quant.dequantize(parts, torch.float32, which)
    if name == "int4":
        monkeypatch.setattr(kv_quant, "CLIP_DIVISORS", (0,))
        parts = kv_quant.quantize(x, STORAGE[name], which)
    step = parts[1].float()
    slack = 2 ** -11 * parts[2].float().abs() if name == "int4" else 0
    bound = shape[-1] ** 0.5 * (step / 2 + slack) + 1e-5 * x.norm(dim=-1)
    assert ((out - x).norm(dim=-1) <= bound).all()
    # and the rotation is what makes int4 usable on outlier channels: it beats no rotation
    if name == "int4" and shape[-1] >= 64:
        bits = kv_quant.VALUE_BITS
        plain = kv_quant.dequantize_packed(*kv_quant.quantize_packed(x, bits), bits,
                                           torch.float32)
        assert (out - x).norm() < (plain - x).norm()


# ---- the paged path ------------------------------------------------------------------------
def _cache(name, num_blocks, bs, hkv, d, codebook=None):
    arch = ModelArchConfig("llama", 10, 8, 8, 1, hkv * 3, hkv, d)
    cache = {k: torch.zeros((num_blocks, *shape), dtype=dt)
             for k, (shape, dt) in cache_tensor_specs(arch, bs, KV_STORAGE[name]).items()}
    return {**cache, **(codebook or {})}


def _meta(query_lens, seq_lens, tables, bs):
    slots, starts = [], [0]
    for q, s, t in zip(query_lens, seq_lens, tables):
        slots += [t[p // bs] * bs + p % bs for p in range(s - q, s)]
        starts.append(starts[-1] + q)
    width = max(map(len, tables))
    return PagedAttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        query_lens_list=list(query_lens), seq_lens_list=list(seq_lens),
        max_seq_len=max(seq_lens), decode_only=all(q == 1 for q in query_lens))


def _reference(q, k, v, scale):
    """One sequence, all positions: causal attention over already-dequantized K/V."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale,
        enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("name", ["fp32", "int8", "int4"])
def test_paged_prefill_chunk_and_decode_agree(name):
    """Three sequences (lengths 19, 7, 33) in shuffled 4-token blocks, run as a fresh prefill
    of all but the last five tokens, a four-token chunk, and a batched decode step. Every query
    must match causal attention over the values the cache gives back, and what write_kv
    returns must be exactly what a later gather reads."""
    torch.manual_seed(0)
    bs, hkv, H, d = 4, 2, 6, 64
    lens = [19, 7, 33]
    perm = torch.randperm(40).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[used:used + nb])
        used += nb
    qs = [torch.randn(n, H, d) for n in lens]
    ks = [sample((n, hkv, d), seed=i) for i, n in enumerate(lens)]
    # int4 keys: a codebook allocated from these keys' own energies (queries all alike)
    k2 = torch.cat(ks).pow(2).mean(0)
    codebook = {n: t[0] for n, t in codebook_from_energy(k2[None], torch.ones(1, hkv, d)).items()}
    cache = _cache(name, 40, bs, hkv, d, codebook if name == "int4" else None)
    vs = [torch.randn(n, hkv, d) for n in lens]
    scale = d ** -0.5
    outs = [[] for _ in lens]
    read_k = [[] for _ in lens]
    read_v = [[] for _ in lens]
    for lo, hi in [(0, -5), (-5, -1), (-1, None)]:
        cut = [slice(lo % n if lo else 0, hi % n if hi else n) for n in lens]
        q = torch.cat([x[c] for x, c in zip(qs, cut)])
        k = torch.cat([x[c] for x, c in zip(ks, cut)])
        v = torch.cat([x[c] for x, c in zip(vs, cut)])
        qlens = [c.stop - c.start for c in cut]
        meta = _meta(qlens, [c.stop for c in cut], tables, bs)
        k_read, v_read = write_kv(k, v, cache, meta.slot_mapping)
        out = paged_attention(q, cache, meta, scale, k_new=k_read, v_new=v_read)
        for i, part in enumerate(out.split(qlens)):
            outs[i].append(part)
        for i, (kr, vr) in enumerate(zip(k_read.split(qlens), v_read.split(qlens))):
            read_k[i].append(kr)
            read_v[i].append(vr)
    for i, n in enumerate(lens):
        k, v = torch.cat(read_k[i]), torch.cat(read_v[i])
        # what was returned at write time is what the blocks hold
        gathered = cache["k"][tables[i]].flatten(0, 1)[:n]
        parts = (gathered,) + tuple(cache[f"k_{p}"][tables[i]].flatten(0, 1)[:n]
                                    for p in kv_quant.kv_parts(cache["k"].dtype, "k"))
        assert torch.equal(kv_quant.dequantize(parts, torch.float32, "k", cache), k)
        # fp32 rounding differs between SDPA's causal path and the masked/batched ones
        torch.testing.assert_close(torch.cat(outs[i]), _reference(qs[i], k, v, scale),
                                   atol=1e-5, rtol=1e-5)
        if name != "fp32":  # and quantization really happened, within the expected error
            err = (k - ks[i]).norm() / ks[i].norm()
            # int4 keys: 4 bits a channel on average, over +-t sigma_j per token
            assert 0 < err < (0.01 if name == "int8" else 0.12)


@pytest.mark.parametrize("name", ["fp16", "int8", "int4"])
def test_copy_and_swap_move_values_and_scales(name):
    arch = ModelArchConfig("llama", 10, 8, 8, 2, 6, 2, 64)
    ce = CacheEngine(arch, CacheConfig(block_size=4), 6, 3, torch.device("cpu"),
                     KV_STORAGE[name])
    assert set(ce.device_cache) == {"k", "v"} | {f"{w}_{p}" for w in "kv" for p in
                                                   kv_quant.kv_parts(KV_STORAGE[name], w)}
    # int4's codebook is per layer: handed out with each layer, moved with no block
    codebook = set(kv_quant.CODEBOOK) if name == "int4" else set()
    assert set(ce.layer(1)) == set(ce.device_cache) | codebook
    for t in ce.device_cache.values():
        t.copy_(torch.randint(0, 100, t.shape).to(t.dtype))
    before = {n: t.clone() for n, t in ce.device_cache.items()}
    # one step's moves, run per layer on the copy queue: swap out, swap in, copy-on-write
    tickets = ce.start_moves(swap_out=[(2, 0), (3, 2)], swap_in=[(0, 5), (2, 0)],
                             copies=[(1, 4)])
    assert len(tickets) == arch.num_layers
    ce.copier.wait_all()
    assert ce.bytes_swapped_out == ce.bytes_swapped_in == 2 * ce.layer_block_bytes * 2
    for n, t in ce.device_cache.items():
        b = before[n]
        assert torch.equal(t[:, 4], b[:, 1]) and torch.equal(t[:, 5], b[:, 2])
        assert torch.equal(t[:, 0], b[:, 3])


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads /proc")
@pytest.mark.parametrize("name", ["fp32", "int8"])
def test_cpu_pool_takes_memory_as_blocks_are_written(name):
    """The CPU pool reads as zeros but becomes resident only where written: a 256-block pool
    of 65-256 MiB has nothing resident at startup (torch.zeros would write it all), and writing
    16 blocks makes about their share resident. Residency is counted page by page over the
    pool's own bytes in /proc/self/pagemap: not the process's RSS, which the allocator's
    temporaries move, nor a mapping's Rss in smaps, since the kernel may merge the pool's
    mapping with a neighbouring anonymous one that is resident."""
    page = os.sysconf("SC_PAGE_SIZE")

    def resident_kib(tensors) -> int:
        # an entry per page: bit 63 present, bit 56 mapped by this process alone. A read of an
        # untouched private page maps the kernel's shared zero page, present but not exclusive.
        counted = 0
        with open("/proc/self/pagemap", "rb") as f:
            for t in tensors:
                first, end = t.data_ptr() // page, -(-(t.data_ptr() + t.nbytes) // page)
                f.seek(first * 8)
                entries = memoryview(f.read((end - first) * 8)).cast("Q")
                counted += sum(1 for e in entries if e >> 63 and (e >> 56) & 1)
        return counted * page >> 10

    arch = ModelArchConfig("llama", 10, 1024, 256, 8, 8, 8, 128)
    ce = CacheEngine(arch, CacheConfig(block_size=16), 256, 0, torch.device("cpu"),
                     KV_STORAGE[name])
    pool = sum(t.nbytes for t in ce.device_cache.values()) >> 10
    assert pool > 64 << 10
    assert resident_kib(ce.device_cache.values()) < pool // 64
    assert all(not t.any() for t in ce.device_cache.values())  # reads zeros, commits nothing
    assert resident_kib(ce.device_cache.values()) < pool // 64
    for t in ce.device_cache.values():
        t[:, :16] = 1
    grown = resident_kib(ce.device_cache.values())
    assert pool // 16 * 0.9 < grown < pool // 16 + pool // 64
    assert all(int(t[:, 16:].count_nonzero()) == 0 and bool((t[:, :16] == 1).all())
               for t in ce.device_cache.values())


# ---- byte accounting -------------------------------------------------------------------------
SMOLLM2_135M = ModelArchConfig("llama", 49152, 576, 1536, 30, 9, 3, 64)


def test_bytes_per_block_counts_values_and_scales_exactly():
    bs, L, hkv = 16, 30, 3
    # K + V per (token, head): int4 keys are 4 bits a value (32 B) and an fp16 t, values
    # 4-bit codes (32 B) with an fp16 scale and offset
    k_and_v = {"fp32": 512, "fp16": 256, "bf16": 256, "int8": 2 * (64 + 2),
               "int4": 32 + 2 + 32 + 4}
    for name, nbytes in k_and_v.items():
        got = bytes_per_block(SMOLLM2_135M, bs, KV_STORAGE[name])
        assert got == L * bs * hkv * nbytes, name


def test_int4_needs_a_head_dim_divisible_by_8():
    arch = ModelArchConfig("llama", 10, 36, 8, 1, 1, 1, 36)
    with pytest.raises(ConfigError, match="head_dim divisible by 8"):
        cache_tensor_specs(arch, 16, torch.uint8)


def test_int4_holds_3_5x_the_tokens_of_fp16_at_the_same_budget():
    cache = CacheConfig(kv_cache_memory=1 << 30, swap_space=0)
    tokens = {name: plan_num_blocks(SMOLLM2_135M, cache, KV_STORAGE[name], torch.device("cpu"),
                                    2048)[0] * cache.block_size
              for name in ("fp16", "int8", "int4")}
    # 1 GiB / (2 * 30 * 3 * 128 B) = 46,603 fp16 tokens, in whole 16-token blocks 46,592;
    # int4: 70 B per token-head -> 170,432 tokens (3.66x)
    assert tokens["fp16"] == 46592 and tokens["int4"] == 170432
    assert tokens["int4"] >= 3.5 * tokens["fp16"]
    assert tokens["int8"] >= 1.9 * tokens["fp16"]
