"""The GGML fused dequant-GEMM (kernels/triton_ggml.py) against the pure-torch reference,
F.linear(x, qt.dequantize().to(x.dtype), bias), computed exactly in fp64; for every format
read in place, decode and prefill row counts, odd N, one and two GGML blocks along K.

Without CUDA the kernel runs in Triton's CPU interpreter at small shapes; with CUDA the same
tests run on the GPU and add full-size cases.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# As in test_triton_kernels.py: TRITON_INTERPRET must be set before triton is first imported
# (its jit helpers are decorated then); if another module imported it first, this file reruns
# itself in a fresh interpreter (test_in_fresh_process) and skips here.
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
IMPORTED_TOO_LATE = (not ON_GPU and "triton" in sys.modules
                     and os.environ.get("TRITON_INTERPRET") != "1")
if not ON_GPU and not IMPORTED_TOO_LATE:  # too late: leave it unset, so later modules see it
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from qserve.formats import QuantizedTensor, ggml  # noqa: E402
from qserve.kernels.triton_ggml import ggml_matmul  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DTYPES = (F16, BF16, F32)


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


def _weight(name: str, N: int, K: int, seed: int) -> QuantizedTensor:
    rows = ggml.random_rows(name, N, K, torch.Generator().manual_seed(seed))
    return QuantizedTensor(name, rows.to(DEVICE), None, None, K)


def _check(out: torch.Tensor, x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None):
    """out (M, N) against x @ W^T + bias in fp64, W the reference weights in x's dtype."""
    dtype = x.dtype
    w = qt.dequantize().to(dtype).double()  # (N, K), what F.linear(x, W.to(dtype)) multiplies
    b = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device) if bias is None \
        else bias.double()
    ref = x.double() @ w.T + b
    sum_abs = x.double().abs() @ w.abs().T + b.abs()  # (M, N) sum of |terms|
    # The kernel forms the reference's weights (bit for bit in fp32, then rounded to dtype),
    # sums exact products in fp32 and rounds once to dtype:
    #   rounding the output    half an ulp, a whole one where the interpreter truncates bf16
    #                          -> eps(dtype) * |ref|
    #   fp32 summation order   < 1e-5 of the sum of |terms| over K <= 512 (fp32 x: each
    #                          product also rounded, 2^-24) -> 1e-5 * sum_abs
    #   bf16 in the interpreter  multiplied in fp32 (dot_dtype), weights not rounded to
    #                          bf16: each term off by up to half a bf16 ulp -> 2^-8 * sum_abs
    eps = torch.finfo(dtype).eps
    a = 1e-5 + (2 ** -8 if dtype == BF16 and not ON_GPU else 0.0)
    bound = eps * ref.abs() + a * sum_abs
    err = (out.double() - ref).abs()
    assert out.dtype == dtype and out.shape == ref.shape
    worst = (err / bound).max().item()
    assert worst <= 1, f"error {worst:.2f}x the bound (max abs error {err.max().item():.3g})"


# Every format over M {1, 5, 33} (decode split-K, decode, prefill tile), N {7, 19}, one and two
# GGML blocks along K; the x dtype cycles so each format meets each dtype.
CASES = []
for _f, _name in enumerate(ggml.IN_PLACE):
    for _i, (_M, _N, _nb) in enumerate((M, N, nb) for M in (1, 5, 33) for N in (7, 19)
                                       for nb in (1, 2)):
        CASES.append((_name, _M, _N, _nb, DTYPES[(_f + _i) % 3]))
if ON_GPU:
    CASES += [("q4_k", 1, 4096, 16, F16), ("q6_k", 16, 14336 // 7, 16, BF16),
              ("q5_0", 7, 4096, 128, F16), ("q3_k", 300, 769, 8, F16),
              ("q2_k", 32, 1000, 20, F32), ("q5_k", 257, 5125, 4, BF16),
              ("q5_1", 3, 83, 24, F32)]


@pytest.mark.parametrize("name,M,N,n_blocks,dtype", CASES)
def test_ggml_matmul(name, M, N, n_blocks, dtype):
    K = n_blocks * ggml.TYPES[name].block
    seed = M * 1000 + N * 10 + n_blocks
    torch.manual_seed(seed)
    qt = _weight(name, N, K, seed)
    x = torch.randn(M, 2 * K, device=DEVICE).to(dtype)[:, ::2]  # strided rows and columns
    bias = torch.randn(N, device=DEVICE).to(dtype)
    _check(ggml_matmul(x, qt, bias), x, qt, bias)


@pytest.mark.parametrize("name", ["q5_1", "q6_k"])
def test_ggml_matmul_split_k_strided_rows_no_bias(name):
    """Every other row of a bigger matrix (its row stride twice its width), no bias, and
    explicit split counts, which agree with one program along K."""
    K = 3 * ggml.TYPES[name].block
    torch.manual_seed(2)
    full = _weight(name, 22, K, seed=2)
    qt = QuantizedTensor(name, full.qweight[1::2], None, None, K)
    x = torch.randn(2, K, device=DEVICE)
    one = ggml_matmul(x, qt, split_k=1)
    _check(one, x, qt, None)
    for s in (2, 3):
        torch.testing.assert_close(ggml_matmul(x, qt, split_k=s), one, rtol=1e-5, atol=1e-5)


def test_mxfp4_every_exponent_reads_back_bit_for_bit():
    """MXFP4's E8M0 byte e from 0 to 252, each in a block of random codes: e = 0, 1 scale by
    the subnormals 2^-128, 2^-127 (from e = 253 a code of 12 overflows to inf, which an identity
    would turn into NaN: tests/test_ggml_formats.py has those against gguf-py). fp32 identity
    rows read the kernel's weights back, one product by 1.0 each (no tf32, fp32 sums of exact
    zeros), so they are ggml.py's weights bit for bit."""
    g = torch.Generator().manual_seed(39)
    blocks = torch.randint(0, 256, (256, 17), dtype=torch.uint8, generator=g)  # 64 rows x 4
    blocks[:, 0] = torch.randperm(256, generator=g).to(torch.uint8) % 253
    qt = QuantizedTensor("mxfp4", blocks.view(64, -1).to(DEVICE), None, None, 128)
    want = qt.dequantize()
    assert ((want != 0) & (want.abs() < torch.finfo(F32).tiny)).any()
    got = ggml_matmul(torch.eye(128, device=DEVICE), qt).T
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
