"""The memory planner: weights counted from the file's header in the formats they will be
resident in, the KV pools and activations, checked against what is free before any weight is
read; a plan that does not fit is one line naming what would."""
from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner

from qserve import cli
from qserve.config import engine_config
from qserve.engine.memory_plan import plan_memory, resolve_kv_dtype
from qserve.errors import ConfigError
from qserve.loader import load_arch, load_model
from qserve.models.registry import num_params

GiB = 1 << 30


def _plan(path, available, native=True, dtype=torch.float32, kv=64 << 20, **options):
    options = {"max_num_batched_tokens": 512, "max_num_seqs": 8} | options
    config = engine_config(str(path), weights="native" if native else "dense", **options)
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


def test_cpu_scratch_is_the_kernels_buffer(default_model_path, monkeypatch):
    """The plan's prefill scratch is the size of the buffer the CPU kernels keep after a
    prefill of more than FUSED_MAX_ROWS tokens: the largest stacked segment (gate/up)."""
    from qserve.kernels import cpu_ops
    from qserve.llm import LLM
    from qserve.sampling_params import SamplingParams

    if cpu_ops.lib() is None:
        pytest.skip("no C compiler: the CPU kernels (and their scratch) are not built")
    monkeypatch.setattr(cpu_ops._local, "buf", None, raising=False)
    llm = LLM(str(default_model_path), max_model_len=256, max_num_seqs=1,
              kv_cache_memory="16MiB")
    plan = llm.engine.memory_plan
    arch = llm.engine.arch
    if cpu_ops.int8_activations() and cpu_ops.int8_gemm():  # no matrix is dequantized whole
        assert plan.scratch_bytes == 0
        llm.generate([list(range(100, 180))], SamplingParams(max_tokens=1))
        assert getattr(cpu_ops._local, "buf", None) is None
        return
    itemsize = 2 if cpu_ops.int8_activations() and cpu_ops.fast_bf16() else 4
    assert plan.scratch_bytes == 2 * arch.intermediate_size * arch.hidden_size * itemsize
    llm.generate([list(range(100, 180))], SamplingParams(max_tokens=1))
    assert cpu_ops._local.buf.numel() == plan.scratch_bytes


def test_auto_kv_dtype_follows_the_weights_precision(default_model_path, hf_dir, native_model,
                                                     loaded_model, tmp_path, monkeypatch):
    """--kv-dtype auto on a CPU: fp16 K/V where the weights are kept below fp32 and the
    activations approximated; fp32 where the weights are fp32 (a dense load, an fp32
    checkpoint) or QSERVE_CPU_ACTIVATIONS=fp32 keeps the activations exact; a --kv-dtype or a
    recipe's kv_dtype as named."""
    import dataclasses

    from safetensors.torch import save_file

    monkeypatch.delenv("QSERVE_CPU_ACTIVATIONS", raising=False)
    half, full = torch.float16, torch.float32

    def kv(path, loaded=None, **flags):
        config = engine_config(str(path), device="cpu", **flags)
        return resolve_kv_dtype(path, load_arch(path), config, loaded)

    gguf = default_model_path  # Q4_1 / Q8_0
    assert kv(gguf) == half
    assert kv(gguf, weights="dense") == full
    assert kv(gguf, kv_dtype="fp32") == full and kv(gguf, kv_dtype="int8") == torch.int8
    assert kv(gguf, dataclasses.replace(native_model, quant={"kv_dtype": "int4"})) == torch.uint8
    # weights already in memory decide by what they are
    assert kv(gguf, native_model) == half
    assert kv(gguf, loaded_model) == full
    # a safetensors checkpoint by its headers: fp32 stays fp32, fp16 matrices give fp16
    assert kv(hf_dir) == full
    f16_dir = tmp_path / "f16"
    f16_dir.mkdir()
    (f16_dir / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    arch = load_arch(hf_dir)
    last = arch.num_layers - 1  # (the config's layer count must match the weights')
    save_file({f"model.layers.{last}.mlp.down_proj.weight":
               torch.zeros(arch.hidden_size, arch.intermediate_size, dtype=torch.float16)},
              str(f16_dir / "model.safetensors"))
    assert kv(f16_dir) == half
    monkeypatch.setenv("QSERVE_CPU_ACTIVATIONS", "fp32")
    assert kv(gguf) == full and kv(f16_dir) == full


def test_host_pool_counts_only_where_blocks_can_move_there(default_model_path):
    recompute = _plan(default_model_path, 64 * GiB)
    swap = _plan(default_model_path, 64 * GiB, preemption_mode="swap")
    assert recompute.host_kv_bytes == 0 and swap.host_kv_bytes == 1 * GiB
    assert swap.total_bytes - recompute.total_bytes == 1 * GiB


def test_logits_over_32_sequences_count_the_output_matrix(default_model_path, monkeypatch):
    """The tied embedding is the output matrix: dequantized a block of rows at a time when a
    step takes more than FUSED_MAX_ROWS rows of logits (sequences, or their drafts verified),
    so the scratch grows from gate/up's 3,072 rows to a block of the 49,152-row output matrix
    (on CPUs whose prefill dequantizes: the int8 GEMM's machines keep no buffer for int4)."""
    from qserve.kernels import cpu_ops

    monkeypatch.setattr(cpu_ops, "int8_gemm", lambda: False)
    arch = load_arch(default_model_path)
    h = arch.hidden_size
    few = _plan(default_model_path, 64 * GiB)  # 8 sequences
    many = _plan(default_model_path, 64 * GiB, max_num_seqs=64)
    itemsize = few.scratch_bytes // (2 * arch.intermediate_size * h)
    assert itemsize in (2, 4) and few.scratch_bytes == 2 * arch.intermediate_size * h * itemsize
    rows = cpu_ops.block_rows(h, itemsize)
    assert 2 * arch.intermediate_size < rows < arch.vocab_size
    assert many.scratch_bytes == rows * h * itemsize
    # 8 sequences verifying 4 drafts each: 40 logit rows a step
    spec = _plan(default_model_path, 64 * GiB, draft="ngram", num_speculative_tokens=4)
    assert spec.scratch_bytes == many.scratch_bytes


def test_a_step_of_many_short_sequences_fills_the_token_budget(default_model_path):
    """A step's activations are planned for the tokens it can hold: several sequences' prompt
    chunks share --max-num-batched-tokens, so a context shorter than the budget bounds it only
    with one sequence (32 prompts of 128 tokens fill a 512-token step: the plan had counted
    128, and a 32 x 128 prefill of the 8B shape peaked 6% above it)."""
    from qserve.engine.memory_plan import activation_bytes

    arch = load_arch(default_model_path)

    def plan(seqs: int):
        config = engine_config(str(default_model_path), max_num_batched_tokens=512,
                               max_num_seqs=seqs)
        return plan_memory(default_model_path, arch, config, device=torch.device("cpu"),
                           dtype=torch.float32, kv_bytes=64 << 20, host_kv_bytes=0,
                           max_model_len=128, available_bytes=64 * GiB)
    assert plan(1).activation_bytes == activation_bytes(arch, 128, 128, 1, cpu=True)
    assert plan(3).activation_bytes == activation_bytes(arch, 384, 128, 3, cpu=True)
    assert plan(32).activation_bytes == activation_bytes(arch, 512, 128, 32, cpu=True)
    assert plan(1).activation_bytes < plan(3).activation_bytes < plan(32).activation_bytes


def test_plan_is_the_measured_peak(default_model_path, tmp_path):
    """`qserve generate` with a prompt that fills a prefill step peaks near the plan (its
    terms were measured on the 1B and 8B shapes, README); the old flat figures were 2-3x."""
    import subprocess
    import sys

    flags = ["--max-model-len", "1024", "--max-num-batched-tokens", "1024",
             "--max-num-seqs", "1"]
    prompt = "The quick brown fox jumps over the lazy dog. " * 90  # ~900 tokens
    # The child's own peak is its VmHWM, read as it exits. Neither RUSAGE_CHILDREN (the largest
    # child ever reaped) nor wait4's ru_maxrss works here: Linux folds the parent's high-water
    # mark into a child's maxrss at exec, and this pytest process is several GB by now.
    run = ("import atexit, re, sys\n"
           "def _hwm():\n"
           "    s = open('/proc/self/status').read()\n"
           "    sys.stderr.write('VmHWM_KIB=' + re.search(r'VmHWM:\\s+(\\d+)', s)[1] + '\\n')\n"
           "atexit.register(_hwm)\n"
           "sys.argv[0] = 'qserve'\n"
           "from qserve.cli import main; main()\n")
    r = subprocess.run([sys.executable, "-c", run, "generate", "-m", str(default_model_path),
                        *flags, "--max-tokens", "2", "--temperature", "0", prompt],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    hwm = re.findall(r"VmHWM_KIB=(\d+)", r.stderr)
    assert len(hwm) == 1, r.stderr[-500:]
    peak = int(hwm[0]) * 1024
    out = CliRunner().invoke(cli.main, ["info", str(default_model_path), "--json", *flags])
    plan = json.loads(out.output)["memory_plan"]["total_bytes"]
    print(f"plan {plan >> 20} MiB, peak {peak >> 20} MiB")
    assert 0.85 < plan / peak < 1.2, (plan >> 20, peak >> 20)
