"""Imports run one way, from the bottom up:

    formats -> kernels -> layers -> models -> loader -> engine
            -> {eval, quant tooling, server, cli, chat, the Python API}

Each lower package, with every one of its modules, must import with the packages above it
blocked (a meta-path hook that refuses them), so an upward import fails here rather than
hiding behind a lazy import. config, errors and heap are shared by all layers.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

LAYERS = ["qserve.formats", "qserve.kernels", "qserve.layers", "qserve.models",
          "qserve.loader", "qserve.engine"]
# the tools: offline quantization and evaluation, the server, the CLI and the Python API
TOOLS = ["qserve.eval", "qserve.quant", "qserve.server", "qserve.cli", "qserve.chat",
         "qserve.llm", "qserve.bench"]

_PROBE = textwrap.dedent("""
    import importlib, pkgutil, sys
    blocked = {blocked!r}

    class Block:
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in blocked):
                raise ImportError(f"{{name}} is above {{sys.argv[1]}}: upward import")
            return None

    sys.meta_path.insert(0, Block())
    pkg = importlib.import_module(sys.argv[1])
    for mod in pkgutil.iter_modules(pkg.__path__, sys.argv[1] + "."):
        if mod.name.split(".")[-1].startswith("triton_"):
            continue  # CUDA-only kernels need triton: test_no_lazy_upward_import parses them
        importlib.import_module(mod.name)
""")


def _blocked_above(package: str) -> list[str]:
    i = LAYERS.index(package)
    return LAYERS[i + 1:] + TOOLS


@pytest.mark.parametrize("package", LAYERS)
def test_package_imports_nothing_above_it(package):
    code = _PROBE.format(blocked=_blocked_above(package))
    r = subprocess.run([sys.executable, "-c", code, package], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-1500:]


@pytest.mark.parametrize("package", LAYERS)
def test_no_lazy_upward_import(package):
    """Function-level imports too (the runtime probe only sees module-level ones), and the
    Triton modules, which need triton to import: every import statement, parsed."""
    import ast
    import importlib
    from pathlib import Path

    blocked = _blocked_above(package)
    root = Path(importlib.import_module(package).__path__[0])
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not any(name == b or name.startswith(b + ".") for b in blocked), (
                    f"{package}: {path.name} imports {name}")


def test_the_probe_catches_an_upward_import(tmp_path):
    """A planted upward import (a kernels module importing the engine) fails the probe."""
    pkg = tmp_path / "fakeq"
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "bad.py").write_text("import fakeq.high\n")
    code = _PROBE.format(blocked=["fakeq.high"])
    r = subprocess.run([sys.executable, "-c", code, "fakeq.low"], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode != 0 and "upward import" in r.stderr


def test_the_repository_root_shadows_no_installed_package():
    """kernels/ (imported as qserve.kernels) is no regular package of its own: from the
    repository root (on sys.path under `python -m pytest` or a script that adds it), `import
    kernels` must still find Hugging Face's `kernels` distribution, which transformers 5
    imports, not this directory."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import importlib.util as u; s = u.find_spec('kernels'); "
            "print(s.origin if s and s.origin else '')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=root)
    assert r.returncode == 0, r.stderr
    assert not r.stdout.strip().startswith(str(root / "kernels")), r.stdout
