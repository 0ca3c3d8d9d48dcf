"""qserve's OpenMP spin count (qserve/__init__.py): libgomp reads GOMP_SPINCOUNT once, when it
is loaded, so qserve sets it only when it is imported before torch, and otherwise leaves it
unset and logs how to set it; a user's own setting is never touched. Each case runs in a fresh
interpreter, since this one has loaded torch already."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import logging, os, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="LOG %(name)s %(message)s")
{imports}
maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
print("GOMP_SPINCOUNT", os.environ.get("GOMP_SPINCOUNT"))
print("libgomp", "libgomp" in maps)
"""


def probe(imports: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    r = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)],
                       env=base | env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp: torch's Linux build")
def test_qserve_first_sets_the_spin_count_before_libgomp_loads():
    out = probe("import qserve, torch")
    assert "GOMP_SPINCOUNT 10000\n" in out and "libgomp True\n" in out
    assert "LOG qserve" not in out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp: torch's Linux build")
def test_torch_first_leaves_it_unset_and_says_how_to_set_it():
    out = probe("import torch, qserve")
    assert "GOMP_SPINCOUNT None\n" in out  # setting it now would claim what libgomp ignores
    logs = [line for line in out.splitlines() if line.startswith("LOG qserve ")]
    assert len(logs) == 1, out
    assert "could not be applied" in logs[0]
    assert "set GOMP_SPINCOUNT=10000 in the environment before Python starts" in logs[0]


@pytest.mark.parametrize("imports, var, value", [
    ("import qserve, torch", "GOMP_SPINCOUNT", "500"),
    ("import torch, qserve", "OMP_WAIT_POLICY", "active"),
])
def test_a_users_setting_wins_silently(imports, var, value):
    out = probe(imports, **{var: value})
    assert "LOG qserve" not in out
    expected = value if var == "GOMP_SPINCOUNT" else None
    assert f"GOMP_SPINCOUNT {expected}\n" in out
