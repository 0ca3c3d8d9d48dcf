"""The CPU matmul kernels for every weight format (cpu_ops.weight_matmul: kernels/cpu_formats.c
for GGML blocks and fp16/bf16, cpu_ops.c for int4/int8) against the pure-torch reference,
QuantizedTensor.dequantize, over awkward shapes, with fp32 and int8 activations, on both the
fused row path (M <= FUSED_MAX_ROWS) and the dequantize-then-GEMM path (M above it).

Random GGML blocks: codes and sub-block scales are random bytes (every bit pattern occurs), the
fp16 super-scales d / dmin / m finite values of a checkpoint's size, MXFP4's E8M0 exponents
likewise (every exponent: test_mxfp4_every_exponent_decodes_bit_for_bit). The fused decode
step over linears made of several formats is in tests/test_cpu_ops.py (it reuses
`random_weight`).
"""
from __future__ import annotations

import functools
import math
import os
import subprocess
import sys

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from qserve.formats import QuantizedTensor, ggml, pack_int4
from qserve.kernels import cpu_ops

if cpu_ops.lib() is None and os.environ.get("QSERVE_REQUIRE_KERNELS") != "1":
    pytest.skip("the CPU kernels did not build here (see the logged reason)",
                allow_module_level=True)

GGML = list(ggml.IN_PLACE)  # q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k iq4_nl iq4_xs mxfp4
DENSE = ["f16", "bf16"]
U = 2.0 ** -24  # fp32 unit roundoff


def random_weight(fmt: str, N: int, K: int, seed: int = 0, std: float | None = None
                  ) -> QuantizedTensor:
    """A random (N, K) matrix in `fmt` (a GGML in-place type, f16 or bf16). GGML blocks are
    random bytes with fp16 fields 0.01 * randn and E8M0 fields (MXFP4's exponents) in
    ggml.RANDOM_E8M0; `std` rescales those fields (w is linear in them; an exponent moves by
    the nearest power of two) so that the weights have about that standard deviation, for
    models that must stay numerically tame."""
    if fmt.startswith("int4_x16"):  # int4 g32 asymmetric (Q4_1's repack), or -sym: g64 sym
        from qserve.quant.schemes import WeightScheme, quantize

        w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
        sym = fmt.endswith("-sym")
        return ggml.interleave(quantize(w, WeightScheme(4, 64 if sym else 32, sym)))
    if fmt in ggml.INTERLEAVED:  # the CPU's runtime layout of the same q4_k / q6_k matrix
        return ggml.interleave(random_weight(ggml.INTERLEAVED[fmt][0], N, K, seed, std))
    g = torch.Generator().manual_seed(seed)
    if fmt in DENSE:
        w = torch.randn(N, K, generator=g) * (std or K ** -0.5)
        return QuantizedTensor(fmt, w.to(torch.float16 if fmt == "f16" else torch.bfloat16),
                               None, None, K)
    t = ggml.TYPES[fmt]
    n = N * K // t.block
    blocks = torch.randint(0, 256, (n, t.block_bytes), dtype=torch.uint8, generator=g)
    fields = {off: torch.randn(n, 1, generator=g) * 0.01
              for off in ggml.TYPES[fmt].fp16_fields}
    for off in t.e8m0_fields:
        blocks[:, off] = torch.randint(*ggml.RANDOM_E8M0, (n,), dtype=torch.uint8, generator=g)
    if std is not None:
        for off, d in fields.items():
            blocks[:, off:off + 2] = d.half().view(torch.uint8)
        w = QuantizedTensor(fmt, blocks.view(N, -1), None, None, K).dequantize()
        fields = {off: d * (std / w.std().item()) for off, d in fields.items()}
        for off in t.e8m0_fields:
            e = blocks[:, off].int() + round(math.log2(std / w.std().item()))
            blocks[:, off] = e.to(torch.uint8)
    for off, d in fields.items():
        blocks[:, off:off + 2] = d.half().view(torch.uint8)
    return QuantizedTensor(fmt, blocks.view(N, -1), None, None, K)


def random_int4z(N: int, K: int, group_size: int, seed: int = 0, std: float | None = None
                 ) -> QuantizedTensor:
    """An (N, K) int4z matrix as an AWQ / GPTQ checkpoint holds one: random codes, zero points
    0..16 (16: GPTQ v1's stored -1) and fp16 scales (0.001..0.021, or about std / 6.7 each:
    q - z has a standard deviation of 6.7), K padded to whole groups with random codes (they
    meet zero activations)."""
    g = torch.Generator().manual_seed(seed)
    G = -(-K // group_size)
    q = torch.randint(0, 16, (N, G * group_size), dtype=torch.uint8, generator=g)
    z = torch.randint(0, 17, (N, G), dtype=torch.uint8, generator=g)
    s = torch.rand(N, G, generator=g) * 0.02 + 0.001
    if std is not None:
        s = s / 0.011 * std / 6.7
    return QuantizedTensor("int4z", pack_int4(q), s.half(), z, K)


def _in_sizes(fmt: str) -> list[int]:
    """1..3 blocks of a GGML type; for the dense formats sizes that leave every tail of the
    16-wide loops (3: all tail, 40: 2 x 16 + 8, 77)."""
    if fmt in DENSE:
        return [3, 40, 77]
    return [ggml.TYPES[fmt].block * n for n in (1, 2, 3)]


GRID = [(fmt, N, K) for fmt in GGML + DENSE for N in (1, 7, 83, 769) for K in _in_sizes(fmt)]
ROWS = [1, 5, 32, 40]  # 40 > FUSED_MAX_ROWS: dequantize once + GEMM


@functools.lru_cache(maxsize=None)
def _weight(fmt: str, N: int, K: int) -> tuple[QuantizedTensor, torch.Tensor]:
    """A grid point's matrix and its reference (N, K) in fp64 (shared by every M)."""
    qt = random_weight(fmt, N, K, seed=N * 1000 + K)
    return qt, qt.dequantize().double()


def _case(fmt: str, N: int, K: int, M: int):
    qt, w = _weight(fmt, N, K)
    g = torch.Generator().manual_seed(N * 1000 + K + M)
    return qt, w, torch.randn(M, K, generator=g), torch.randn(N, generator=g)


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("fmt,N,K", GRID)
def test_weight_matmul_fp32_matches_reference(fmt, N, K, M):
    """fp32 activations. The kernels decode every weight to the reference's fp32 value (the
    scale products d * sc, dmin * m are exact in fp32, test_weights_decode_bit_for_bit), so
    only the order of the fp32 sum differs: |y - y_ref| <= (K + 1) u sum_k |w_k x_k| + u |y|
    for any order (one rounding per add, the bias add included)."""
    qt, w, x, bias = _case(fmt, N, K, M)
    ref = x.double() @ w.T + bias.double()
    out = cpu_ops.weight_matmul(x, qt, bias)
    tol = (K + 2) * U * ((x.double().abs() @ w.abs().T) + bias.double().abs())
    assert ((out.double() - ref).abs() <= tol).all()


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """(M, K) -> (M, K) fp64: x as the int8-activation path sees it. Per 32 inputs, codes
    q = round(x * (127 / amax)) (fp32 product, ties to even) times the step amax / 127."""
    M, K = x.shape
    xc = x.view(M, -1, 32)
    amax = xc.abs().amax(-1, keepdim=True)
    # a correctly rounded 127 / amax, as C divides: torch's `127.0 / amax` is 127 times the
    # rounded reciprocal, an ulp off at times, which flips exact ties (x = amax / 2, common in
    # weights on a small integer grid)
    inv = torch.full_like(amax, 127.0) / amax
    q = torch.round(xc * torch.where(amax > 0, inv, torch.zeros_like(amax)))
    return (q.double() * (amax / 127.0).double()).view(M, K)


@pytest.fixture
def bf16_prefill(monkeypatch):
    """The bf16 prefill path switched on whatever the CPU (it is the path AMX machines take;
    its results do not depend on the hardware, only its speed does)."""
    monkeypatch.setenv("QSERVE_CPU_BF16", "1")
    cpu_ops.fast_bf16.cache_clear()
    yield
    monkeypatch.undo()
    cpu_ops.fast_bf16.cache_clear()


VNNI = cpu_ops.kernel_isa() == "avx512-vnni"
GEMM = cpu_ops.kernel_isa() in ("avx512-vnni", "avx2")  # the int8 GEMM is built
NO_GEMM = "the int8 GEMM is built with the AVX-512 VNNI or AVX2 kernels"


def _x16_runs(fmt: str) -> bool:
    """Whether this build's kernels run the _x16 layout `fmt`."""
    base = ggml.INTERLEAVED[fmt.split("-")[0]][0]
    return base in cpu_ops.X16_BASES.get(cpu_ops.kernel_isa(), ())


# the _x16 layouts whose row kernel beats the int8 GEMM at every decode size (gemm_min_rows)
ROWS_ONLY_X16 = ["int4_x16"] if VNNI else []


def _skip_unless_x16_runs(fmt: str) -> None:
    if not _x16_runs(fmt):
        pytest.skip(f"{fmt} runs on the AVX2 and AVX-512 VNNI kernels only")


def _gemm_takes(qt) -> bool:
    """Whether the int8 GEMM takes qt's kind at decode sizes (every packed kind)."""
    return cpu_ops.gemm_min_rows(qt) > 0


@pytest.fixture
def gemm_prefill(monkeypatch):
    """The int8 GEMM prefill path on an AVX-512 VNNI or AVX2 build even where AMX would pick
    bf16."""
    monkeypatch.setenv("QSERVE_CPU_BF16", "0")
    cpu_ops.fast_bf16.cache_clear()
    assert cpu_ops.int8_gemm()
    yield
    monkeypatch.undo()
    cpu_ops.fast_bf16.cache_clear()


@pytest.mark.skipif(not cpu_ops.has_int8_path(), reason="no int8-activation kernels (AVX2)")
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("fmt,N,K", [c for c in GRID if c[0] in GGML])
def test_weight_matmul_int8_activations_match_reference(fmt, N, K, M):
    """int8 activations: the kernel computes the reference weights times x rounded to int8 per
    32 inputs (int8_rounded), to fp32 accuracy: the integer sums are exact, and the few fp32
    products per chunk (scales, and the min / offset terms before they cancel) add roundings of
    terms no larger than the largest sum |w| |x|: (K + 2) u of it. Against x itself the error
    is the rounding's, at most (d / 2) sum |w| per chunk (d the chunk's step)."""
    _check_int8_activations(fmt, N, K, M)


@pytest.mark.skipif(not cpu_ops.has_int8_path(), reason="no int8-activation kernels (AVX2)")
@pytest.mark.parametrize("fmt,N,K", [c for c in GRID if c[0] in GGML])
def test_bf16_prefill_matches_reference(fmt, N, K, bf16_prefill):
    """The prefill branch of the test above with the bf16 GEMM on, as on an AMX machine."""
    _check_int8_activations(fmt, N, K, 40)


@pytest.mark.skipif(not GEMM, reason=NO_GEMM)
@pytest.mark.parametrize("fmt,N,K", [c for c in GRID if c[0] in GGML])
def test_int8_gemm_prefill_matches_reference(fmt, N, K, gemm_prefill):
    """The prefill branch with the int8 GEMM on, as on a VNNI or AVX2 machine without AMX."""
    _check_int8_activations(fmt, N, K, 40)


def _check_int8_activations(fmt: str, N: int, K: int, M: int) -> None:
    qt, w, x, _ = _case(fmt, N, K, M)
    out = cpu_ops.weight_matmul(x, qt, int8_activations=True).double()
    if M > cpu_ops.FUSED_MAX_ROWS:  # prefill: dequantize + GEMM
        if cpu_ops.int8_gemm() and fmt not in DENSE and _gemm_takes(qt):
            _check_int8_gemm(out, x, w)
            return
        if not cpu_ops.fast_bf16():  # fp32 activations
            assert torch.equal(out, cpu_ops.weight_matmul(x, qt).double())
            return
        # x and W rounded to bf16 (8-bit mantissas), products summed in fp32 ((K + 2) u of the
        # largest sum |w| |x|, as above), the sum rounded to bf16 (half an ulp: <= 2^-8 of it)
        xb, wb = x.bfloat16().double(), w.bfloat16().double()
        ref = xb @ wb.T
        slack = (K + 2) * U * (xb.abs() @ wb.abs().T).max()
        assert ((out - ref).abs() <= 2.0 ** -8 * (ref.abs() + slack) + slack).all()
        assert not torch.equal(out, cpu_ops.weight_matmul(x, qt).double())  # it is bf16
        return
    xr = int8_rounded(x)
    slack = (K + 2) * U * (xr.abs() @ w.abs().T).max()
    assert ((out - xr @ w.T).abs() <= slack).all()
    step = x.double().abs().view(M, -1, 32).amax(-1) / 127  # (M, K / 32)
    bound = (step / 2) @ w.abs().view(N, -1, 32).sum(-1).T  # (M, N)
    assert ((out - x.double() @ w.T).abs() <= bound + slack).all()


def _padded_int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """int8_rounded for any K: the chunks a K that is not a multiple of 32 ends in are padded
    with zeros, as the kernels pad them."""
    M, K = x.shape
    Kp = -(-K // 32) * 32
    return int8_rounded(F.pad(x.float(), (0, Kp - K)))[:, :K]


def _check_int8_gemm(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """The int8 GEMM multiplies the weights' own codes (the reference weights w exactly, no
    second rounding) by x rounded to int8 per 32 inputs (int8_rounded, as the row kernels): a
    chunk's products sum exactly in integers, its few fp32 products and adds (and the bias's)
    cost at most (K + 2) u of the largest sum |w| |xr|. Against x itself the rounding adds at
    most half its step per input: |x w - xr w| <= sum |x - xr| |w|."""
    K = x.shape[1]
    xr = _padded_int8_rounded(x)
    slack = (K + 2) * U * (xr.abs() @ w.abs().T).max()
    assert ((out - xr @ w.T).abs() <= slack).all()
    bound = (x.double() - xr).abs() @ w.abs().T
    assert ((out - x.double() @ w.T).abs() <= bound + slack).all()


@pytest.mark.skipif(not GEMM, reason=NO_GEMM)
@pytest.mark.parametrize("fmt,N,K", [("int4", 83, 77), ("int4", 17, 512), ("int4-sym", 83, 77),
                                     ("int4z", 83, 77), ("int4z-g128", 17, 512),
                                     ("int8", 83, 77), ("int8", 769, 96),
                                     ("int8-channel", 40, 77)])
@pytest.mark.parametrize("M", [24, 45])
def test_int8_gemm_qserve_formats(fmt, N, K, M, gemm_prefill):
    """qserve's int4 / int4z / int8 (a padded last group, odd sizes) through the int8 GEMM, with
    a bias, at a decode batch's size (from gemm_min_rows) and a prefill's: the bias is added
    once, after the sums. int4z's offsets -z s are exact, so its weights are the reference's;
    its terms before they cancel (q s and z s, at most ~3x |w| here) take a few roundings a
    chunk, far inside _check_int8_gemm's (K + 2) u."""
    qt = _mixed_formats_weight(fmt, N, K)
    assert 0 < cpu_ops.gemm_min_rows(qt) <= M  # AVX2: int8's codes in two 4-bit planes
    w = qt.dequantize().double()
    g = torch.Generator().manual_seed(N + K)
    x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    out = cpu_ops.weight_matmul(x, qt, bias, int8_activations=True).double()
    _check_int8_gemm(out - bias.double(), x, w)


@pytest.mark.skipif(not GEMM, reason=NO_GEMM)
@pytest.mark.parametrize("fmt,N,K", [("int4-sym", 28, 2080), ("int4-sym-x16", 48, 512),
                                     ("q5_0", 20, 512), ("q4_k", 24, 512), ("int4", 28, 96),
                                     ("int8", 20, 2080), ("iq4_nl", 20, 512),
                                     ("mxfp4", 28, 512)])
def test_int8_gemm_rows_do_not_depend_on_their_neighbours(fmt, N, K, gemm_prefill):
    """Each output of the int8 GEMM is the same bits whether its weight row runs in an 8-row
    slice of W alone or beside the others: the AVX2 build runs two 8-row tiles at once for codes
    without offsets (gemm_tile2_i8; int4-sym and q5_0 here: whole pairs and a partial one), and
    that must be gemm_tile_i8's arithmetic exactly, so a row's result never depends on how N
    falls into tiles (mxfp4 too: codes 0 .. 24 without offsets); q4_k and int4 (offsets) run
    one tile at a time, as do int8 and iq4_nl (8-bit codes, which AVX2 splits into two 4-bit
    planes). int4_x16 (Q4_0's repack) packs its tiles from the interleaved layout, its slices
    from plain int4: the same codes."""
    M = 24
    base = fmt.removesuffix("-x16")
    if base in GGML:
        qt, w, x, bias = _case(base, N, K, M)
    else:
        qt = _mixed_formats_weight(base, N, K)
        w = qt.dequantize().double()
        g = torch.Generator().manual_seed(N + K)
        x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    if fmt.endswith("-x16"):
        qt = cpu_ops.runtime_layout(qt)
        assert qt.format == "int4_x16"
    cpu_ops.set_gemm_rows(1)  # the GEMM even where a decode batch would take the row kernels
    try:
        assert cpu_ops.gemm_min_rows(qt) == 1
        out = cpu_ops.weight_matmul(x, qt, bias, int8_activations=True)
        for r0 in range(0, N, 8):
            part = qt.rows(slice(r0, r0 + 8))
            assert cpu_ops.gemm_min_rows(part) == 1
            alone = cpu_ops.weight_matmul(x, part, bias[r0:r0 + 8], int8_activations=True)
            assert torch.equal(out[:, r0:r0 + 8], alone), r0
    finally:
        cpu_ops.set_gemm_rows(None)
    _check_int8_gemm(out.double() - bias.double(), x, w)


@pytest.mark.skipif(not GEMM, reason=NO_GEMM)
@pytest.mark.parametrize("fmt,N,K,M", [("q4_k", 40, 2304, 45), ("q6_k", 24, 4352, 40),
                                       ("q5_0", 17, 2080, 24), ("int4", 33, 2080, 24),
                                       ("int4z-g128", 16, 4224, 45), ("int8", 24, 2081, 45),
                                       ("int8-channel", 9, 2081, 33), ("q4_k", 24, 256, 2061),
                                       ("int4", 17, 96, 2061), ("int8", 17, 544, 1100),
                                       ("iq4_xs", 24, 512, 600), ("mxfp4", 17, 2080, 600)])
def test_int8_gemm_blocks(fmt, N, K, M, gemm_prefill):
    """The int8 GEMM in blocks of 2048 inputs and 2048 rows (GEMM_KC, GEMM_MB in cpu_ops.c; the
    AVX2 build's split 8-bit tiles 512 rows, SPLIT_MB): more than one block of inputs (whole
    and partial, a padded last group), and of rows; each
    block after the first adds its sums to y, and the bias is added once. Same bound as a
    single block (_check_int8_gemm): the blocks only regroup the fp32 adds of the chunks."""
    if fmt in GGML:
        qt, w, x, bias = _case(fmt, N, K, M)
    else:
        qt = _mixed_formats_weight(fmt, N, K)
        w = qt.dequantize().double()
        g = torch.Generator().manual_seed(N + K + M)
        x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    assert 0 < cpu_ops.gemm_min_rows(qt) <= M
    out = cpu_ops.weight_matmul(x, qt, bias, int8_activations=True).double()
    _check_int8_gemm(out - bias.double(), x, w)


@pytest.mark.parametrize("fmt", GGML + DENSE + ["int4", "int4z", "int8"])
@pytest.mark.parametrize("M", [32, 40])
def test_weights_decode_bit_for_bit(fmt, M):
    """x = rows of the identity reads W back: each output is one weight times 1 plus zeros, exact
    in any summation order. M = 32 decodes through the fused kernel's block decoder, M = 40
    through wdequant (the prefill path): both give the reference's fp32 weights exactly (int4 /
    int4z / int8 with 77 inputs: a padded last group, an odd count; int4z's q s - z s is
    (q - z) s exactly)."""
    qt = _decode_case(fmt, M)
    assert torch.equal(_read_back(qt, M), qt.dequantize())


def test_mxfp4_every_exponent_decodes_bit_for_bit():
    """MXFP4's E8M0 byte over all 256 values, as gguf-py reads it (ggml.py's _e8m0_half: e = 0
    and 1 the subnormal scales 2^-128 and 2^-127, e = 255 2^127, where a code of 12 overflows
    to inf): the C block decoder's weights are the reference's as bits, through the row
    decoders (wdequant_rows) infinities included, and through the identity read back (the
    fused path's decoder, M = 32, and wdequant's, M = 40) for exponents up to 252 (an inf
    weight times a zero input would be NaN there)."""
    g = torch.Generator().manual_seed(39)
    blocks = torch.randint(0, 256, (256, 17), dtype=torch.uint8, generator=g)
    blocks[:, 0] = torch.randperm(256, generator=g).to(torch.uint8)
    qt = QuantizedTensor("mxfp4", blocks.view(16, -1), None, None, 512)
    ref = qt.dequantize()
    assert ref.isinf().any() and not ref.isnan().any()
    got = cpu_ops.weight_rows(qt, torch.arange(16))
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    finite = blocks.clone()
    finite[:, 0] %= 253  # 0 .. 252, every one
    qt = QuantizedTensor("mxfp4", finite.view(16, -1), None, None, 512)
    ref = qt.dequantize()
    tiny = torch.finfo(torch.float32).tiny
    assert ((ref != 0) & (ref.abs() < tiny)).any() and ref.isfinite().all()
    for M in (32, 40):
        assert torch.equal(_read_back(qt, M).view(torch.int32), ref.view(torch.int32)), M


def _decode_case(fmt: str, seed: int) -> QuantizedTensor:
    """13 rows of fmt: int4 / int8 with 77 inputs, the others their largest test width."""
    if fmt in ("int4", "int4z", "int8"):
        return _mixed_formats_weight(fmt, 13, 77)
    return random_weight(fmt, 13, _in_sizes(fmt)[-1], seed=seed)


def _read_back(qt: QuantizedTensor, M: int, **kw) -> torch.Tensor:
    """(N, K): qt's matmul with the identity, M rows a call (the last call's M rows end at K,
    so every call runs the same path)."""
    K = qt.in_features
    eye = torch.eye(K)
    starts = sorted({*range(0, K - M + 1, M), K - M})
    cols = torch.empty(K, qt.shape[0])
    for i in starts:
        cols[i:i + M] = cpu_ops.weight_matmul(eye[i:i + M], qt, **kw)
    return cols.T


def test_bf16_prefill_is_chosen_by_amx_or_the_variable(monkeypatch):
    """AVX512-BF16 without AMX multiplies bf16 slower than fp32, so only AMX picks bf16, and
    never QSERVE_CPU_ISA=avx2 or avx2-vnni (a CPU without AVX-512 has no AMX); QSERVE_CPU_BF16
    overrides either way."""
    amx = "amx_bf16" in Path("/proc/cpuinfo").read_text().split()
    try:
        for isa in ("native", "avx2", "avx2-vnni"):
            monkeypatch.setenv("QSERVE_CPU_ISA", isa)
            for value, want in (("1", True), ("0", False), (None, amx and isa == "native")):
                if value is None:
                    monkeypatch.delenv("QSERVE_CPU_BF16", raising=False)
                else:
                    monkeypatch.setenv("QSERVE_CPU_BF16", value)
                cpu_ops.fast_bf16.cache_clear()
                assert cpu_ops.fast_bf16() is want, (isa, value)
    finally:
        monkeypatch.undo()
        cpu_ops.fast_bf16.cache_clear()


@pytest.mark.parametrize("fmt", GGML + DENSE + ["int4", "int4z", "int8"])
def test_prefill_weights_are_the_reference_in_bf16(fmt, bf16_prefill):
    """The bf16 prefill path (int8_activations, more than FUSED_MAX_ROWS rows) multiplies the
    reference's weights rounded to nearest-even bf16, as torch rounds: identity rows read them
    back exactly (one product by 1.0 each)."""
    qt = _decode_case(fmt, 40)
    want = qt.dequantize().bfloat16().float()
    assert torch.equal(_read_back(qt, 40, int8_activations=True), want)


@pytest.mark.parametrize("fmt", GGML + DENSE + ["int4", "int4z", "int8", "f32"]
                         + [f for f in ggml.INTERLEAVED if _x16_runs(f)])
@pytest.mark.parametrize("i8", [False, True])
def test_matmul_rows_do_not_depend_on_the_batch(fmt, i8):
    """Each output row is bit-identical whatever rows come beside it, within one kernel's range
    of batch sizes: alone or among 32 (as for int4/int8 in test_cpu_ops.py) where the row
    kernels take every decode size; with int8 activations on a VNNI or AVX2 build, from
    gemm_min_rows rows on the int8 GEMM takes a batch, so there a row is the same among
    gemm_min_rows rows as among 32, and the same alone as among gemm_min_rows - 1; and with
    set_gemm_rows(0) alone as among 32 again (greedy outputs stay batch-invariant)."""
    K, M = 512, cpu_ops.FUSED_MAX_ROWS
    qt = _mixed_formats_weight(fmt, 203, K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(11))

    def rows(lo: int, hi: int) -> torch.Tensor:
        return cpu_ops.weight_matmul(x[lo:hi].clone(), qt, int8_activations=i8)

    full = rows(0, M)
    start = cpu_ops.gemm_min_rows(qt) if i8 else 0
    if fmt in ROWS_ONLY_X16 and i8:  # its row kernel takes every decode size (gemm_min_rows)
        assert start > M
        start = 0
    no_gemm = DENSE + ["f32"] + ROWS_ONLY_X16
    assert 0 <= start <= M and (start > 0) == (i8 and GEMM and fmt not in no_gemm)
    if start:  # the GEMM's range, then the row kernels' below it
        assert torch.equal(rows(M - start, M), full[M - start:])
        few = rows(0, start - 1)
        for i in (0, start // 2, start - 2):
            assert torch.equal(rows(i, i + 1), few[i:i + 1]), i
        cpu_ops.set_gemm_rows(0)
        try:
            full = rows(0, M)
        finally:
            cpu_ops.set_gemm_rows(None)
        assert cpu_ops.gemm_min_rows(qt) == start
    for i in (0, 5, 8, 30, 31):
        assert torch.equal(rows(i, i + 1), full[i:i + 1]), i
    # prefill-sized calls (the int8 GEMM with i8 where the CPU has it): rows grouped 8 at a
    # time from another start give the same bits
    xs = torch.randn(45, K, generator=torch.Generator().manual_seed(12))
    big = cpu_ops.weight_matmul(xs, qt, int8_activations=i8)
    assert torch.equal(cpu_ops.weight_matmul(xs[3:40].clone(), qt, int8_activations=i8),
                       big[3:40])


@pytest.mark.parametrize("fmt", DENSE)
def test_dense_tile_gemm_is_the_row_kernel_bit_for_bit(fmt):
    """fp16 / bf16 weights at a few rows: the tile GEMM (each weight converted once a call)
    gives the row kernel's bits (each converted once a row) at every row count, over widths
    with and without a tail past the last 16 inputs, tiles cut short (N not a multiple of 16)
    and strided rows; both within fp32 rounding of F.linear on the dequantized weights."""
    for N, K in ((203, 523), (16, 16), (33, 15), (64, 2048), (5, 1000)):
        qt = random_weight(fmt, N, K, seed=N)
        bias = torch.randn(N, generator=torch.Generator().manual_seed(K))
        wide = torch.randn(cpu_ops.FUSED_MAX_ROWS, K + 9,
                           generator=torch.Generator().manual_seed(N + K))
        for M in range(1, cpu_ops.FUSED_MAX_ROWS + 1):
            x = wide[:M, 3:3 + K]  # rows 9 floats apart
            out = []
            for rows in (0, 1):  # 0: the row kernel at every size; 1: the GEMM at every size
                cpu_ops.set_half_gemm_rows(rows)
                try:
                    out.append(cpu_ops.weight_matmul(x, qt, bias))
                finally:
                    cpu_ops.set_half_gemm_rows(None)
            assert torch.equal(out[0], out[1]), (N, K, M)
            want = torch.nn.functional.linear(x, qt.dequantize(), bias)
            torch.testing.assert_close(out[1], want, rtol=1e-4, atol=1e-4 * K ** 0.5)


@pytest.mark.parametrize("vendor,flags,env,strict", [
    ("GenuineIntel", {"avx2"}, {}, True),  # Alder Lake and later desktop parts
    ("GenuineIntel", {"avx2", "avx512f"}, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, True),
    ("GenuineIntel", {"avx2", "avx512f"}, {"MKL_ENABLE_INSTRUCTIONS": "avx2_e1"}, True),
    ("GenuineIntel", {"avx2", "avx512f"}, {}, False),
    ("GenuineIntel", {"avx2", "avx512f"}, {"MKL_ENABLE_INSTRUCTIONS": "AVX512_E1"}, False),
    ("GenuineIntel", {"avx2"}, {"MKL_CBWR": "COMPATIBLE"}, False),  # the user's own setting
    ("AuthenticAMD", {"avx2"}, {}, False),
    ("", frozenset(), {}, False),  # no /proc/cpuinfo
])
def test_mkl_strict_mode_where_mkl_runs_avx2_on_intel(vendor, flags, env, strict):
    assert cpu_ops.mkl_strict_wanted(vendor, frozenset(flags), env) is strict


def test_fp32_prefill_rows_do_not_depend_on_the_batch_with_mkl_in_avx2():
    """The fp32 prefill GEMM (MKL's) keeps a row's bits whatever rows come beside it where MKL
    runs its AVX2 code (MKL_ENABLE_INSTRUCTIONS=AVX2 stands for an AVX2-only CPU): importing
    the kernels sets MKL's strict mode on an Intel CPU, which that code needs (on a Sapphire
    Rapids VM, of int4 weights dequantized for it, rows 3-40 of 45 differed without it). A
    fresh process: MKL reads the setting at its first call."""
    probe = """
import os, torch
from qserve.formats import QuantizedTensor
from qserve.kernels import cpu_ops
from qserve.quant.schemes import WeightScheme, quantize
g = torch.Generator().manual_seed(0)
w, xs = torch.randn(203, 512, generator=g), torch.randn(45, 512, generator=g)
same = []
for qt in (QuantizedTensor("f32", w, None, None, 512), quantize(w, WeightScheme(4, 32, False))):
    big = cpu_ops.weight_matmul(xs, qt)
    same.append(torch.equal(cpu_ops.weight_matmul(xs[3:40].clone(), qt), big[3:40]))
print(os.environ.get("MKL_CBWR", "-"), *same)
"""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    env["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cbwr, *same = out.stdout.split()
    wanted = cpu_ops.mkl_strict_wanted(*cpu_ops.cpu_vendor_and_flags(), env)
    assert cbwr == ("AUTO,STRICT" if wanted else "-")
    assert same == ["True", "True"]


def _mixed_formats_weight(fmt: str, N: int, K: int) -> QuantizedTensor:
    """random_weight, plus qserve's int4 g32 / int8 g32, int4z g32 (or g128: "int4z-g128") and
    a dense f32 matrix."""
    from qserve.quant.schemes import WeightScheme, quantize

    if fmt.startswith("int4z"):
        return random_int4z(N, K, int(fmt.partition("-g")[2] or 32), seed=N + K)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(N + K))
    if fmt in ("int4", "int4-sym"):  # asymmetric g32 (Q4_1's repack), symmetric (Q4_0's)
        return quantize(w, WeightScheme(4, 32, fmt == "int4-sym"))
    if fmt == "int8-channel":  # one scale per output row, any K
        return quantize(w, WeightScheme(8, None, True))
    if fmt == "int8":
        return quantize(w, WeightScheme(8, 32, True))
    if fmt == "f32":
        return QuantizedTensor("f32", w, None, None, K)
    if fmt in ggml.INTERLEAVED:  # whole groups of 16 rows, at least the N asked for
        return random_weight(fmt, -(-N // 16) * 16, K)
    return random_weight(fmt, N, K)


@pytest.mark.parametrize("fmt", GGML + DENSE + ["int4", "int4z", "int8", "f32"]
                         + [f for f in ggml.INTERLEAVED if _x16_runs(f)])
@pytest.mark.parametrize("bf16", [False, True])
def test_prefill_dequantizes_a_block_of_rows_at_a_time(fmt, bf16, monkeypatch):
    """A prefill matmul (more than FUSED_MAX_ROWS rows, the fp32 or the bf16 GEMM) dequantizes
    its weights block_rows rows at a time into a scratch buffer of one block (Llama-3.1-8B's
    gate/up in bf16: 32 MiB instead of 224), each block's columns of the output exactly the
    whole matrix's in one GEMM, bias included; 64-row blocks keep an _x16 layout's groups.
    (At 8B widths oneDNN orders its bf16 GEMM's fp32 sums by the width it is given, and about
    1 output in 7,000 differs by the rounding of the sum to bf16; the fp32 GEMM's do not.)"""
    K, M, N = 512, cpu_ops.FUSED_MAX_ROWS + 8, 208
    qt = _mixed_formats_weight(fmt, N, K)
    g = torch.Generator().manual_seed(5)
    x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    monkeypatch.setenv("QSERVE_CPU_BF16", "1" if bf16 else "0")
    cpu_ops.fast_bf16.cache_clear()
    try:
        dtype = torch.bfloat16 if bf16 else torch.float32
        assert cpu_ops._row_blocks(qt, dtype) == [(0, N)]  # 208 rows: under one block
        whole = cpu_ops.weight_matmul(x, qt, bias, int8_activations=bf16)
        monkeypatch.setattr(cpu_ops, "SCRATCH_BYTES", 64 * K * dtype.itemsize)
        monkeypatch.setattr(cpu_ops._local, "buf", None, raising=False)
        assert cpu_ops._row_blocks(qt, dtype) == [(0, 64), (64, 128), (128, 192), (192, 208)]
        blocked = cpu_ops.weight_matmul(x, qt, bias, int8_activations=bf16)
        assert torch.equal(blocked, whole)
        if fmt != "f32" or bf16:  # an fp32 matrix is multiplied as it is
            assert cpu_ops._local.buf.numel() == 64 * K * dtype.itemsize
    finally:
        monkeypatch.undo()
        cpu_ops.fast_bf16.cache_clear()


@pytest.mark.skipif(not GEMM, reason=NO_GEMM)
@pytest.mark.parametrize("fmt", GGML + DENSE + ["int4", "int4z", "int8"])
def test_the_planners_int8_gemm_formats_are_the_kernels(fmt):
    """The memory plan counts no prefill scratch for the stored formats in INT8_GEMM_FORMATS:
    exactly those this build's int8 GEMM takes in their runtime layout, on AVX-512 VNNI and
    AVX2 alike (AVX2 multiplies the 8-bit codes, int8's and the iq4 tables', as two 4-bit
    planes); the dense ones are not in it."""
    from qserve.engine.memory_plan import INT8_GEMM_FORMATS

    qt = cpu_ops.runtime_layout(_mixed_formats_weight(fmt, 64, 512))
    assert _gemm_takes(qt) == (fmt in INT8_GEMM_FORMATS)
    assert _gemm_takes(qt) == (fmt not in DENSE)


def test_segments_write_their_own_columns_of_one_output():
    """A fused linear of row segments in different formats fills one (M, N) output through
    column views (out=y[:, n0:n1], row stride N), each segment with its slice of the bias; the
    columns no segment owns are left alone."""
    M, K = 3, 512
    segs = [random_weight("q4_k", 64, K, 1), random_weight("q6_k", 32, K, 2),
            _mixed_formats_weight("int4", 5, K)]
    x = torch.randn(M, K)
    bias = torch.randn(101)
    y = torch.full((M, 102), float("nan"))
    n0 = 0
    for seg in segs:
        n1 = n0 + seg.shape[0]
        assert cpu_ops.weight_matmul(x, seg, bias[n0:n1], True, out=y[:, n0:n1]).data_ptr() == (
            y[:, n0:n1].data_ptr())
        assert torch.equal(y[:, n0:n1], cpu_ops.weight_matmul(x, seg, bias[n0:n1], True))
        n0 = n1
    assert y[:, 101].isnan().all() and not y[:, :101].isnan().any()


def test_weight_matmul_reads_strided_activation_rows():
    """x may be a view whose rows are strided (stride(1) == 1), as a slice of the fused qkv."""
    qt = random_weight("q5_k", 9, 256)
    wide = torch.randn(4, 300)
    x = wide[:, 20:276]
    for i8 in (False, True):
        assert torch.equal(cpu_ops.weight_matmul(x, qt, int8_activations=i8),
                           cpu_ops.weight_matmul(x.contiguous(), qt, int8_activations=i8))


def test_supports():
    K = 256
    for fmt in GGML + DENSE + ["int4", "int4z", "int8", "f32"]:
        assert cpu_ops.supports(_mixed_formats_weight(fmt, 4, K)), fmt
    q4k = random_weight("q4_k", 8, K)
    assert not cpu_ops.supports(QuantizedTensor("q4_k", q4k.qweight[::2], None, None, K))
    assert not cpu_ops.supports(QuantizedTensor("q4_k", q4k.qweight[:, :100], None, None, K))
    w = torch.randn(4, 64)
    int4_g16 = QuantizedTensor("int4", torch.zeros(4, 32, dtype=torch.uint8),
                               torch.ones(4, 4, dtype=torch.float16), None, 64)
    assert int4_g16.validate() is None and not cpu_ops.supports(int4_g16)
    # the format says what the third tensor is: int4z's zero points are uint8, int4's fp16
    z = _mixed_formats_weight("int4z", 4, K)
    for fmt, third in (("int4z", z.offsets.half()), ("int4", z.offsets)):
        qt = QuantizedTensor(fmt, z.qweight, z.scales, third, K)
        assert qt.validate() is not None and not cpu_ops.supports(qt), fmt
    with cpu_ops.disabled():
        assert not cpu_ops.supports(QuantizedTensor("f32", w, None, None, 64))


def test_fp32_activation_path_against_f_linear_on_a_realistic_scale():
    """Weights rescaled to std 1 / sqrt(K) (as in a model) and unit activations: the kernel's
    output is F.linear's of the reference weights to fp32 accuracy."""
    for fmt in GGML:
        qt = random_weight(fmt, 50, 512, std=512 ** -0.5)
        x = torch.randn(4, 512)
        want = F.linear(x, qt.dequantize())
        torch.testing.assert_close(cpu_ops.weight_matmul(x, qt), want, rtol=1e-5, atol=1e-5)


# ---- q4_k_x16 / q6_k_x16: 16 rows interleaved, the layouts the 512-bit kernels run them in ----
X16_GRID = [(16, 256), (48, 768), (784, 512)]
X16 = ["q4_k_x16", "q6_k_x16", "int4_x16", "int4_x16-sym"]  # -sym: int4 g64 symmetric



@pytest.mark.parametrize("fmt", ["q4_k_x16", "q6_k_x16"])
def test_x16_is_the_same_bytes_and_weights(fmt):
    """interleave moves bytes (q4_k's 6-bit scales and mins regrouped); deinterleave gives the
    file's blocks back byte for byte (every bit pattern of random blocks, d / dmin included),
    so the weights are the base format's exactly; rows (an embedding's lookup) deinterleave
    only their groups. A wrong shape is named."""
    base, row_bytes = ggml.INTERLEAVED[fmt][:2]
    for N, K in X16_GRID:
        qt = random_weight(base, N, K, seed=N + K)
        raw = QuantizedTensor(base, torch.randint(0, 256, qt.qweight.shape, dtype=torch.uint8,
                                                  generator=torch.Generator().manual_seed(N)),
                              None, None, K)
        for src in (qt, raw):
            x16 = ggml.interleave(src)
            assert x16.format == fmt and x16.shape == (N, K) and x16.validate() is None
            assert x16.qweight.shape[1] == K // 256 * row_bytes
            assert torch.equal(ggml.deinterleave(x16).qweight, src.qweight)
        x16, w = ggml.interleave(qt), qt.dequantize()
        assert torch.equal(x16.dequantize(), w)
        ids = torch.tensor([N - 1, 0, 3, N // 2, 3])
        assert torch.equal(x16.rows(ids).dequantize(), w[ids])
        assert torch.equal(x16.rows(slice(1, N - 1)).dequantize(), w[1:N - 1])
    bad = QuantizedTensor(fmt, torch.zeros(8, row_bytes, dtype=torch.uint8), None, None, 256)
    assert "multiple of 16 rows" in bad.validate()
    bad = QuantizedTensor(fmt, torch.zeros(16, row_bytes - 4, dtype=torch.uint8), None, None, 256)
    assert f"take {row_bytes} bytes" in bad.validate()


@pytest.mark.parametrize("sym,group_size,N,K", [(True, 32, 16, 77), (False, 32, 48, 256),
                                                 (True, 64, 32, 520), (False, 128, 784, 300)])
def test_int4_x16_is_the_same_codes_and_weights(sym, group_size, N, K):
    """int4 -> int4_x16 -> int4 gives the codes, scales and offsets back exactly (a padded last
    group included), so the weights are int4's; rows read their groups back."""
    from qserve.quant.schemes import WeightScheme, quantize

    q = quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(N)),
                 WeightScheme(4, group_size, sym))
    x16 = ggml.interleave(q)
    assert x16.format == "int4_x16" and x16.validate() is None and x16.shape == (N, K)
    back = ggml.deinterleave(x16)
    for part in ("qweight", "scales", "offsets"):
        a, b = getattr(back, part), getattr(q, part)
        assert (a is None and b is None) or torch.equal(a, b), part
    w = q.dequantize()
    assert torch.equal(x16.dequantize(), w)
    ids = torch.tensor([N - 1, 0, 5])
    assert torch.equal(x16.rows(ids).dequantize(), w[ids])
    if GEMM:  # the kernels read it back too, (M = 32: fp32 rows; 40: wdequant)
        for M in (32, 40):
            assert torch.equal(_read_back(x16, M), w)
        x = torch.randn(7, K, generator=torch.Generator().manual_seed(1))
        _check_int8_gemm(cpu_ops.weight_matmul(x, x16, int8_activations=True).double(), x,
                         w.double())  # the row kernel, a padded last group: the same bound
    bad = QuantizedTensor("int4_x16", x16.qweight[:8], x16.scales[:8],
                          None if x16.offsets is None else x16.offsets[:8], K)
    assert "multiple of 16 rows" in bad.validate()


def test_runtime_layout_picks_x16_only_where_it_runs(monkeypatch):
    """cpu_ops.runtime_layout: q4_k / q6_k with whole groups of 16 rows become their _x16 on a
    512-bit or an AVX2 build (the builds with the int8 path); 17 rows, other formats,
    QSERVE_CPU_REPACK=0 and builds without the kernels keep the matrix as it is."""
    for base in ("q4_k", "q6_k"):
        q = random_weight(base, 32, 256)
        out = cpu_ops.runtime_layout(q)
        assert out.format == (base + "_x16" if _x16_runs(base + "_x16") else base)
        assert _x16_runs(base + "_x16") == GEMM
        assert cpu_ops.supports(out)
        monkeypatch.setenv("QSERVE_CPU_REPACK", "0")
        assert cpu_ops.runtime_layout(q) is q
        monkeypatch.delenv("QSERVE_CPU_REPACK")
    for other in (random_weight("q4_k", 17, 256), random_weight("q5_k", 32, 256)):
        assert cpu_ops.runtime_layout(other) is other
    from qserve.quant.schemes import WeightScheme, quantize

    q = quantize(torch.randn(32, 64), WeightScheme(4, 32, True))
    assert cpu_ops.runtime_layout(q).format == ("int4_x16" if GEMM else "int4")
    assert _x16_runs("int4_x16") == GEMM


# ---- laying out in C (x16_interleave): the reference's bytes, straight into a stack ----------
LAYOUT_ROWS = [16, 48, 1040]  # one group, a few, and more than a load's slice (256 rows)


def _random_x16_base(base: str, N: int, K: int, group_size: int = 0, sym: bool = True,
                     seed: int = 0) -> QuantizedTensor:
    """(N, K) q4_k / q6_k / int4 of random bytes (every bit pattern: d / dmin, the 6-bit scale
    packing, int4's codes in the padding of the last group), int4 scales / offsets random
    fp16 bits."""
    g = torch.Generator().manual_seed(seed)
    if base == "int4":
        G = -(-K // group_size)

        def halves(width: int) -> torch.Tensor:  # (N, width) fp16 of random bits
            return torch.randint(0, 256, (N, 2 * width), dtype=torch.uint8,
                                 generator=g).view(torch.float16)
        codes = halves(G * group_size // 4).view(torch.uint8)  # (N, Kp / 2)
        return QuantizedTensor("int4", codes, halves(G), None if sym else halves(G), K)
    width = K // 256 * ggml.TYPES[base].block_bytes
    return QuantizedTensor(base, torch.randint(0, 256, (N, width), dtype=torch.uint8,
                                               generator=g), None, None, K)


def _check_laid_into_stack(src: QuantizedTensor, monkeypatch) -> None:
    """runtime_layout(src, stack, 16) writes rows 16 .. 16 + N of a stack of N + 32 rows in C
    (ggml.interleave, the torch reference, fails if called), exactly ggml.interleave's bytes,
    which deinterleave back to src's, and leaves the stack's other rows as they were."""
    fmt, N = ggml.BY_BASE[src.format], src.shape[0]
    want = ggml.interleave(src)
    stack = ggml.empty_rows(src, N + 32, fmt)
    for t in stack.tensors().values():
        t.view(torch.uint8).fill_(0xA5)
    with monkeypatch.context() as m:
        m.setattr(ggml, "interleave", lambda qt: pytest.fail("the torch reference ran"))
        assert cpu_ops.runtime_layout(src, stack, 16) is stack
    assert stack.validate() is None
    bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731  (random fp16 bits: NaNs)
    for part, t in stack.tensors().items():
        assert torch.equal(bits(t[16:16 + N]), bits(getattr(want, part))), part
        assert (bits(t[:16]) == 0xA5).all() and (bits(t[16 + N:]) == 0xA5).all()
    laid = QuantizedTensor(fmt, *(None if t is None else t[16:16 + N]
                                  for t in (stack.qweight, stack.scales, stack.offsets)),
                           src.in_features)
    back = ggml.deinterleave(laid)
    for part, t in src.tensors().items():
        assert torch.equal(bits(getattr(back, part)), bits(t)), part


@pytest.mark.parametrize("K", [256, 768, 2304])
@pytest.mark.parametrize("N", LAYOUT_ROWS)
@pytest.mark.parametrize("base", ["q4_k", "q6_k"])
def test_k_quant_laid_out_in_c_is_the_reference(base, N, K, monkeypatch):
    """q4_k / q6_k -> _x16 in C (x16_interleave), at a row offset into a stack, against
    ggml.interleave byte for byte (any build: laying out is byte moves, whichever kernels run
    the layout)."""
    _check_laid_into_stack(_random_x16_base(base, N, K, seed=N + K), monkeypatch)


@pytest.mark.parametrize("N", LAYOUT_ROWS)
@pytest.mark.parametrize("sym,group_size,K", [(True, 32, 77), (False, 32, 256), (True, 64, 520),
                                              (False, 128, 300), (False, 64, 2304)])
def test_int4_laid_out_in_c_is_the_reference(sym, group_size, N, K, monkeypatch):
    """int4 -> int4_x16 in C: the codes (a padded last group's included), the scales and the
    offsets re-ordered [G][16] by groups of 16 rows, as ggml.interleave does."""
    _check_laid_into_stack(_random_x16_base("int4", N, K, group_size, sym, seed=N + K),
                           monkeypatch)


def test_layout_in_c_refuses_what_does_not_fit():
    """x16_interleave writes nothing and says so (runtime_layout then takes the reference)
    for a row offset off the 16-row groups or past the stack's end, a stack of another
    layout, input count, group size or symmetry, and a source that is not whole groups."""
    q4 = _random_x16_base("q4_k", 32, 512)
    i4 = _random_x16_base("int4", 32, 256, 64, sym=False)
    cases = [(q4, ggml.empty_rows(q4, 64, "q4_k_x16"), 8),
             (q4, ggml.empty_rows(q4, 48, "q4_k_x16"), 32),
             (q4, ggml.empty_rows(_random_x16_base("q6_k", 32, 512), 64, "q6_k_x16"), 0),
             (q4, ggml.empty_rows(_random_x16_base("q4_k", 32, 256), 64, "q4_k_x16"), 0),
             (QuantizedTensor("q4_k", q4.qweight[:24], None, None, 512),
              ggml.empty_rows(q4, 64, "q4_k_x16"), 0),
             (i4, ggml.empty_rows(_random_x16_base("int4", 32, 256, 32, sym=False), 64,
                                  "int4_x16"), 0),
             (i4, ggml.empty_rows(_random_x16_base("int4", 32, 256, 64, sym=True), 64,
                                  "int4_x16"), 0)]
    for src, out, row in cases:
        for t in out.tensors().values():
            t.view(torch.uint8).fill_(0xA5)  # a sentinel: nothing written
        assert not cpu_ops._interleave_into(src, out, row), (src.shape, out.format, row)
        assert all((t.view(torch.uint8) == 0xA5).all() for t in out.tensors().values())


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 13, 32, 40])
@pytest.mark.parametrize("N,K", X16_GRID)
@pytest.mark.parametrize("fmt", X16)
def test_x16_matmul_matches_reference(fmt, N, K, M):
    """fp32 activations (each row decoded to the reference's floats, as
    test_weight_matmul_fp32_matches_reference bounds it) and int8 ones: the 16-row kernels for
    1..8 rows a tile (their one-row variants keep more chains in flight), the int8 GEMM from
    gemm_min_rows on, its tiles taken straight from the interleaved bytes."""
    _skip_unless_x16_runs(fmt)
    qt, w, x, bias = _case(fmt, N, K, M)
    ref = x.double() @ w.T + bias.double()
    out = cpu_ops.weight_matmul(x, qt, bias)
    tol = (K + 2) * U * ((x.double().abs() @ w.abs().T) + bias.double().abs())
    assert ((out.double() - ref).abs() <= tol).all()
    _check_int8_activations(fmt, N, K, M)


@pytest.mark.skipif(not GEMM, reason=NO_GEMM)
@pytest.mark.parametrize("fmt,M", [(f, m) for f in X16 for m in (24, 32, 45, 2061)])
def test_x16_int8_gemm(fmt, M, gemm_prefill):
    """The int8 GEMM on the _x16 layouts (decode batches from gemm_min_rows, prefill, and more
    than one block of inputs and of rows: 2304 inputs, 2061 rows), with a bias: the weights'
    own codes, so the bound of _check_int8_gemm."""
    _skip_unless_x16_runs(fmt)
    N, K = 48, 2304
    qt, w, x, bias = _case(fmt, N, K, M)
    if M <= cpu_ops.FUSED_MAX_ROWS and fmt.split("-")[0] in ROWS_ONLY_X16:
        assert cpu_ops.gemm_min_rows(qt) > cpu_ops.FUSED_MAX_ROWS
        pytest.skip(f"{fmt}'s row kernel takes every decode size")
    assert 0 < cpu_ops.gemm_min_rows(qt) <= M
    out = cpu_ops.weight_matmul(x, qt, bias, int8_activations=True).double()
    _check_int8_gemm(out - bias.double(), x, w)


@pytest.mark.parametrize("fmt", X16 + GGML + DENSE + ["int4", "int8"])
def test_embedding_lookup_through_the_kernels_is_the_reference(fmt):
    """QuantEmbedding's lookup on the CPU goes through the C row decoders (wdequant_rows): the
    rows it returns are the reference's rows bit for bit, in the ids' shape and order (repeats
    included), and an id outside the table is an IndexError, as the reference's lookup."""
    from qserve.layers.quant_linear import QuantEmbedding

    if fmt in X16:
        _skip_unless_x16_runs(fmt)
    qt = (_mixed_formats_weight(fmt, 48, 77) if fmt in ("int4", "int8")
          else random_weight(fmt, 48, _in_sizes(fmt)[-1] if fmt in GGML + DENSE else 512))
    emb = QuantEmbedding(qt, torch.float32)
    ids = torch.tensor([[47, 0, 17], [17, 31, 16]])
    calls = []
    real = cpu_ops.weight_rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_ops, "weight_rows", lambda *a: calls.append(1) or real(*a))
        got = emb(ids)
    assert calls, "the lookup did not go through the C row decoders"
    assert got.shape == (2, 3, qt.in_features)
    assert torch.equal(got, qt.dequantize()[ids])
    with pytest.raises(IndexError):
        emb(torch.tensor([3, 48]))
    with pytest.raises(IndexError):
        emb(torch.tensor([-1]))


@pytest.mark.parametrize("M", [32, 40])
@pytest.mark.parametrize("fmt", X16)
def test_x16_reads_back_the_reference_weights(fmt, M):
    """The identity read back through an _x16 matrix (M = 32: the fp32 row path's decoder; 40:
    wdequant, the prefill path) is the base format's reference weights exactly."""
    _skip_unless_x16_runs(fmt)
    qt = random_weight(fmt, 32, 768, seed=M)
    assert torch.equal(_read_back(qt, M), qt.dequantize())
