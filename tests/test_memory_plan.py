"""The memory planner: weights counted from the file's header in the formats they will be
resident in, the KV pools and activations, checked against what is free before any weight is
read; a plan that does not fit is one line naming what would."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from qserve import cli
from qserve.config import engine_config
from qserve.engine.memory_plan import plan_memory
from qserve.errors import ConfigError
from qserve.loader import load_arch, load_model
from qserve.models.registry import num_params

GiB = 1 << 30


def _plan(path, available, native=True, dtype=torch.float32, kv=64 << 20, **options):
    config = engine_config(str(path), weights="native" if native else "dense",
                           max_num_batched_tokens=512, max_num_seqs=8, **options)
    return plan_memory(path, load_arch(path), config, device=torch.device("cpu"), dtype=dtype,
                       kv_bytes=kv, host_kv_bytes=1 << 30, max_model_len=2048,
                       available_bytes=available)


def test_native_weights_counted_as_they_will_be_resident(default_model_path):
    """The plan's weight bytes are exactly the bytes of the model's tensors once loaded."""
    plan = _plan(default_model_path, 64 * GiB)
    loaded = load_model(default_model_path)
    resident = sum(w.nbytes if hasattr(w, "format") else w.numel() * w.element_size()
                   for w in (loaded.weights[n] for n in loaded.weights))
    assert plan.weight_bytes == resident
    assert set(plan.weight_formats) == {"int4", "int8", "f32"}  # Q4_1, Q8_0 repacked; norms
    dense = _plan(default_model_path, 64 * GiB, native=False)
    assert dense.weight_bytes == 4 * num_params(load_arch(default_model_path))
    assert plan.weight_bytes < dense.weight_bytes / 5


def test_a_plan_that_does_not_fit_says_what_would(default_model_path):
    plan = _plan(default_model_path, 1 * GiB, kv=4 * GiB)
    with pytest.raises(ConfigError) as e:
        plan.check()
    msg = str(e.value)
    assert "\n" not in msg and "needs" in msg and "available" in msg and "--kv-cache-memory" in msg
    _plan(default_model_path, 8 * GiB, kv=1 * GiB).check()  # fits: no error


def test_engine_refuses_before_reading_weights(default_model_path, monkeypatch):
    """An impossible KV budget is refused by the planner, before the loader reads a tensor."""
    import qserve.loader.gguf_loader as gl

    def no_read(*a, **k):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(gl.GGUFFile, "read", no_read)
    result = CliRunner().invoke(cli.main, ["generate", "--kv-cache-memory", "1TiB", "hi"])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert line.startswith("error: ") and "needs" in line and len(line.splitlines()) == 1


def test_info_prints_the_plan(default_model_path):
    out = CliRunner().invoke(cli.main, ["info", str(default_model_path), "--json",
                                        "--kv-cache-memory", "64MiB"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)
    assert info["gguf_types"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert info["weight_formats"]["int4"]["tensors"] == 210
    plan = info["memory_plan"]
    assert plan["fits"] and plan["kv_bytes"] <= 64 << 20
    assert plan["weight_bytes"] == info["weight_bytes"]["resident"]
