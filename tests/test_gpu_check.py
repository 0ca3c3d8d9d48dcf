"""scripts/gpu_check.py --tiny runs its whole path (tests, copy, GEMM, attention, KV write,
end-to-end decode) on CPU under Triton's interpreter, so the script is known to work before a
GPU ever runs it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parent.parent
HEADERS = ("## Kernel tests", "## Copy bandwidth", "## Dequant GEMV / GEMM",
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
        "error: unknown section(s) nope; choose from tests, copy, gemm, decode, prefill, e2e")
