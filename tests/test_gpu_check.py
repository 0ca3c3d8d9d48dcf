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
