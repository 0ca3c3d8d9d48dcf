"""Every shell and Python example in README.md, run as written on the default model with small
sizes, or, where it needs a server, a placeholder path or minutes, checked to parse (the
reason is listed with it). A README example with no entry in EXAMPLES fails here: add one.

A shell example is one line of a ```sh block (without its trailing # comment); `qserve` and
`python` in it are this interpreter's. They run in one shared working directory, in README
order, so `qserve generate -m smol-w8` finds the checkpoint the line before it wrote.
The examples that run use the default model, so they are `slow` (conftest marks them); the
check that every example has a rule is fast.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from qserve import cli

REPO = Path(__file__).resolve().parent.parent
SMALL_CHAT = " --max-tokens 4 --max-model-len 256"
SMALL_GEN = " --max-tokens 4"


@dataclass(frozen=True)
class Run:
    """Run the example, with `small` appended and each (old, new) of `replace` applied;
    `stdin` is fed to it. `fails`: a regex its stderr must match, exiting 2."""
    small: str = ""
    replace: tuple[tuple[str, str], ...] = ()
    stdin: str | None = None
    fails: str | None = None
    setup: str | None = None  # a command run first when its output is missing (-k runs)


@dataclass(frozen=True)
class Parse:
    """Only check that it parses: every `qserve` command's flags by click, every script's
    --help, every pip extra named exists. `why` says why it is not run."""
    why: str
    engine_check: bool = False  # a serve line: also run its engine flags through generate


SMOL_W8 = "qserve quantize smollm2-135m-instruct -o smol-w8 --recipe w8"

EXAMPLES: dict[str, Run | Parse] = {
    # Quick start and the test commands
    "pip install torch==2.13.0 && pip install -e '.[server]' && qserve chat":
        Parse("installs packages into the environment (the suite runs in one installed so)"),
    "pip install torch==2.13.0 && pip install -e '.[test,server,cluster,export]' && python -m pytest -q":
        Parse("installs packages, then is the whole suite, this test included"),
    'python -m pytest -q -m "not slow"': Parse("the fast part of the suite running this test"),
    # Using it
    'qserve chat --system "You are terse."': Run(SMALL_CHAT, stdin="Hi\n"),
    'echo "What is 2+2?" | qserve chat': Run(SMALL_CHAT),
    "qserve serve --port 8000 --api-key sk-local":
        Parse("a server that runs until stopped (tests/test_server.py serves for real)",
              engine_check=True),
    "qserve serve --replicas 2 --replica-cpus 4 --kv-cache-memory 2GiB":
        Parse("a Ray Serve deployment that runs until stopped (tests/test_cluster.py deploys "
              "one)"),
    "python scripts/bench_routing.py":
        Parse("a benchmark: two deployments of 2 replicas, minutes on a CPU"),
    "python scripts/bench_routing.py --seed 1":
        Parse("a benchmark: two deployments of 2 replicas, minutes on a CPU"),
    "qserve pull": Run(),
    "qserve info --json": Run(),
    'qserve generate "Once upon a time"': Run(SMALL_GEN),
    'qserve generate model.gguf "Once upon a time"':
        Run(SMALL_GEN, setup="ln -s \"$(python -c 'from qserve.loader.registry import "
                             "resolve_model as r; print(r(None))')\" model.gguf"),
    "qserve generate --prompts-file prompts.txt --json --temperature 0":
        Run(SMALL_GEN, setup="printf 'Hello\\nThe sky is\\n' > prompts.txt"),
    "qserve bench --batch-sizes 1,8,32 --input-len 128 --output-len 128":
        Run(replace=(("1,8,32", "1,2"), ("--input-len 128", "--input-len 8"),
                     ("--output-len 128", "--output-len 4"))),
    # Models, precision and memory
    "python scripts/bench_quantize_memory.py ~/.cache/qserve-bench/llama-3.1-8b-2L/hf "
    "--layers-of-model 32":
        Parse("needs an 8B-shaped checkpoint from scripts/make_shaped_model.py (minutes, GBs)"),
    "python scripts/bench_generate_memory.py ~/.cache/qserve-bench/*/*-Q4_K_M.gguf "
    "--prompt-tokens 20":
        Parse("needs the 1B / 8B-shaped GGUFs from scripts/make_shaped_model.py (GBs)"),
    "qserve info --json | python -c "
    "'import json,sys; print(json.load(sys.stdin)[\"memory_plan\"])'": Run(),
    'qserve generate --kv-cache-memory 1TiB "hi"':
        Run(fails=r"^error: .* needs [\d.]+ GiB on cpu \(weights .* try --kv-cache-memory \d+MiB"),
    SMOL_W8: Run(),
    "qserve quantize smollm2-135m-instruct -o smol-q41": Run(),
    "qserve quantize my-hf-dir -o my-w4 --recipe w4g64-awq --calib-text notes.txt":
        Parse("my-hf-dir and notes.txt stand for the reader's files; AWQ calibration takes "
              "minutes (tests/test_quant_checkpoint.py runs it)"),
    "qserve quantize smollm2-135m-instruct -o smol-q41.gguf --format gguf --recipe w4g32":
        Run(),
    "qserve quantize my-hf-dir -o my-w8-ct --format compressed-tensors --recipe w8":
        Parse("my-hf-dir stands for the reader's Hugging Face directory (tests/test_export.py "
              "exports one and reads it back)"),
    "qserve quantize some-awq-dir -o awq-ct --format compressed-tensors":
        Parse("some-awq-dir stands for the reader's AWQ / GPTQ directory (tests/test_export.py "
              "exports AWQ and GPTQ ones through the CLI and reads them back)"),
    'qserve generate -m smol-w8 "Hello"': Run(SMALL_GEN, setup=SMOL_W8),
    "qserve chat smol-w8": Run(SMALL_CHAT, stdin="Hi\n", setup=SMOL_W8),
    "qserve eval --kv-dtype int4 --ref smollm2-135m-instruct --score-tokens 16384":
        Run(" --context 32", replace=(("16384", "64"),)),
    "python scripts/quality_table.py --windows 16":
        Parse("every recipe x KV dtype and the peers: tens of minutes"),
    # Speculative decoding
    "qserve chat --draft ngram": Run(SMALL_CHAT, stdin="Hi\n"),
    'qserve generate --draft self:w4g64 "..."': Run(SMALL_GEN),
    "qserve serve --draft MODEL --num-speculative-tokens 4":
        Parse("MODEL stands for the reader's draft model, and a server runs until stopped"),
    # Memory pressure
    "qserve serve --kv-cache-memory 256MiB --max-model-len 2048 --kv-offload layerwise":
        Parse("a server that runs until stopped", engine_check=True),
    # The Python API and the OpenAI client
    "from qserve import LLM, SamplingParams": Run(),
    "from qserve import LLM, PoolingParams": Run(),
    "from openai import OpenAI":
        Parse("needs `qserve serve --api-key sk-local` on port 8000 (tests/test_server.py "
              "drives the openai client against a live server)"),
    'r = client.chat.completions.create(model="smollm2-135m-instruct", messages=[...], '
    'tools=[...],':
        Parse("a fragment: the client above, with [...] for the reader's messages and tools "
              "(tests/test_structured_outputs.py runs tool calls against a live server)"),
}


@dataclass(frozen=True)
class Example:
    kind: str  # "sh" or "python"
    text: str  # one shell line, or a whole Python block
    line: int  # where it starts in README.md

    @property
    def key(self) -> str:  # a Python block is known by its first line
        return self.text.splitlines()[0] if self.kind == "python" else self.text


def readme_examples() -> list[Example]:
    out, kind, start, block = [], None, 0, []
    for n, line in enumerate((REPO / "README.md").read_text().splitlines(), 1):
        if kind is None:
            m = re.match(r"^```(sh|python)\s*$", line)
            if m:
                kind, start, block = m.group(1), n + 1, []
            continue
        if line.startswith("```"):
            if kind == "python":
                out.append(Example("python", "\n".join(block), start))
            kind = None
            continue
        if kind == "python":
            block.append(line)
        elif line.strip() and not line.lstrip().startswith("#"):
            out.append(Example("sh", re.sub(r"\s+#\s.*$", "", line).strip(), n))
    return out


ALL = readme_examples()


def test_every_example_has_a_rule_and_every_rule_an_example():
    keys = [e.key for e in ALL]
    missing = [f"README.md:{e.line}: {e.key}" for e in ALL if e.key not in EXAMPLES]
    assert not missing, "README examples with no entry in EXAMPLES: " + "; ".join(missing)
    assert sorted(set(EXAMPLES) - set(keys)) == []  # an entry whose example is gone


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


def _env() -> dict[str, str]:
    return dict(os.environ, QSERVE_NO_PROGRESS="1", QSERVE_CHAT_HISTORY="",
                PY=sys.executable)


def _sh(command: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    prelude = 'qserve() { "$PY" -m qserve "$@"; }; python() { "$PY" "$@"; }\n'
    return subprocess.run(["bash", "-c", prelude + command], cwd=cwd, input=stdin, text=True,
                          capture_output=True, env=_env(), timeout=900)


@pytest.mark.parametrize("example", ALL, ids=[f"L{e.line}" for e in ALL])
def test_readme_example(example, workdir, default_model_path):
    rule = EXAMPLES.get(example.key)
    if rule is None:
        pytest.fail(f"README.md:{example.line} has no entry in EXAMPLES: {example.key}")
    if isinstance(rule, Parse):
        _check_parses(example, rule)
        return
    if example.kind == "python":
        r = subprocess.run([sys.executable, "-c", example.text], cwd=workdir, text=True,
                           capture_output=True, env=_env(), timeout=900)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
        return
    if rule.setup is not None:
        target = shlex.split(rule.setup)
        out = target[target.index("-o") + 1] if "-o" in target else target[-1]
        if not (workdir / out).exists():
            assert _sh(rule.setup, workdir).returncode == 0
    command = example.text
    for old, new in rule.replace:
        assert old in command, (old, command)
        command = command.replace(old, new)
    r = _sh(command + rule.small, workdir, rule.stdin)
    if rule.fails is not None:
        assert r.returncode == 2 and re.search(rule.fails, r.stderr, re.M), r.stderr[-3000:]
        return
    assert r.returncode == 0, f"{command + rule.small}\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), f"{command} printed nothing"


def _check_parses(example: Example, rule: Parse) -> None:
    if example.kind == "python":
        compile(example.text, f"README.md:{example.line}", "exec")
        return
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for part in re.split(r"\s*(?:&&|\|)\s*", example.text):
        words = shlex.split(part)
        if words[:2] == ["pip", "install"]:
            for spec in words[2:]:
                m = re.fullmatch(r"-e|\.\[([\w,]+)\]|[\w.=-]+", spec)
                assert m, spec
                for extra in (m.group(1) or "").split(","):
                    assert not extra or extra in extras, f"no extra {extra!r} in pyproject.toml"
        elif words[0] == "qserve":
            command = cli.main.get_command(None, words[1])
            assert command is not None, words[1]
            command.make_context(words[1], words[2:])  # click.UsageError if a flag is wrong
            if rule.engine_check:
                _check_engine_flags(words[2:])
        elif words[:2] == ["python", "scripts/" + Path(words[1]).name]:
            r = subprocess.run([sys.executable, words[1], "--help"], cwd=REPO, text=True,
                               capture_output=True, timeout=120)
            assert r.returncode == 0, r.stderr[-2000:]
        elif words[:3] != ["python", "-m", "pytest"]:
            pytest.fail(f"no way to check {part!r}")


def _check_engine_flags(args: list[str]) -> None:
    """A serve line's engine flags make an engine that runs (a pool that holds a sequence):
    the same flags through `qserve generate`, without the server's own."""
    serve_only = {"--port", "--api-key", "--host", "--served-model-name"}
    engine_args, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in serve_only:
            skip = True
        else:
            engine_args.append(a)
    r = subprocess.run([sys.executable, "-m", "qserve", "generate", *engine_args,
                        "--max-tokens", "2", "Hi"], capture_output=True, text=True, env=_env(),
                       cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_click_rejects_what_the_parse_check_should():
    """The parse check is not a no-op: a misspelt flag fails it."""
    command = cli.main.get_command(None, "serve")
    with pytest.raises(click.UsageError):
        command.make_context("serve", ["--kv-ofload", "layerwise"])
