"""The `qserve` command line: user errors are one line and exit 2 (fast, in-process, no model);
the real commands run as `python -m qserve` on the default model (slow)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from qserve import cli
from qserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

REPO = Path(__file__).resolve().parent.parent

LIGHT = ["--max-model-len", "512", "--kv-cache-memory", "256MiB"]


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(cli.main, list(args), input=input)


def assert_user_error(result, *needles: str) -> str:
    """Exit 2 with exactly one line, `error: ...`, naming what was wrong; no traceback. An
    error found once the model is loaded (a prompt too long for it) follows the start's status
    line, `qserve: MODEL ...`, which is all else that may be printed."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    if len(lines) == 2 and lines[0].startswith("qserve: "):
        lines = lines[1:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


# ---- argument errors: caught before any model is loaded ----------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--max-tokens", "0"], "max_tokens=0"),
    (["--temperature", "-1"], "temperature=-1"),
    (["--top-p", "0"], "top_p=0"),
    (["--top-p", "1.5"], "top_p=1.5"),
    (["--device", "tpu"], "'tpu'"),
    (["--kv-cache-memory", "lots"], "'lots'"),
    (["--block-size", "3"], "--block-size=3"),
    (["--n", "0"], "n=0"),
    (["--kv-offload", "always"], "'always'"),
    (["--kv-offload-lookahead", "0"], "--kv-offload-lookahead=0"),
    (["--kv-offload-reserve", "1.5"], "--kv-offload-reserve=1.5"),
])
def test_generate_rejects_bad_flag(args, needle):
    assert_user_error(invoke("generate", "hello", *args), needle)


def _engine_spy(monkeypatch) -> dict:
    """cli._build_engine replaced by one that records its model and KV sizing, then stops the
    command with a user error: what generate would have loaded, without loading it."""
    seen = {}

    def spy(model, engine, on=None):
        seen.update(model=model, max_num_seqs=engine.get("max_num_seqs"))
        raise cli.QServeError("stopped before loading")

    monkeypatch.setattr(cli, "_build_engine", spy)
    return seen


def test_generate_takes_a_first_prompt_naming_a_model(monkeypatch, tmp_path):
    seen = _engine_spy(monkeypatch)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert_user_error(invoke("generate", str(gguf), "hello"), "stopped before loading")
    assert seen == {"model": str(gguf), "max_num_seqs": 1}  # one prompt left: "hello"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert_user_error(invoke("generate", str(hf), "a", "b"), "stopped before loading")
    assert seen == {"model": str(hf), "max_num_seqs": 2}
    # with --model, or when it is not one word naming a model, a first prompt is text
    assert_user_error(invoke("generate", "-m", "x", str(gguf), "hi"), "stopped before loading")
    assert seen == {"model": "x", "max_num_seqs": 2}
    for text in (f"{gguf} is a file", str(tmp_path), "hello"):
        assert_user_error(invoke("generate", text), "stopped before loading")
        assert seen == {"model": None, "max_num_seqs": 1}


def test_generate_first_prompt_naming_a_missing_gguf_is_a_model_error():
    assert_user_error(invoke("generate", "no/such/model.gguf", "hello"),
                      "'no/such/model.gguf' does not exist")


def test_unknown_model_alias():
    assert_user_error(invoke("generate", "hello", "--model", "no-such-model"), "no-such-model")
    assert_user_error(invoke("info", "no-such-model"), "no-such-model")
    assert_user_error(invoke("pull", "no-such-model"), "no-such-model")


@pytest.mark.parametrize("source", ["config.json", "gguf"])
def test_unsupported_architecture_is_one_line(source, tmp_path):
    """A model of an architecture qserve does not run is refused before any weight is read,
    in one line that lists the architectures it runs (a GGUF's llama.cpp names)."""
    from qserve.models.registry import FAMILIES, supported

    if source == "config.json":
        (tmp_path / "config.json").write_text(json.dumps(
            {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}))
        model = tmp_path
        needle = f"model_type 'deepseek_v3' is not supported; qserve runs {', '.join(supported())}"
    else:
        import gguf

        model = tmp_path / "gpt2.gguf"
        writer = gguf.GGUFWriter(str(model), "gpt2")  # the header alone: no tensor is needed
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        names = dict.fromkeys(n for f in FAMILIES for n in f.gguf_architectures)
        needle = f"architecture 'gpt2' is not supported; qserve reads {', '.join(names)} GGUFs"
    line = assert_user_error(invoke("generate", "hi", "--model", str(model)), needle)
    assert str(model) in line


def test_empty_prompt():
    assert_user_error(invoke("generate", ""), "empty")


def test_no_prompt_at_all():
    assert_user_error(invoke("generate", input=""), "no prompt")


def test_binary_stdin_is_a_one_line_error():
    result = CliRunner().invoke(cli.main, ["generate"], input=bytes(range(128, 256)) * 8)
    assert_user_error(result, "stdin is not UTF-8 text")


def test_missing_prompts_file(tmp_path):
    missing = str(tmp_path / "nope.txt")
    assert_user_error(invoke("generate", "--prompts-file", missing), "nope.txt")


def test_bad_batch_sizes():
    assert_user_error(invoke("bench", "--batch-sizes", "1,zero"), "1,zero")
    assert_user_error(invoke("bench", "--batch-sizes", "0"), "'0'")


def test_unknown_command_and_flag():
    assert_user_error(invoke("nosuch"), "nosuch")
    assert_user_error(invoke("generate", "--tempurature", "1", "hi"), "--tempurature")


# ---- prompt plumbing and Ctrl-C, against a stand-in engine --------------------------------
class FakeEngine:
    """Finishes every request in one step with the text "ok"; or raises Ctrl-C mid-run."""

    tokenizer = None

    def __init__(self, interrupt: bool = False):
        self.interrupt, self.queued, self.prompts, self.aborted = interrupt, [], [], []

    def add_request(self, rid, prompt, params, prompt_token_ids=None):
        self.queued.append(rid)
        self.prompts.append(prompt)

    def step(self):
        if self.interrupt:
            raise KeyboardInterrupt
        done, self.queued = self.queued, []
        return [RequestOutput(rid, None, [7, 8], [CompletionOutput(0, "ok", [5, 6], "stop",
                                                                   delta_text="ok")],
                              True, RequestMetrics(0.0, None, 0.5, 1.5)) for rid in done]

    def abort(self, rid):
        self.aborted.append(rid)


@pytest.fixture
def fake(monkeypatch):
    engine = FakeEngine()
    monkeypatch.setattr(cli, "_build_engine", lambda model, opts: engine)
    return engine


def test_prompts_from_stdin_and_file(fake, tmp_path):
    result = invoke("generate", "--json", input="first\n\n  \nsecond\n")
    assert result.exit_code == 0, result.output
    assert fake.prompts == ["first", "second"]
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["prompt_index"] for r in rows] == [0, 1]
    assert rows[0]["ttft_s"] == 0.5 and rows[0]["decode_tokens_per_s"] == 1.0
    f = tmp_path / "prompts.txt"
    f.write_text("a\n\nb\n")
    fake.prompts.clear()
    assert invoke("generate", "x", "--prompts-file", str(f)).exit_code == 0
    assert fake.prompts == ["x", "a", "b"]


def test_ctrl_c_aborts_requests_and_exits_130(fake):
    fake.interrupt = True
    result = invoke("generate", "one", "two")
    assert result.exit_code == 130
    assert "Traceback" not in result.output
    assert sorted(fake.aborted) == ["cli-0", "cli-1"]


# ---- errors that need the model: in-process, with the session's loaded model ---------------
@pytest.fixture
def real(monkeypatch, loaded_model):
    import qserve.loader

    monkeypatch.setattr(qserve.loader, "load_model", lambda spec=None, native=True: loaded_model)


@pytest.mark.slow
def test_kv_budget_too_small_for_one_sequence(real):
    line = assert_user_error(invoke("generate", "hello", "--kv-cache-memory", "1MiB",
                                    "--max-model-len", "512"))
    assert "--kv-cache-memory" in line and "--max-model-len" in line


@pytest.mark.slow
def test_flags_past_what_the_machine_or_a_run_holds(real):
    """Values a flag's type accepts but no run can hold (found feeding huge numbers to every
    flag): a swap pool past the machine's memory (its allocation had overflowed in torch),
    more samples than --max-num-seqs (the forks had looped) and a bench batch of 10**20
    prompts (it had hung making them)."""
    huge = "99999999999999999999"
    assert_user_error(invoke("generate", "hello", "--swap-space", huge, *LIGHT),
                      "--swap-space=", "is more than this machine's")
    assert_user_error(invoke("generate", "hello", "--n", huge, *LIGHT),
                      f"n={huge} is more than --max-num-seqs=256")
    assert_user_error(invoke("bench", "--batch-sizes", f"1,{huge}"),
                      f"a batch of {huge} prompts is more than bench runs (at most 65,536)")


@pytest.mark.slow
def test_prompt_longer_than_max_model_len(real):
    assert_user_error(invoke("generate", "word " * 100, "--max-model-len", "32",
                             "--kv-cache-memory", "64MiB"), "--max-model-len is 32")


# ---- the real thing, as a user runs it -----------------------------------------------------
def qserve(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qserve", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_generate_json_two_prompts():
    proc = qserve("generate", "The capital of France is", "def add(a, b):", "--json",
                  "--temperature", "0", "--max-tokens", "8", *LIGHT)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt_index"] for r in rows] == [0, 1]
    for r in rows:
        assert {"text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason",
                "ttft_s", "decode_tokens_per_s"} <= set(r)
        assert r["completion_tokens"] == len(r["token_ids"])
        assert r["completion_tokens"] == 8 or r["finish_reason"] == "stop"
        assert r["prompt_tokens"] > 0 and r["ttft_s"] > 0


@pytest.mark.slow
def test_generate_streams_one_prompt():
    proc = qserve("generate", "The capital of France is", "--temperature", "0",
                  "--max-tokens", "6", *LIGHT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and proc.stdout.endswith("\n")
    assert "Paris" in proc.stdout


@pytest.mark.slow
def test_info_json():
    proc = qserve("info", "--json", *LIGHT)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"] == "llama"
    assert info["num_layers"] == 30 and info["num_heads"] == 9 and info["num_kv_heads"] == 3
    assert info["head_dim"] == 64 and info["context_length"] == 8192
    # K and V, 30 layers, 3 kv heads of 64 dims
    # int8: 64 values + an fp16 scale per head-token; int4: keys 4 bits a value (32 bytes)
    # and an fp16 t, values 4-bit codes (32 bytes) with an fp16 scale and offset
    assert info["kv_bytes_per_token"] == {"fp32": 46080, "fp16": 23040, "bf16": 23040,
                                          "int8": 11880, "int4": 6300}
    assert info["kv_tokens_per_gib"]["int4"] >= 3.5 * info["kv_tokens_per_gib"]["fp16"]
    assert info["kv_tokens"]["fp32"] == 256 * 2**20 // (46080 * 16) * 16
    assert info["max_model_len"] == 512  # LIGHT's
    # what runs, never "auto": fp32 activations, K/V in fp16 for a quantized file on a CPU
    assert (info["dtype"], info["kv_dtype"]) == ("fp32", "fp16")
    assert info["weight_bytes"]["fp16"] == 2 * info["num_params"]
    assert 0 < info["file_bytes"] < info["weight_bytes"]["fp16"]  # Q4_1 on disk


@pytest.mark.slow
def test_info_json_shows_the_context_a_budget_fits():
    """No --max-model-len: the model's 8,192 tokens do not fit 32 MiB of fp16 KV, so the run
    (and info, which says so) gets the blocks that do."""
    proc = qserve("info", "--json", "--kv-cache-memory", "32MiB")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["kv_dtype"] == "fp16"
    assert info["max_model_len"] == info["kv_tokens"]["fp16"] == 32 * 2**20 // (23040 * 16) * 16


@pytest.mark.slow
def test_bench_json():
    proc = qserve("bench", "--batch-sizes", "1,2", "--input-len", "16", "--output-len", "8",
                  "--json", *LIGHT)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert 0 < r["ttft_p50_s"] and 0 < r["tpot_mean_s"]
        assert r["peak_rss_mib"] > 0 and r["preemptions"] == 0
        assert (r["dtype"], r["kv_dtype"]) == ("fp32", "fp16")
