"""`qserve chat`: a conversation with a model in the terminal, each reply streamed as it is
generated.

On a terminal it reads lines with prompt_toolkit (editing, history); piped, it reads one user
message per line and prints one reply per message, so it can be scripted. Lines starting with
`/` are commands (see HELP). The engine runs on this thread: one request at a time, stepped
until it finishes or Ctrl-C sets a flag that is checked between steps, so an interrupted step
never leaves the engine half-updated.

A reasoning model's thinking (server/reasoning.py) is shown as Ollama's CLI shows it, between
`Thinking...` and `...done thinking.` (dimmed on a terminal), or not at all (--hide-thinking);
the history keeps the answer alone, as chat templates drop earlier turns' thinking.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import signal
import sys
import time
from pathlib import Path

from qserve.errors import QServeError
from qserve.sampling_params import SamplingParams
from qserve.server.reasoning import Reasoning

HELP = """\
/help                 this list
/reset                forget the conversation (the system prompt stays)
/system TEXT          set the system prompt (no TEXT: remove it)
/set NAME VALUE       set a sampling parameter, e.g. /set temperature 0.7 (no NAME: show them)
/stats                the last reply's time to first token, tokens/s, KV blocks in use and
                      (with --draft) how many draft tokens the model accepted
/save FILE            write the conversation to FILE as JSON
/exit                 leave (Ctrl-D too); Ctrl-C interrupts a reply"""
SETTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "max_tokens")
PROMPT = ">>> "
DIM, RESET = "\x1b[2m", "\x1b[0m"  # the thinking's style on a terminal


class ChatSession:
    """The conversation and its engine. `reply()` streams one answer; `command()` runs a
    slash command and returns False when the session should end."""

    def __init__(self, engine, params: SamplingParams, system: str | None = None,
                 model_name: str = "", out=None, err=None, reasoning: Reasoning | None = None,
                 show_thinking: bool = True):
        """reasoning: how the model writes its thinking (reasoning_format), or None to print
        the reply as generated."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.params = params
        self.system = system
        self.model_name = model_name
        self.turns: list[dict] = []  # user / assistant messages, oldest first
        self.last_stats: dict | None = None
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.reasoning = reasoning
        self.show_thinking = show_thinking
        self._ids = itertools.count()
        self._interrupted = False
        self._dim = self.out.isatty() if hasattr(self.out, "isatty") else False
        self._shown: str | None = None  # what the reply has printed last: "thinking", "answer"

    # ---- the conversation --------------------------------------------------------------
    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def _prompt_ids(self) -> list[int]:
        text = self.tokenizer.apply_chat_template(self.messages(), add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _fit(self) -> list[int] | None:
        """The prompt ids, dropping the oldest turns (never the system prompt or the new
        message) until a reply has room; None when the new message alone does not fit."""
        limit = self.engine.max_model_len
        room = min(self.params.max_tokens, limit // 4)  # what a reply needs, at least
        ids, dropped = self._prompt_ids(), 0
        while len(ids) + room > limit and len(self.turns) > 1:
            self.turns.pop(0)
            dropped += 1
            if self.turns and self.turns[0]["role"] == "assistant":  # keep user-first order
                self.turns.pop(0)
                dropped += 1
            ids = self._prompt_ids()
        if dropped:
            self._note(f"(the conversation outgrew the {limit}-token context; dropped the "
                       f"oldest {dropped} message{'s' * (dropped > 1)})")
        if len(ids) >= limit:
            self.turns.pop()
            self._note(f"(that message is {len(ids)} tokens with the system prompt; the "
                       f"context holds {limit}. Send something shorter.)")
            return None
        return ids

    def reply(self, text: str) -> str:
        """Stream the model's answer to `text` to `out`; Ctrl-C stops it early (the partial
        answer stays in the history)."""
        self.turns.append({"role": "user", "content": text})
        ids = self._fit()
        if ids is None:
            return ""
        params = dataclasses.replace(
            self.params, max_tokens=min(self.params.max_tokens,
                                        self.engine.max_model_len - len(ids)))
        parser = None
        if self.reasoning is not None:
            parser = self.reasoning.for_prompt(self.tokenizer, ids).parser()
            if self.reasoning.special:  # its markers are special tokens: the parser needs them
                params = dataclasses.replace(params, skip_special_tokens=False)
        rid = f"chat-{next(self._ids)}"
        self._interrupted, self._shown = False, None
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        peak_blocks, out = 0, None
        try:
            self.engine.add_request(rid, None, params, prompt_token_ids=ids)
            while not self._interrupted:
                outputs = self.engine.step()
                peak_blocks = max(peak_blocks, self.engine.stats()["kv_blocks_used"])
                for out in outputs:
                    delta = out.outputs[0].delta_text
                    self._show(*(parser.feed(delta) if parser else ("", delta)))
                if out is not None and out.finished:
                    break
        finally:
            self.engine.abort(rid)  # a no-op when it finished
            signal.signal(signal.SIGINT, previous)
        if parser is not None:
            self._show(*parser.finish())
            answer = parser.message()[1]
        else:
            answer = out.outputs[0].text if out is not None else ""
        if self._shown == "thinking":  # no answer after it (cut short)
            self.out.write("\n...done thinking." + (RESET if self._dim else ""))
        self.out.write("\n")
        if self._interrupted:
            self._note("(interrupted)")
        self.turns.append({"role": "assistant", "content": answer})
        if out is not None:
            self.last_stats = _reply_stats(out, peak_blocks, self.engine.stats())
        return answer

    def _show(self, thinking: str, answer: str) -> None:
        """Print a piece of the reply: thinking (unless hidden) then answer text."""
        if thinking and self.show_thinking:
            if self._shown is None:
                self.out.write((DIM if self._dim else "") + "Thinking...\n")
            self._shown = "thinking"
            self.out.write(thinking)
        if answer:
            if self._shown == "thinking":
                self.out.write("\n...done thinking.\n\n" + (RESET if self._dim else ""))
            self._shown = "answer"
            self.out.write(answer)
        self.out.flush()

    def _on_sigint(self, signum, frame) -> None:
        self._interrupted = True

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C cut the last reply short."""
        return self._interrupted

    def _note(self, message: str) -> None:
        self.err.write(message + "\n")
        self.err.flush()

    # ---- commands ----------------------------------------------------------------------
    def command(self, line: str) -> bool:
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/help", "/?"):
            self._note(HELP)
        elif name == "/reset":
            self.turns.clear()
            self._note("(conversation cleared)")
        elif name == "/system":
            self.system = arg or None
            self._note(f"(system prompt {'set' if arg else 'removed'})")
        elif name == "/set":
            self._set(arg)
        elif name == "/stats":
            self._note(_format_stats(self.last_stats))
        elif name == "/save":
            self._save(arg)
        else:
            self._note(f"unknown command {name}; /help lists the commands")
        return True

    def _set(self, arg: str) -> None:
        if not arg:
            self._note("  ".join(f"{k}={getattr(self.params, k)}" for k in SETTABLE))
            return
        key, _, value = arg.partition(" ")
        value = value.strip()
        if key not in SETTABLE or not value:
            self._note(f"usage: /set NAME VALUE, with NAME one of {', '.join(SETTABLE)}")
            return
        try:
            if key == "seed" and value.lower() == "none":
                parsed = None
            elif key in ("top_k", "seed", "max_tokens"):
                parsed = int(value)
            else:
                parsed = float(value)
            self.params = dataclasses.replace(self.params, **{key: parsed})
        except ValueError as e:  # int('x'), or SamplingParams' QServeError
            why = str(e) if isinstance(e, QServeError) else f"{value!r} is not a number"
            self._note(f"error: {why}")
            return
        self._note(f"({key} = {parsed})")

    def _save(self, path: str) -> None:
        if not path:
            self._note("usage: /save FILE")
            return
        record = {"model": self.model_name, "messages": self.messages(),
                  "sampling": {k: getattr(self.params, k) for k in SETTABLE}}
        try:
            Path(path).expanduser().write_text(json.dumps(record, indent=2, ensure_ascii=False)
                                               + "\n", encoding="utf-8")
        except OSError as e:
            self._note(f"error: cannot write {path!r}: {e.strerror}")
            return
        self._note(f"(saved {len(self.messages())} messages to {path})")


def _reply_stats(out, peak_blocks: int, stats: dict) -> dict:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    ttft = m.first_token_time - m.arrival_time if m.first_token_time is not None else None
    end = m.finished_time or time.monotonic()
    decode_s = end - m.first_token_time if m.first_token_time is not None else 0
    c = out.outputs[0]
    return {"prompt_tokens": len(out.prompt_token_ids), "tokens": n, "ttft_s": ttft,
            "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            "kv_blocks_used": peak_blocks, "kv_blocks_total": stats["kv_blocks_total"],
            "spec_draft_tokens": c.spec_draft_tokens,
            "spec_acceptance_rate": c.spec_acceptance_rate,
            "spec_mean_accepted_tokens": c.spec_mean_accepted_tokens}


def _format_stats(s: dict | None) -> str:
    if s is None:
        return "(no reply yet)"
    ttft = f"{s['ttft_s'] * 1000:.0f} ms" if s["ttft_s"] is not None else "-"
    rate = f"{s['tokens_per_s']:.1f} tokens/s" if s["tokens_per_s"] is not None else "- tokens/s"
    text = (f"time to first token {ttft}, {s['tokens']} tokens at {rate}, "
            f"prompt {s['prompt_tokens']} tokens, "
            f"KV blocks in use {s['kv_blocks_used']} of {s['kv_blocks_total']}")
    if s.get("spec_draft_tokens"):
        text += (f", {100 * s['spec_acceptance_rate']:.0f}% of {s['spec_draft_tokens']} draft "
                 f"tokens accepted ({s['spec_mean_accepted_tokens']:.2f} per step)")
    return text


# ---- the loop ----------------------------------------------------------------------------
def run(session: ChatSession, stdin=None) -> None:
    """Talk until /exit or end of input: interactively on a terminal, else line by line.
    Piped, Ctrl-C ends the whole run (KeyboardInterrupt), not just the reply it cut short."""
    stdin = stdin or sys.stdin
    if not stdin.isatty():
        try:
            for line in stdin:
                if not _handle(session, line.strip()):
                    return
                if session.interrupted:
                    raise KeyboardInterrupt
        except UnicodeDecodeError as e:
            raise QServeError(f"stdin is not UTF-8 text (byte {e.object[e.start]:#04x}); "
                              f"pipe in one message per line") from None
        return
    read = _line_reader()
    session._note(f"qserve chat with {session.model_name}: /help for commands, "
                  f"Ctrl-D to leave")
    while True:
        try:
            line = read().strip()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line
            continue
        except EOFError:
            return
        if not _handle(session, line):
            return


def _handle(session: ChatSession, line: str) -> bool:
    """One input line: a /command or a message. Returns False when the chat should end."""
    if not line:
        return True
    if line.startswith("/"):
        return session.command(line)
    session.reply(line)
    return True


def history_path() -> Path | None:
    """Where the REPL keeps the lines typed at its prompt: $QSERVE_CHAT_HISTORY (empty: keep
    none), else $QSERVE_HOME/chat_history. It is plain text in prompt_toolkit's format (each
    entry a `# date` line, then the entry's lines prefixed with `+`), holds what you typed
    (never the replies) and grows until you delete it."""
    import os

    from qserve.config import model_home

    if "QSERVE_CHAT_HISTORY" in os.environ:
        value = os.environ["QSERVE_CHAT_HISTORY"]
        return Path(value).expanduser() if value else None
    return model_home() / "chat_history"


def _line_reader():
    """A function that reads one line at the prompt: prompt_toolkit's (editing, and history
    kept in history_path()), or without it (the `server` extra not installed) input() with
    readline's editing and this session's history only."""
    try:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
    except ImportError:
        try:
            import readline  # noqa: F401  (input() edits lines once it is imported)
        except ImportError:  # not on every platform
            pass
        return lambda: input(PROMPT)

    history = InMemoryHistory()
    path = history_path()
    try:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            history = FileHistory(str(path))
    except OSError:  # a read-only home: history for this session only
        pass
    prompt_session = PromptSession(history=history)
    return lambda: prompt_session.prompt(PROMPT)
