"""The kernels a CPU without AVX-512 runs, checked on a CPU with it: QSERVE_CPU_ISA=avx2 builds
them without the 512-bit row kernels (and without AVX-VNNI, as a Zen 3), avx2-vnni keeps
AVX-VNNI for the int8 GEMM (as an Alder Lake), and the int8-activation, GEMM and
batch-invariance tests run against each build in a subprocess."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qserve.kernels import cpu_ops

ROOT = Path(__file__).resolve().parent.parent


def _isa(env_isa: str) -> str:
    """kernel_isa() and gemm_isa() of the QSERVE_CPU_ISA=env_isa build."""
    env = {**os.environ, "QSERVE_CPU_ISA": env_isa}
    out = subprocess.run([sys.executable, "-c", "from qserve.kernels import cpu_ops; "
                          "print(cpu_ops.kernel_isa(), cpu_ops.gemm_isa())"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_an_unknown_isa_is_refused(monkeypatch):
    monkeypatch.setenv("QSERVE_CPU_ISA", "avx9000")
    with pytest.raises(RuntimeError, match="QSERVE_CPU_ISA='avx9000'"):
        cpu_ops.cflags()


@pytest.mark.skipif(cpu_ops.kernel_isa() != "avx512-vnni",
                    reason="this CPU runs the AVX2 kernels already (no AVX-512 VNNI)")
def test_the_avx2_kernels_pass_the_kernel_tests():
    assert _isa("avx2") == "avx2 avx2"
    env = {**os.environ, "QSERVE_CPU_ISA": "avx2", "QSERVE_REQUIRE_KERNELS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-x",
         "tests/test_cpu_ops.py", "tests/test_cpu_formats.py", "-k",
         "int8 or batch or bit_for_bit or x16"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:]
    assert " passed" in res.stdout
    # skipped only what the AVX2 kernels do not run: int8 weights in the int8 GEMM
    skips = [line for line in res.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("does not take int8 weights" in line for line in skips), skips


@pytest.mark.skipif(cpu_ops.kernel_isa() != "avx512-vnni"
                    or "avx_vnni" not in cpu_ops.cpu_vendor_and_flags()[1],
                    reason="needs AVX-512 VNNI and AVX-VNNI (a CPU without AVX-512 runs its "
                           "own build's GEMM in the main suite)")
def test_the_avx_vnni_gemm_passes_the_kernel_tests():
    """The AVX2 kernels with the int8 GEMM in 256-bit vpdpbusd (AVX-VNNI): every format the
    GEMM takes, 8-bit codes whole (no planes), its own gemm_min_rows crossovers."""
    assert _isa("avx2-vnni") == "avx2 avx-vnni"
    env = {**os.environ, "QSERVE_CPU_ISA": "avx2-vnni", "QSERVE_REQUIRE_KERNELS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-x",
         "tests/test_cpu_formats.py", "-k", "int8 or gemm or batch or x16"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:]
    assert " passed" in res.stdout
