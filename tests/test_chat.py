"""`qserve chat` as a person meets it, through a pseudo-terminal (pexpect), and as a script
meets it, with stdin piped. Both run `python -m qserve chat` on the default model, greedy."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

pexpect = pytest.importorskip("pexpect")
pytest.importorskip("prompt_toolkit")

pytestmark = pytest.mark.slow

CHAT = [sys.executable, "-m", "qserve", "chat", "--kv-cache-memory", "256MiB", "--temperature",
        "0"]
# No cursor-position requests: pexpect is not a terminal that would answer them.
# fp32 activations: the default model's first reply token is a near-tie ("The" -1.88 vs "L"
# -1.97 nats) that int8 activations flip, and these tests read the answer
# No history file unless a test names one in its tmp_path: tests never write the user's.
ENV = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm", QSERVE_CPU_ACTIVATIONS="fp32",
           QSERVE_CHAT_HISTORY="")
PROMPT = ">>>"
REPLY_STARTS = r"\x1b\[\?2004l"  # prompt_toolkit leaves bracketed-paste mode; the reply follows


def saved(path) -> list[dict]:
    return json.loads(path.read_text())["messages"]


def test_repl_in_a_terminal(tmp_path):
    history = tmp_path / "history"
    child = pexpect.spawn(CHAT[0], CHAT[1:] + ["--max-model-len", "512", "--max-tokens", "12"],
                          env=dict(ENV, QSERVE_CHAT_HISTORY=str(history)), encoding="utf-8",
                          timeout=120, dimensions=(24, 200))
    try:
        child.expect(r"qserve: SmolLM2-135M-Instruct\.Q4_1\.gguf \(llama, 135M params\)")
        child.expect(r"KV fp32 [\d,]+ tokens")
        child.expect(PROMPT)
        child.sendline("What is the capital of France?")
        child.expect("Paris")  # the answer streams out ...
        child.expect(PROMPT)  # ... and the prompt comes back
        child.sendline(f"/save {tmp_path / 'before.json'}")
        child.expect("saved 2 messages")
        assert [m["role"] for m in saved(tmp_path / "before.json")] == ["user", "assistant"]

        child.sendline("/reset")
        child.expect("conversation cleared")
        child.sendline(f"/save {tmp_path / 'after.json'}")
        child.expect("saved 0 messages")
        assert saved(tmp_path / "after.json") == []

        child.sendline("/set max_tokens 400")
        child.expect(r"max_tokens = 400")
        child.sendline("Write a long story about a dragon.")
        child.expect(REPLY_STARTS)
        child.expect(r"[A-Za-z]{2}")  # the first words of the reply, long before its end
        child.sendintr()
        child.expect(r"\(interrupted\)")
        child.expect(PROMPT)

        child.sendline("/stats")
        child.expect(r"time to first token \d+ ms")
        child.expect("KV blocks in use")
        child.sendline("/set temperature -1")
        child.expect("temperature=-1.0 must be >= 0")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert "+What is the capital of France?" in history.read_text().splitlines()


def test_ctrl_d_at_the_prompt_exits_0():
    child = pexpect.spawn(CHAT[0], CHAT[1:] + ["--max-model-len", "256"], env=ENV,
                          encoding="utf-8", timeout=120, dimensions=(24, 200))
    try:
        child.expect(PROMPT)
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_piped_answers_each_line_and_drops_old_turns(tmp_path):
    """A 128-token context cannot hold four turns: the oldest go, the system prompt stays."""
    questions = ["Tell me about the history of Rome, its emperors, its wars and its fall.",
                 "Tell me about the history of Greece, its cities, its wars and its gods.",
                 "Tell me about the history of Egypt, its pharaohs, its wars and its Nile.",
                 "Tell me about the history of China, its dynasties, its walls and its rivers."]
    save = tmp_path / "conversation.json"
    lines = "\n".join(questions + [f"/save {save}"]) + "\n"
    r = subprocess.run(CHAT + ["--max-model-len", "128", "--max-tokens", "4", "--system",
                               "Answer briefly."], input=lines, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "outgrew the 128-token context" in r.stderr
    messages = saved(save)
    assert messages[0] == {"role": "system", "content": "Answer briefly."}
    assert messages[-2] == {"role": "user", "content": questions[-1]}
    assert len(messages) < 1 + 2 * len(questions)  # some turns were dropped
    replies = r.stdout.split("\n")
    assert len([line for line in replies if line]) >= len(questions)
    assert r.stdout.endswith(messages[-1]["content"] + "\n")


@pytest.mark.parametrize("show", [True, False])
def test_thinking_is_shown_apart_and_left_out_of_the_history(native_model, show):
    """A reasoning model's reply (the default model made to write one, see test_reasoning.py):
    its thinking between Ollama's `Thinking...` lines, or hidden; the history keeps the
    answer alone, as the template would render it."""
    import io

    from test_reasoning import ANSWER, QWEN3_LIKE, THINK, THOUGHT, Forcing, _with_template
    from test_structured_outputs import make_served_engine

    from qserve.chat import ChatSession
    from qserve.sampling_params import SamplingParams
    from qserve.server.reasoning import reasoning_format

    model = dataclasses.replace(native_model,
                                tokenizer=_with_template(native_model.tokenizer, QWEN3_LIKE))
    engine = make_served_engine(model, max_model_len=512, kv_cache_memory="16MiB")
    Forcing(engine).text = THINK
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(engine, SamplingParams(max_tokens=60), out=out, err=err,
                          reasoning=reasoning_format("auto", engine.tokenizer),
                          show_thinking=show)
    assert session.reply("Hi!") == ANSWER
    shown = f"Thinking...\n{THOUGHT}\n...done thinking.\n\n" if show else ""
    assert out.getvalue() == shown + ANSWER + "\n"
    assert session.turns == [{"role": "user", "content": "Hi!"},
                             {"role": "assistant", "content": ANSWER}]
