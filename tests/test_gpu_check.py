"""scripts/gpu_check.py --tiny runs its whole path (tests, copy, tuning, GEMM, attention, KV
write, end-to-end decode) on CPU under Triton's interpreter, so the script is known to work before a
GPU ever runs it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parent.parent
HEADERS = ("## Kernel tests", "## Copy bandwidth", "## Tune `dequant_matmul`",
           "## Dequant GEMV / GEMM",
           "## Paged attention, decode", "## Prefill attention", "## End-to-end decode",
           "| K x N | M | weights |", "| batch | context | KV |", "| weights | KV | batch |")


def test_gpu_check_tiny():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--tiny"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    for header in HEADERS:
        assert header in r.stdout, header
    assert "All sections ran." in r.stdout


def test_gpu_check_sections_deadline_and_verdict():
    """--sections runs only those (and the copy they are measured against); --deadline 0
    starts none; the run ends with a go / no-go line; a bad section name is a one-line error."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = str(REPO / "scripts" / "gpu_check.py")
    r = subprocess.run([sys.executable, script, "--tiny", "--sections", "gemm"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "## Dequant GEMV / GEMM" in r.stdout and "## Copy bandwidth" in r.stdout
    assert "## Kernel tests" not in r.stdout and "## Paged attention" not in r.stdout
    assert "| gemm | ok |" in r.stdout and r.stdout.rstrip().endswith("**GO**")
    r = subprocess.run([sys.executable, script, "--tiny", "--deadline", "0"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "| tests | skipped (deadline) |" in r.stdout
    assert "## Dequant" not in r.stdout
    r = subprocess.run([sys.executable, script, "--tiny", "--sections", "gemm,nope"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: unknown section(s) nope; choose from tests, copy, tune, gemm, decode, prefill, "
        "e2e")


def test_gpu_check_tune_writes_a_table_the_kernel_reads(tmp_path):
    """The tune section's table (in the interpreter: a few configurations, times that mean
    nothing) is one dequant_matmul reads back: every entry a valid configuration."""
    import json

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--tiny",
                        "--sections", "tune", "--tune-out", str(tmp_path)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "| tune | ok |" in r.stdout and "(picked)" in r.stdout
    table = tmp_path / "cpu-interpreter.json"  # the device name made a file name
    data = json.loads(table.read_text())
    assert data["device"] == "cpu (interpreter)"
    # read back in a subprocess: importing triton here, before the Triton test modules set
    # TRITON_INTERPRET, would send them to their fresh-process fallback
    code = ("import json, sys; from qserve.kernels.triton_dequant_gemm import GemmConfig, "
            "_tuned_table; t = _tuned_table('cpu (interpreter)', sys.argv[1]); "
            "d = json.load(open(sys.argv[1]))['dequant_matmul']; "
            "assert t == {k: GemmConfig(**v) for k, v in d.items()}, t; print(len(t))")
    r = subprocess.run([sys.executable, "-c", code, str(table)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == str(len(data["dequant_matmul"])), \
        r.stderr[-2000:]


def test_gpu_check_compiles_every_kernel_for_sm90():
    """--compile-only runs the wrappers with each launch compiled for sm_90 (the launcher's
    specialization, ptxas from Triton's wheel), no GPU: what the interpreter lets pass but a
    GPU's compiler rejects (a jit function whose returns disagree in shape, say) fails here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--compile-only"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| _")]
    assert any("SWAP_AB=True" in row and "BLOCK_M=64" in row for row in rows)
    assert any(row.startswith("| _ggml_matmul_kernel") and "FORMAT=q4_k" in row for row in rows)
    assert {row.split(" | ")[0][2:] for row in rows} >= {
        "_dequant_matmul_kernel", "_ggml_matmul_kernel", "_decode_kernel", "_prefill_kernel",
        "_kv_write_kernel"}
