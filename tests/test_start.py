"""What a user sees around the work (issue 20): the default KV pool sized from the workload,
progress only on a terminal, the status line, one-line errors for a missing extra and for
flags a command does not take, quantize's folded summary, and a suite that leaves the
user's home alone."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from qserve import cli, progress
from qserve.config import CacheConfig, ModelArchConfig
from qserve.engine import cache_engine
from qserve.engine.cache_engine import bytes_per_block, plan_num_blocks

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_135M = ModelArchConfig("llama", 49152, 576, 1536, 30, 9, 3, 64)
CPU = torch.device("cpu")


# ---- the default KV pool -----------------------------------------------------------------
@pytest.fixture
def free_8gib(monkeypatch):
    monkeypatch.setattr(cache_engine, "free_memory", lambda device: 8 << 30)


def test_default_pool_holds_max_num_seqs_sequences(free_8gib):
    cache = CacheConfig(block_size=16)  # watermark 0.01: admission keeps 1% of blocks free
    blocks, _ = plan_num_blocks(SMOLLM2_135M, cache, torch.float32, CPU, 512, max_num_seqs=1)
    assert blocks == 33  # ceil(32 blocks / 0.99)
    blocks, _ = plan_num_blocks(SMOLLM2_135M, cache, torch.float32, CPU, 512, max_num_seqs=4)
    assert blocks == 130  # ceil(128 / 0.99)
    assert int(blocks * cache.watermark) + 128 <= blocks  # 4 full sequences fit above it


def test_default_pool_is_capped_by_free_memory(free_8gib):
    cache = CacheConfig()
    per_block = bytes_per_block(SMOLLM2_135M, 16, torch.float32)
    blocks, _ = plan_num_blocks(SMOLLM2_135M, cache, torch.float32, CPU, 8192, max_num_seqs=256)
    assert blocks == int((8 << 30) * 0.1) // per_block  # 10% of free memory, not 256 x 8192
    no_seqs, _ = plan_num_blocks(SMOLLM2_135M, cache, torch.float32, CPU, 8192)
    assert no_seqs == blocks  # without max_num_seqs: the cap, as before


def test_layerwise_reserve_gets_room_too(free_8gib):
    cache = CacheConfig(kv_offload="layerwise", kv_offload_reserve=0.2)
    blocks, _ = plan_num_blocks(SMOLLM2_135M, cache, torch.float32, CPU, 512, max_num_seqs=1)
    assert blocks == 40  # 32 / 0.8


def test_an_explicit_budget_wins(free_8gib):
    per_block = bytes_per_block(SMOLLM2_135M, 16, torch.float32)
    cache = CacheConfig(kv_cache_memory=100 * per_block)
    blocks, _ = plan_num_blocks(SMOLLM2_135M, cache, torch.float32, CPU, 512, max_num_seqs=1)
    assert blocks == 100


class _Stop(Exception):
    pass


@pytest.mark.parametrize("args, sized", [
    (["generate", "-n", "3", "a", "b"], {"max_num_seqs": 6}),  # the completions asked for
    (["generate", "--max-num-seqs", "2", "a"], {"max_num_seqs": 2}),  # the flag wins
    (["chat"], {"max_num_seqs": 1}),  # one conversation
    (["bench", "--batch-sizes", "1,4", "--input-len", "8", "--output-len", "4"],
     {"max_num_seqs": 4, "max_model_len": 12}),  # the largest batch, input + output
    (["bench", "--batch-sizes", "2", "--max-model-len", "64"],
     {"max_num_seqs": 2, "max_model_len": 64}),
    (["serve"], {"max_num_seqs": None}),  # many clients: the config's 256, capped by memory
])
def test_each_command_sizes_the_default_pool_for_its_work(monkeypatch, args, sized):
    seen = {}

    def build(model, engine, **_):
        seen.update(engine)
        raise _Stop
    monkeypatch.setattr(cli, "_build_engine", build)
    r = CliRunner().invoke(cli.main, args, input="")
    assert isinstance(r.exception, _Stop), r.output
    assert {k: seen.get(k) for k in sized} == sized


# ---- progress only on a terminal -----------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("QSERVE_NO_PROGRESS", raising=False)
    assert progress.enabled(_Tty()) and not progress.enabled(io.StringIO())
    monkeypatch.setenv("QSERVE_NO_PROGRESS", "1")
    assert not progress.enabled(_Tty())


def test_spinner_draws_on_a_terminal_and_erases_itself(monkeypatch):
    monkeypatch.delenv("QSERVE_NO_PROGRESS", raising=False)
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    with progress.spinner("loading x"):
        pass
    text = tty.getvalue()
    assert "loading x" in text and text.endswith("\r\x1b[K")  # the line is cleared at the end
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    with progress.spinner("loading x"):
        pass
    assert piped.getvalue() == ""


def test_bar_is_silent_off_a_terminal_or_when_disabled(monkeypatch):
    monkeypatch.delenv("QSERVE_NO_PROGRESS", raising=False)
    for stream, disable in ((io.StringIO(), False), (_Tty(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        with progress.bar(3, "work", disable=disable) as b:
            b.update(3)
        assert stream.getvalue() == ""
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    with progress.bar(3, "work") as b:
        b.update(3)
    assert "work:   0%|" in tty.getvalue() and "0/3" in tty.getvalue()  # with its total


# ---- one-line errors ---------------------------------------------------------------------
@pytest.mark.parametrize("flag", [["--preemption-mode", "swap"], ["--no-prefix-caching"],
                                  ["--kv-offload", "layerwise"], ["--draft", "ngram"]])
def test_info_takes_no_flag_it_would_ignore(flag):
    r = CliRunner().invoke(cli.info, flag)
    assert r.exit_code == 2 and "No such option" in r.output


@pytest.mark.parametrize("flag", [["--max-model-len", "64"], ["--no-prefix-caching"],
                                  ["--max-num-seqs", "4"], ["--kv-offload", "layerwise"],
                                  ["--preemption-mode", "swap"], ["--swap-space", "0"]])
def test_eval_takes_no_flag_it_would_ignore(flag):
    r = CliRunner().invoke(cli.eval_, flag)
    assert r.exit_code == 2 and "No such option" in r.output


def test_serve_without_the_server_extra_is_one_line():
    """fastapi blocked as if not installed: one line naming the extra, before any model loads."""
    code = ("import sys, importlib.abc\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('fastapi', 'uvicorn'):\n"
            "            raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from qserve.cli import main\n"
            "main(['serve', 'no-such-model'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("error: qserve serve needs fastapi, uvicorn, from the 'server' extra: "
                        "pip install 'qserve[server]' (in a checkout: pip install -e "
                        "'.[server]')\n")


def test_chat_reads_lines_without_prompt_toolkit(monkeypatch):
    from qserve import chat

    monkeypatch.setitem(sys.modules, "prompt_toolkit", None)  # import fails: not installed
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or "hello")
    read = chat._line_reader()
    assert read() == "hello" and asked == [chat.PROMPT]


def test_chat_history_file(monkeypatch, tmp_path):
    from qserve.chat import history_path

    monkeypatch.setenv("QSERVE_CHAT_HISTORY", str(tmp_path / "h"))
    assert history_path() == tmp_path / "h"
    monkeypatch.setenv("QSERVE_CHAT_HISTORY", "")
    assert history_path() is None
    monkeypatch.delenv("QSERVE_CHAT_HISTORY")
    monkeypatch.setenv("QSERVE_HOME", str(tmp_path / "home"))
    assert history_path() == tmp_path / "home" / "chat_history"


# ---- quantize's summary --------------------------------------------------------------------
def test_quantize_summary_is_one_line_per_scheme():
    rows = ([{"scheme": "int4 g64 asym", "note": "", "bytes_fp16": 100, "bytes": 30}] * 200
            + [{"scheme": "int4 g64 asym", "note": "576 inputs: padded", "bytes_fp16": 10,
                "bytes": 4}] * 3
            + [{"scheme": "dense", "note": "kept by the recipe", "bytes_fp16": 7, "bytes": 7}])
    lines = cli._layer_summary(rows).splitlines()
    assert len(lines) == 4  # a header and three groups, not 204 rows
    assert re.match(r"\s+200  int4 g64 asym\s+20,000 ->\s+6,000\s*$", lines[1])
    assert re.match(r"\s+3  int4 g64 asym\s+30 ->\s+12  576 inputs: padded$", lines[2])
    assert re.match(r"\s+1  dense\s+7 ->\s+7  kept by the recipe$", lines[3])


def test_quantize_progress_counts_every_step_with_its_total():
    from types import SimpleNamespace

    from qserve.loader.hf_loader import expected_shapes
    from qserve.quant.quantize import plan_layers, quantize_weights
    from qserve.quant.recipe import load_recipe

    arch = ModelArchConfig("llama", 64, 32, 64, 3, 2, 1, 16, tie_word_embeddings=True)
    torch.manual_seed(0)
    loaded = SimpleNamespace(arch=arch, weights={
        n: torch.randn(s) for n, s in expected_shapes(arch).items()})
    recipe = load_recipe("w8")
    calls = []
    quantize_weights(loaded, recipe, plan_layers(arch, recipe),
                     progress=lambda label, total: calls.append((label, total)))
    assert calls == [("layer 0", 3), ("layer 1", 3), ("layer 2", 3)]


# ---- the status line ---------------------------------------------------------------------
def test_status_line(native_model):
    from qserve import LLM

    llm = LLM(loaded=native_model, max_model_len=256, max_num_seqs=2)
    line = cli.status_line(llm.engine)
    # 2 sequences x 16 blocks, over the 1% watermark: 33 blocks of 16 tokens, K/V in fp16
    # (a quantized model on a CPU)
    assert re.fullmatch(r"SmolLM2-135M-Instruct\.Q4_1\.gguf \(llama, 135M params\) · cpu fp32 · "
                        r"\d+ threads? · KV fp16 528 tokens \(12 MiB\) · context 256 of 8,192 "
                        r"tokens", line), line
    # no --max-model-len, and a budget short of the model's 8,192 tokens: the context it got
    llm = LLM(loaded=native_model, kv_cache_memory=f"{100 * 23040 * 16 // 1024}KiB")
    assert cli.status_line(llm.engine).endswith(
        " · KV fp16 1,600 tokens (35 MiB) · context 1,600 of 8,192 tokens")


# ---- the suite leaves the user alone -------------------------------------------------------
def test_the_suite_uses_a_repository_home():
    home = Path(os.environ["QSERVE_HOME"])
    assert home == Path(os.environ.get("QSERVE_TEST_HOME") or REPO / ".cache" / "qserve")
    assert os.environ["QSERVE_CHAT_HISTORY"] == ""  # no REPL history unless a test names one


@pytest.mark.slow
def test_commands_leave_the_users_home_untouched(tmp_path, default_model_path):
    """generate and piped chat with HOME pointed at an empty directory (and no
    XDG_CACHE_HOME): everything they keep goes to QSERVE_HOME, nothing to HOME."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME",)}
    env |= {"HOME": str(home), "QSERVE_NO_PROGRESS": "1"}
    runs = [(["generate", "-m", str(default_model_path), "--max-tokens", "2", "Hi"], None),
            (["chat", str(default_model_path), "--max-tokens", "2"], "Hi\n")]
    for args, stdin in runs:
        r = subprocess.run([sys.executable, "-m", "qserve", *args, "--max-model-len", "64"],
                           input=stdin, capture_output=True, text=True, env=env, cwd=REPO,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        assert re.search(r"^qserve: SmolLM2-135M-Instruct\.Q4_1\.gguf .* KV fp16 \d+ tokens",
                         r.stderr, re.M), r.stderr
    assert [p.relative_to(home) for p in home.rglob("*")] == []
