"""The Triton kernels against their pure-torch references (kernels/paged_attention.py,
kernels/kv_quant.py, QuantizedTensor.dequantize), over odd sizes, GQA ratios, block sizes,
contexts that cross block boundaries and every KV dtype; int4 caches carry random key
codebooks (widths 0..8, tests/kv_codebooks.py), since a kernel must read any valid one.

Without CUDA the kernels run in Triton's CPU interpreter at small shapes; with CUDA the same
tests run on the GPU and add full-size cases. Every cache is poisoned (NaN or 0x7f bytes) in
the blocks no sequence owns and in the unused tail of each sequence's last block, while the
reference reads a clean copy, so a kernel that reads outside its tokens fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# TRITON_INTERPRET=1 set by the caller (gpu_check.py --tiny) means CPU even where CUDA is.
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
# Without CUDA, triton.jit must see TRITON_INTERPRET=1 when it decorates, and triton.language's
# own helpers (tl.zeros, tl.sum, ...) are jit functions decorated when triton is first
# imported: so set it before that. If another test module imported triton first, this file
# reruns itself in a fresh interpreter (test_in_fresh_process) and skips here.
IMPORTED_TOO_LATE = (not ON_GPU and "triton" in sys.modules
                     and os.environ.get("TRITON_INTERPRET") != "1")
if not ON_GPU and not IMPORTED_TOO_LATE:  # too late: leave it unset, so later modules see it
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from kv_codebooks import random_key_codebook  # noqa: E402
from qserve.formats import QuantizedTensor, pack_int4  # noqa: E402
from qserve.kernels.kv_quant import (CODEBOOK, KEY_BITS, VALUE_BITS, kv_parts,  # noqa: E402
                                     packed_bytes, uniform_key_codebook)
from qserve.kernels.paged_attention import (PagedAttentionMetadata, _decode_attention,  # noqa: E402
                                            paged_attention)
from qserve.kernels.paged_attention import write_kv as ref_write_kv  # noqa: E402
from qserve.kernels.triton_dequant_gemm import dequant_matmul  # noqa: E402
from qserve.kernels.triton_kv_write import write_kv  # noqa: E402
from qserve.kernels.triton_paged_attention import decode_attention  # noqa: E402
from qserve.kernels.triton_prefill_attention import prefill_attention  # noqa: E402
from qserve.quant.schemes import WeightScheme, quantize  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
KV_DTYPES = (F16, BF16, F32, torch.int8, torch.uint8)  # uint8: int4 (packed 4-bit codes)


@pytest.fixture(autouse=True)
def _in_a_fresh_process_if_late(request):
    if IMPORTED_TOO_LATE and request.node.name != "test_in_fresh_process":
        pytest.skip("triton was imported before TRITON_INTERPRET was set; "
                    "test_in_fresh_process runs these")


@pytest.mark.skipif(not IMPORTED_TOO_LATE, reason="the tests run in this process")
def test_in_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Each row (dim 0, the rest flattened): ||out - ref|| <= tol ||ref||. Relative to the
    row's own norm, so an output of size 0.01 (attention over a long context) is held to the
    same standard as one of size 1; an absolute tolerance at 1.0 would pass a dropped split."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    o, r = out.float().flatten(1), ref.float().flatten(1)
    err = (o - r).norm(dim=1) / r.norm(dim=1).clamp_min(1e-30)
    worst = int(err.argmax())
    assert err[worst] <= tol, f"row {worst}: relative error {err[worst]:.3g} > {tol:.3g}"


# ---- dequant GEMM ------------------------------------------------------------------------
# (M, N, K, bits, group, sym, x dtype): M 1..32 is the split-K decode path, 40/64+ the GEMM.
# K 576 pads to 640 at g128 (the default model); 83 and 200 are not multiples of any tile;
# g96 (a "divisor" plan's group) cannot hold a 128 tile, g24 no 16 tile at all.
GEMM_CASES = [
    (1, 83, 576, 4, 128, True, F16),
    (3, 7, 83, 8, None, True, F32),
    (5, 70, 576, 4, 32, False, BF16),
    (17, 33, 200, 4, 64, True, F32),
    (32, 19, 256, 4, 128, False, F16),
    (40, 83, 200, 8, None, True, F16),
    (2, 20, 96, 4, 96, False, F32),
    (4, 9, 72, 4, 24, True, F16),
    (1, 769, 64, 8, 32, True, BF16),
]
if ON_GPU:
    GEMM_CASES += [(1, 4096, 4096, 4, 128, True, F16), (16, 14336, 4096, 4, 64, False, BF16),
                   (7, 4096, 14336, 8, None, True, F16), (300, 5125, 576, 4, 128, True, F16),
                   (257, 769, 4096, 8, 128, True, F32)]


@pytest.mark.parametrize("M,N,K,bits,group,sym,dtype", GEMM_CASES)
def test_dequant_matmul(M, N, K, bits, group, sym, dtype):
    torch.manual_seed(M * 1000 + N)
    qt = quantize(torch.randn(N, K), WeightScheme(bits, group, sym))
    qt.qweight, qt.scales = qt.qweight.to(DEVICE), qt.scales.to(DEVICE)
    qt.offsets = None if qt.offsets is None else qt.offsets.to(DEVICE)
    x = torch.randn(M, 2 * K, device=DEVICE).to(dtype)[:, ::2]  # strided rows and columns
    bias = torch.randn(N, device=DEVICE).to(dtype)
    ref = x.float() @ qt.dequantize().T + bias.float()  # (M, N) in fp32 from the same x
    out = dequant_matmul(x, qt, bias)
    assert out.shape == (M, N) and out.dtype == dtype
    # The kernel sums exact products in fp32 and rounds once to `dtype`: a row's error is
    # about eps / 3 of its norm (measured: fp16 3e-4, bf16 4.3e-3, fp32 4e-7 from summation
    # order); one eps (fp32: 1e-5) leaves room, and a lost K split costs tens of percent.
    assert_rel_close(out, ref, GEMM_TOL[dtype])


GEMM_TOL = {F16: 1e-3, BF16: 8e-3, F32: 1e-5}


@pytest.mark.parametrize("M,N,K,bits,group,sym,dtype", GEMM_CASES)
def test_dequant_matmul_swapped(M, N, K, bits, group, sym, dtype):
    """The swapped-operand variant (weights as the dot's wide operand) over the same cases,
    dtypes and bound as test_dequant_matmul."""
    from qserve.kernels.triton_dequant_gemm import GemmConfig

    torch.manual_seed(M * 1000 + N + 1)
    qt = quantize(torch.randn(N, K), WeightScheme(bits, group, sym))
    qt.qweight, qt.scales = qt.qweight.to(DEVICE), qt.scales.to(DEVICE)
    qt.offsets = None if qt.offsets is None else qt.offsets.to(DEVICE)
    x = torch.randn(M, 2 * K, device=DEVICE).to(dtype)[:, ::2]
    bias = torch.randn(N, device=DEVICE).to(dtype)
    out = dequant_matmul(x, qt, bias, config=GemmConfig(block_n=128, swap_ab=True))
    assert out.shape == (M, N) and out.dtype == dtype
    assert_rel_close(out, x.float() @ qt.dequantize().T + bias.float(), GEMM_TOL[dtype])


# int4z (AWQ / GPTQ's integer zero points): (M, N, K, group, x dtype). K 576 pads to 640 at
# g128 and 200 to 256 at g64 (padded codes meet x = 0); g24 has no 16-input tile, so each
# weight is dequantized before the dot (the other path to the offsets -z s).
INT4Z_CASES = [
    (1, 83, 576, 128, F16),
    (5, 70, 200, 64, BF16),
    (17, 33, 256, 32, F32),
    (40, 83, 200, 32, F16),
    (4, 9, 72, 24, F32),
]
if ON_GPU:
    INT4Z_CASES += [(1, 4096, 4096, 128, F16), (16, 14336, 4096, 64, BF16),
                    (300, 5125, 576, 128, F16)]


def _int4z(N: int, K: int, group: int) -> QuantizedTensor:
    """Random int4z as AWQ / GPTQ store it: codes, zero points 0..16 (16: GPTQ v1's stored -1),
    fp16 scales of a checkpoint's size; K padded to whole groups."""
    G = -(-K // group)
    q = torch.randint(0, 16, (N, G * group), dtype=torch.uint8)
    z = torch.randint(0, 17, (N, G), dtype=torch.uint8)
    s = (torch.rand(N, G) * 0.02 + 0.001).half()
    return QuantizedTensor("int4z", pack_int4(q).to(DEVICE), s.to(DEVICE), z.to(DEVICE), K)


@pytest.mark.parametrize("M,N,K,group,dtype", INT4Z_CASES)
def test_dequant_matmul_int4z(M, N, K, group, dtype):
    """int4z against its reference (q - z) s. The offsets -z s are exact in fp32, so the weights
    are the reference's and the error is test_dequant_matmul's (GEMM_TOL); the q s and z s
    terms cancel in fp32 at a few ulps each (measured in fp32: 2e-7 of a row's norm, where
    offsets rounded to fp16, as the import did before int4z, are 3e-4 off)."""
    torch.manual_seed(M * 1000 + N)
    qt = _int4z(N, K, group)
    assert qt.validate() is None
    x = torch.randn(M, 2 * K, device=DEVICE).to(dtype)[:, ::2]  # strided rows and columns
    bias = torch.randn(N, device=DEVICE).to(dtype)
    ref = x.float() @ qt.dequantize().T + bias.float()
    out = dequant_matmul(x, qt, bias)
    assert out.shape == (M, N) and out.dtype == dtype
    assert_rel_close(out, ref, GEMM_TOL[dtype])
    if dtype == F32:  # the bound tells exact offsets from fp16-rounded ones
        rounded = QuantizedTensor("int4", qt.qweight, qt.scales,
                                  (-(qt.offsets.float() * qt.scales.float())).half(), K)
        with pytest.raises(AssertionError, match="relative error"):
            assert_rel_close(dequant_matmul(x, rounded, bias), ref, GEMM_TOL[F32])


def test_dequant_matmul_split_k_and_no_bias():
    """Explicit split counts give the same result as one program along K."""
    torch.manual_seed(1)
    qt = quantize(torch.randn(24, 320), WeightScheme(4, 32, False))
    qt.qweight, qt.scales, qt.offsets = (t.to(DEVICE) for t in (qt.qweight, qt.scales, qt.offsets))
    x = torch.randn(2, 320, device=DEVICE)
    one = dequant_matmul(x, qt, split_k=1)
    for s in (2, 3, 10):
        assert_rel_close(dequant_matmul(x, qt, split_k=s), one, 1e-6)


@pytest.mark.parametrize("bits,group,sym,dtype", [(4, 32, False, F32), (4, 128, True, F16),
                                                  (8, None, True, F32)])
def test_dequant_matmul_batch_invariant(monkeypatch, bits, group, sym, dtype):
    """A row's output is bit for bit the same alone and in a batch of any size: the tile and
    split plan never look at M (and rows go ROWS_PER_LAUNCH at a time, here 16)."""
    import qserve.kernels.triton_dequant_gemm as gemm

    monkeypatch.setattr(gemm, "ROWS_PER_LAUNCH", 16)
    torch.manual_seed(3)
    qt = quantize(torch.randn(70, 512), WeightScheme(bits, group, sym))
    qt.qweight, qt.scales = qt.qweight.to(DEVICE), qt.scales.to(DEVICE)
    qt.offsets = None if qt.offsets is None else qt.offsets.to(DEVICE)
    x = torch.randn(40, 512, device=DEVICE).to(dtype)
    batch = dequant_matmul(x, qt)
    # Rows at the top of a 16-row tile: the interpreter's tl.dot is numpy's BLAS, whose
    # micro-kernels may sum a row differently by its place in the tile (a GPU's MMA does not).
    for i in (0, 16, 32):
        assert torch.equal(dequant_matmul(x[i:i + 1], qt)[0], batch[i]), i
        assert torch.equal(dequant_matmul(x[i:i + 5], qt)[0], batch[i]), i


# Launch configurations a tuned table may name (gpu_check tune sweeps these and more): every
# tile size and split target must give the reference's result, each row alone or in a batch.
CONFIGS = [dict(block_n=32, max_block_k=64, num_warps=4, num_stages=2, fill=1),
           dict(block_n=128, max_block_k=128, num_warps=8, num_stages=4, fill=4),
           dict(block_n=64, max_block_k=32, num_warps=2, num_stages=1, fill=8),
           dict(block_n=128, max_block_k=128, num_warps=4, num_stages=3, fill=4, swap_ab=True),
           dict(block_n=64, max_block_k=64, num_warps=8, num_stages=2, fill=1, swap_ab=True),
           dict(block_n=32, max_block_k=32, num_warps=4, num_stages=2, fill=2, swap_ab=True),
           dict(block_n=64, max_block_k=128, num_warps=4, num_stages=2, fill=2, swap_ab=True,
                block_m=64),
           dict(block_n=64, max_block_k=64, num_warps=4, num_stages=3, fill=2, block_m=32)]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("bits,group,sym", [(4, 128, True), (4, 32, False), (8, None, True),
                                            (4, 24, False)])
def test_dequant_matmul_configs(cfg, bits, group, sym):
    from qserve.kernels.triton_dequant_gemm import GemmConfig

    torch.manual_seed(5)
    qt = quantize(torch.randn(150, 576), WeightScheme(bits, group, sym))
    qt.qweight, qt.scales = qt.qweight.to(DEVICE), qt.scales.to(DEVICE)
    qt.offsets = None if qt.offsets is None else qt.offsets.to(DEVICE)
    x = torch.randn(20, 2 * 576, device=DEVICE).to(F16)[:, ::2]  # strided columns
    bias = torch.randn(150, device=DEVICE).to(F16)
    config = GemmConfig(**cfg)
    out = dequant_matmul(x, qt, bias, config=config)
    assert_rel_close(out, x.float() @ qt.dequantize().T + bias.float(), GEMM_TOL[F16])
    # rows at the top of a tile (see test_dequant_matmul_batch_invariant)
    for i in range(0, x.shape[0], config.block_m):
        assert torch.equal(dequant_matmul(x[i:i + 1], qt, bias, config=config)[0], out[i]), i


def _shipped_configs() -> list:
    from pathlib import Path

    tables = sorted((Path(__file__).resolve().parent.parent / "kernels" / "tuned").glob("*.json"))
    return [(t.name, key, cfg) for t in tables
            for key, cfg in json.loads(t.read_text())["dequant_matmul"].items()]


@pytest.mark.parametrize("table,key,cfg", _shipped_configs())
def test_shipped_tuned_configs(table, key, cfg):
    """Every configuration a shipped table names loads by its device's name and gives the
    reference's result (on a small weight of its format; the interpreter ignores warps and
    stages, a GPU run of these tests does not)."""
    import qserve.kernels.triton_dequant_gemm as gemm

    path = gemm.TUNED_DIR / table
    device = json.loads(path.read_text())["device"]
    assert gemm.device_slug(device) + ".json" == table
    assert gemm._tuned_table(device, None)[key] == gemm.GemmConfig(**cfg)
    fmt, group = key.split()[0], int(key.split()[1][1:])
    torch.manual_seed(9)
    qt = quantize(torch.randn(140, 512), WeightScheme(4 if fmt == "int4" else 8,
                                                      group or None, True))
    qt.qweight, qt.scales = qt.qweight.to(DEVICE), qt.scales.to(DEVICE)
    x = torch.randn(17, 512, device=DEVICE).to(F16)
    out = dequant_matmul(x, qt, config=gemm.GemmConfig(**cfg))
    assert_rel_close(out, x.float() @ qt.dequantize().T, GEMM_TOL[F16])


def test_tuned_table(tmp_path, monkeypatch):
    """A tuned table is read by device and key; a missing override file or a malformed table
    is an error, and a weight the table does not name gets the default configuration."""
    import qserve.kernels.triton_dequant_gemm as gemm
    from qserve.errors import ConfigError

    table = tmp_path / "t.json"
    cfg = dict(block_n=128, max_block_k=64, num_warps=8, num_stages=4, fill=1)
    table.write_text(json.dumps({"device": "x", "dequant_matmul": {
        gemm.tuning_key("int4", 128, 4096, 14336): cfg}}))
    got = gemm._tuned_table("x", str(table))
    assert got == {"int4 g128 4096x14336": gemm.GemmConfig(**cfg)}
    assert gemm.device_slug("NVIDIA H200") == "nvidia-h200"
    assert gemm._tuned_table("no such device", None) == {}
    with pytest.raises(ConfigError, match="QSERVE_TRITON_TUNING: no such file"):
        gemm._tuned_table("x", str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    for text in [json.dumps({"dequant_matmul": {"k": entry}}) for entry in (
            {"block_q": 64}, {"block_m": 24}, {"num_warps": 3}, {"fill": 0})] + [
            "{not json", "[]", json.dumps({"other": {}}), json.dumps({"dequant_matmul": [1]})]:
        bad.write_text(text)
        with pytest.raises(ConfigError, match="not a dequant_matmul tuning table"):
            gemm._tuned_table("x", str(bad))
    # a CPU tensor (the interpreter) always gets the default
    monkeypatch.setenv("QSERVE_TRITON_TUNING", str(table))
    assert gemm.gemm_config(torch.device("cpu"), "int4", 128, 4096, 14336) == \
        gemm.DEFAULT_CONFIG


# ---- paged cache fixtures ----------------------------------------------------------------
def _empty_cache(num_blocks, page, hkv, d, kv_dtype, codebook_seed=0):
    """A zeroed layer cache; an int4 one with a random key codebook (None: the uniform one)."""
    cache = {}
    for w, bits in (("k", KEY_BITS), ("v", VALUE_BITS)):
        width = packed_bytes(d, bits) if kv_dtype == torch.uint8 else d
        shape = (num_blocks, page, hkv, width)
        cache[w] = torch.zeros(shape, device=DEVICE).to(kv_dtype)
        for part in kv_parts(kv_dtype, w):
            cache[f"{w}_{part}"] = torch.zeros(shape[:3], device=DEVICE, dtype=F16)
    if kv_dtype == torch.uint8:
        codebook = (uniform_key_codebook(hkv, d) if codebook_seed is None
                    else random_key_codebook(hkv, d, codebook_seed))
        cache.update({n: t.to(DEVICE) for n, t in codebook.items()})
    return cache


def _poison(cache, keep_slots):
    """A copy of `cache` with every slot outside keep_slots overwritten: NaN in float tensors,
    0x7f bytes (127, or nibbles 15/7) in integer ones. The codebook (per layer) is kept."""
    out = {}
    for name, t in cache.items():
        if name in CODEBOOK:
            out[name] = t
            continue
        flat = t.clone().flatten(0, 1)  # (num_blocks * page, ...)
        keep = torch.zeros(flat.shape[0], dtype=torch.bool, device=DEVICE)
        keep[keep_slots] = True
        flat[~keep] = float("nan") if t.is_floating_point() else 0x7f
        out[name] = flat.view(t.shape)
    return out


def _setup(seq_lens, query_lens, H, hkv, d, page, kv_dtype, dtype, window=None, seed=0,
           codebook_seed=0):
    """Sequences over shuffled blocks of a pool with spare blocks, their whole context written
    by the reference write_kv, queries for their last query_lens positions.
    Returns (q, clean cache, poisoned cache, metadata)."""
    torch.manual_seed(seed)
    need = [-(-n // page) for n in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.long)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n]
        used += n

    def slots(b, positions):
        return tables[b, positions // page] * page + positions % page

    ctx_slots = torch.cat([slots(b, torch.arange(n)) for b, n in enumerate(seq_lens)])
    cache = _empty_cache(num_blocks, page, hkv, d, kv_dtype, codebook_seed)
    kv = torch.randn(2, len(ctx_slots), hkv, d, device=DEVICE)
    kv[0, :, :, :3] *= 8  # a few outlier channels in K, as in Llama
    ref_write_kv(kv[0].to(dtype), kv[1].to(dtype), cache, ctx_slots.to(DEVICE))
    q_slots = torch.cat([slots(b, torch.arange(n - m, n))
                         for b, (n, m) in enumerate(zip(seq_lens, query_lens))])
    meta = PagedAttentionMetadata(
        slot_mapping=q_slots.to(DEVICE),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                                     device=DEVICE),
        seq_lens=torch.tensor(seq_lens, device=DEVICE), block_tables=tables.to(DEVICE),
        query_lens_list=list(query_lens), seq_lens_list=list(seq_lens),
        max_seq_len=max(seq_lens), decode_only=all(m == 1 for m in query_lens),
        sliding_window=window)
    q = torch.randn(sum(query_lens), H, d, device=DEVICE).to(dtype)
    return q, cache, _poison(cache, ctx_slots.to(DEVICE)), meta


# Per-row relative error of a kernel against the reference run in fp32 over the same cache
# (q.float(): K/V dequantized to fp32, fp32 scores and probabilities). The kernel rounds
# dequantized K/V and the probabilities to the query dtype before its dots; measured at most
# 1.8 eps for fp16, 0.6 for bf16 (whose dots the interpreter runs in fp32) and 2e-6 for fp32
# (summation order). Twice that: a dropped 64-key tile or split moves a row by far more.
ATTN_TOL = {F16: 4e-3, BF16: 1.5e-2, F32: 1e-5}


# ---- decode attention --------------------------------------------------------------------
# (seq_lens, H, Hkv, head_dim, page, kv dtype, q dtype, window, num_splits)
DECODE_CASES = [
    ([1, 8, 9, 29], 4, 4, 32, 8, F16, F16, None, None),
    ([17, 40], 6, 2, 64, 16, BF16, BF16, None, 3),
    ([33, 5], 8, 2, 16, 8, F32, F32, None, 2),
    ([16, 47], 8, 1, 32, 16, torch.int8, F16, None, 4),
    ([41, 3], 3, 1, 32, 8, torch.uint8, BF16, None, 3),
    ([50, 9], 8, 1, 32, 16, torch.uint8, F32, 20, 2),
    ([26, 70], 4, 2, 32, 8, torch.int8, F32, 7, None),
    ([20, 9], 4, 2, 48, 8, torch.int8, F16, None, 2),  # H: 3 blocks of 16, padded to 64
    ([13, 30], 4, 2, 24, 8, torch.uint8, F16, None, 2),  # 12-byte key streams, padded to 32
]
if ON_GPU:
    DECODE_CASES += [([1024, 8191, 77, 4097], 32, 8, 128, 16, kv, F16, None, None)
                     for kv in KV_DTYPES] + [
        ([32768, 2000], 32, 8, 128, 16, torch.int8, BF16, 4096, None)]


@pytest.mark.parametrize("seq_lens,H,hkv,d,page,kv_dtype,dtype,window,splits", DECODE_CASES)
def test_decode_attention(seq_lens, H, hkv, d, page, kv_dtype, dtype, window, splits):
    q, clean, poisoned, meta = _setup(seq_lens, [1] * len(seq_lens), H, hkv, d, page,
                                      kv_dtype, dtype, window)
    out = decode_attention(q, poisoned, meta, d ** -0.5, num_splits=splits)
    ref = _decode_attention(q.float(), clean, meta, d ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert_rel_close(out, ref, ATTN_TOL[dtype])


def test_decode_attention_batch_invariant():
    """Each sequence's output is bit for bit the same alone and in a batch with a longer one:
    its splits are fixed token ranges (split_len), merged in order, whatever the batch's
    longest context."""
    for kv_dtype in (F16, torch.int8):
        seq_lens = [300, 20, 70]
        q, _, cache, meta = _setup(seq_lens, [1] * 3, 4, 2, 32, 8, kv_dtype, F32)
        batch = decode_attention(q, cache, meta, 0.2)
        for b, n in enumerate(seq_lens):
            one = PagedAttentionMetadata(
                slot_mapping=meta.slot_mapping[b:b + 1], query_start_loc=meta.query_start_loc[:2],
                seq_lens=meta.seq_lens[b:b + 1], block_tables=meta.block_tables[b:b + 1],
                query_lens_list=[1], seq_lens_list=[n], max_seq_len=n, decode_only=True)
            assert torch.equal(decode_attention(q[b:b + 1], cache, one, 0.2)[0], batch[b]), b


# ---- prefill / chunked prefill -----------------------------------------------------------
# (seq_lens, query_lens, H, Hkv, head_dim, page, kv dtype, q dtype, window): fresh prefills
# (query_len = seq_len), chunks after a prefix (prefix hits, later chunks) and decode rows.
PREFILL_CASES = [
    ([19, 8], [19, 8], 4, 4, 32, 8, F16, F16, None),
    ([40, 13, 9], [21, 1, 9], 6, 2, 32, 16, F32, F32, None),
    ([37, 24], [5, 24], 8, 1, 16, 8, BF16, BF16, None),
    ([33, 17], [33, 4], 3, 1, 64, 16, torch.int8, F16, None),
    ([45, 10], [12, 10], 8, 2, 32, 8, torch.uint8, F32, None),
    ([30, 26], [30, 9], 4, 1, 32, 8, torch.uint8, BF16, 6),
    ([52], [20], 4, 4, 32, 16, torch.int8, F32, 11),
    ([140, 20], [100, 20], 2, 1, 16, 16, torch.int8, F16, None),  # two 64-row tiles
    ([130], [130], 2, 2, 16, 8, F16, F16, 50),
    ([23], [23], 2, 1, 80, 8, torch.uint8, F32, None),  # H: 5 blocks of 16, padded to 128
]
if ON_GPU:
    PREFILL_CASES += [([2048, 1500, 4097], [2048, 300, 1], 32, 8, 128, 16, kv, BF16, None)
                      for kv in KV_DTYPES]


@pytest.mark.parametrize("seq_lens,query_lens,H,hkv,d,page,kv_dtype,dtype,window",
                         PREFILL_CASES)
def test_prefill_attention(seq_lens, query_lens, H, hkv, d, page, kv_dtype, dtype, window):
    q, clean, poisoned, meta = _setup(seq_lens, query_lens, H, hkv, d, page, kv_dtype, dtype,
                                      window)
    out = prefill_attention(q, poisoned, meta, d ** -0.5)
    ref = paged_attention(q.float(), clean, meta, d ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert_rel_close(out, ref, ATTN_TOL[dtype])


def test_prefill_attention_batch_invariant():
    """A sequence's rows are bit for bit the same alone and beside others (GQA groups of 4
    and 3 heads, so tiles pack query rows and heads)."""
    for H, hkv in ((8, 2), (3, 1)):
        seq_lens, query_lens = [90, 30, 12], [70, 1, 12]
        q, _, cache, meta = _setup(seq_lens, query_lens, H, hkv, 16, 8, torch.int8, F32)
        batch = prefill_attention(q, cache, meta, 0.25)
        starts = meta.query_start_loc.tolist()
        for b, (n, m) in enumerate(zip(seq_lens, query_lens)):
            s, e = starts[b], starts[b + 1]
            one = PagedAttentionMetadata(
                slot_mapping=meta.slot_mapping[s:e],
                query_start_loc=torch.tensor([0, m], device=DEVICE),
                seq_lens=meta.seq_lens[b:b + 1], block_tables=meta.block_tables[b:b + 1],
                query_lens_list=[m], seq_lens_list=[n], max_seq_len=n, decode_only=False)
            assert torch.equal(prefill_attention(q[s:e], cache, one, 0.25), batch[s:e]), b


def test_poisoned_free_blocks_change_nothing():
    """Bit for bit the same output whether the slots no sequence owns hold zeros or poison."""
    for kv_dtype in (F16, torch.uint8):
        q, clean, poisoned, meta = _setup([21, 9], [1, 1], 4, 2, 32, 8, kv_dtype, F16)
        assert torch.equal(decode_attention(q, clean, meta, 0.2, num_splits=2),
                           decode_attention(q, poisoned, meta, 0.2, num_splits=2))
        meta.decode_only = False
        assert torch.equal(prefill_attention(q, clean, meta, 0.2),
                           prefill_attention(q, poisoned, meta, 0.2))


# ---- KV write ----------------------------------------------------------------------------
# (kv dtype, x dtype, T, Hkv, head_dim, codebook seed): every KV dtype at one shape, then int4
# over head_dims that pad the tile (24, 40, 72 -> 32, 64, 128), the smallest (8: a 4-byte key
# stream, where many codes start in the last byte and read from a clamped base) and the
# uniform codebook (seed None).
WRITE_CASES = [(kv, F16, 7, 2, 48, 0) for kv in KV_DTYPES] + [
    (torch.int8, BF16, 7, 2, 48, 0), (torch.int8, F32, 5, 3, 24, 0), (BF16, F32, 7, 2, 48, 0),
    (torch.uint8, BF16, 9, 1, 24, 1), (torch.uint8, F32, 6, 2, 40, 2),
    (torch.uint8, F16, 5, 3, 8, 3), (torch.uint8, F16, 4, 2, 72, 4),
    (torch.uint8, F32, 3, 1, 128, 5), (torch.uint8, BF16, 7, 2, 64, None),
]
if ON_GPU:
    WRITE_CASES += [(kv, F16, 300, 8, 128, 0) for kv in KV_DTYPES] + [
        (torch.uint8, BF16, 1000, 8, 128, 6), (torch.uint8, F32, 257, 4, 80, 7)]


@pytest.mark.parametrize("kv_dtype,dtype,T,hkv,d,codebook_seed", WRITE_CASES)
def test_write_kv(kv_dtype, dtype, T, hkv, d, codebook_seed):
    """Codes, scales and offsets land bit for bit where the reference puts them, and every
    other byte of a poisoned cache stays as it was."""
    torch.manual_seed(T * 100 + d)
    page = 8 if d < 128 else 16
    num_blocks = -(-T // page) + 4
    cache = _poison(_empty_cache(num_blocks, page, hkv, d, kv_dtype, codebook_seed),
                    torch.tensor([], dtype=torch.long, device=DEVICE))
    expected = {n: t.clone() for n, t in cache.items()}
    slots = torch.randperm(num_blocks * page, device=DEVICE)[:T]
    k = torch.randn(T, hkv, d, device=DEVICE)
    k[0] = 0  # t (and s) clamp at the smallest normal fp16
    k[1, :, : d // 2] = 3e4 * k[1, :, : d // 2].sign()  # int4 keys: |x| / sigma past 65504
    k = k.to(dtype)
    v = (torch.randn(T, hkv, d, device=DEVICE) * 3 + 1).to(dtype)
    k_out, v_out = write_kv(k, v, cache, slots)
    k_ref, v_ref = ref_write_kv(k, v, expected, slots)
    for name in cache:  # bytes compare NaN poison as equal to itself
        assert torch.equal(cache[name].view(torch.uint8), expected[name].view(torch.uint8)), name
    # The returned K/V are computed the same way as the reference's, each op rounded on its
    # own (the launch disables FMA contraction), so bit for bit.
    for got, ref in ((k_out, k_ref), (v_out, v_ref)):
        assert got.dtype == dtype
        assert torch.equal(got, ref)


@pytest.mark.parametrize("kv_dtype", [F16, torch.int8, torch.uint8])
def test_write_kv_skips_padding_rows(kv_dtype):
    """Slot -1 (a CUDA-graph batch's padding rows, engine/cuda_graph.py) writes nothing."""
    cache = _poison(_empty_cache(3, 8, 2, 32, kv_dtype),
                    torch.tensor([], dtype=torch.long, device=DEVICE))
    expected = {n: t.clone() for n, t in cache.items()}
    k = torch.randn(3, 2, 32, device=DEVICE).to(F16)
    write_kv(k, k, cache, torch.tensor([-1, 5, -1], device=DEVICE))
    ref_write_kv(k[1:2], k[1:2], expected, torch.tensor([5], device=DEVICE))
    for name in cache:
        assert torch.equal(cache[name].view(torch.uint8), expected[name].view(torch.uint8)), name


def test_write_kv_launch_disables_fp_fusion(monkeypatch):
    """The int4 write must round (y - m) / s and q * s + m as torch does: a GPU compiler
    would otherwise fuse them into FMAs (one rounding), and codes near a tie would flip.
    The interpreter cannot show an FMA, so check what the launch asks the compiler for."""
    import qserve.kernels.triton_kv_write as kw

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(kw, "_kv_write_kernel", Recorder())
    cache = _empty_cache(2, 8, 1, 16, torch.uint8)
    x = torch.randn(3, 1, 16, device=DEVICE)
    kw.write_kv(x, x, cache, torch.arange(3, device=DEVICE))
    assert len(launches) == 2 and all(k.get("enable_fp_fusion") is False for k in launches)


def test_int4_uniform_codebook_attention():
    """Decode and prefill read an uncalibrated cache (kv_quant.uniform_key_codebook) too."""
    q, clean, poisoned, meta = _setup([19, 40], [1, 1], 4, 2, 32, 8, torch.uint8, F32,
                                      codebook_seed=None)
    assert_rel_close(decode_attention(q, poisoned, meta, 0.2, num_splits=2),
                     _decode_attention(q, clean, meta, 0.2), ATTN_TOL[F32])
    meta.decode_only = False
    assert_rel_close(prefill_attention(q, poisoned, meta, 0.2),
                     paged_attention(q, clean, meta, 0.2), ATTN_TOL[F32])
