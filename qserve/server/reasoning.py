"""A reasoning model's thinking, read apart from its answer, whole or as it streams.

Models write it one of two ways:

    think     <think>THINKING</think>ANSWER              Qwen3, QwQ, DeepSeek-R1 and its
                                                         distills, SmolLM3
    harmony   <|channel|>analysis<|message|>THINKING<|end|>       OpenAI's gpt-oss: messages on
              <|start|>assistant<|channel|>final<|message|>ANSWER  channels, each header ended
                                                                   by <|message|>, each body by
                                                                   <|end|>, <|return|>, <|call|>

A harmony tool call is a message to a function, on the commentary channel:
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`.

DeepSeek-R1's template (QwQ's, some Qwen3 ones) opens <think> in the generation prompt, so the
output starts inside the thinking and only </think> appears: `Reasoning.for_prompt` looks at
the prompt's end. Harmony's markers are special tokens, which the detokenizer drops by default
(SamplingParams.skip_special_tokens): `Reasoning.special` asks for them to be kept, and the
parser strips them. The end of the answer (<|return|>, <|call|>) is a stop token, never in
the text, so a body also ends where the text does.

A parser is fed text deltas and returns (reasoning delta, content delta): text that could be
the start of a marker split across deltas is held back until the next delta settles it.
`split_reasoning` is the whole-text form. tool_calls.AnswerParser chains a parser with the
request's tool calls.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace

PARSERS = ("auto", "none", "think", "harmony")  # --reasoning-parser
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class Reasoning:
    """How one model writes its thinking; `parser()` reads one answer."""

    kind: str  # "think" or "harmony"
    special: bool = False  # its markers are special tokens: detokenize with them kept
    opened: bool = False  # think: the prompt opened <think>, so the output starts inside it

    def for_prompt(self, tokenizer, prompt_ids: list[int]) -> Reasoning:
        """The format for one prompt: whether its generation prompt ends in an open <think>."""
        if self.kind != "think":
            return self
        tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        return replace(self, opened=tail.rstrip().endswith(THINK_OPEN))

    def parser(self) -> ThinkParser | HarmonyParser:
        return ThinkParser(self.opened) if self.kind == "think" else HarmonyParser()


def reasoning_format(choice: str, tokenizer) -> Reasoning | None:
    """--reasoning-parser CHOICE for this model: None for "none", and for "auto" when neither
    its vocabulary (a <|channel|> token: harmony) nor its chat template (one that mentions
    <think>) shows a way of thinking."""
    assert choice in PARSERS, choice
    if choice == "auto":
        template = (tokenizer.chat_template or "") + (tokenizer.tool_use_template or "")
        choice = ("harmony" if tokenizer.token_to_id(CHANNEL) is not None else
                  "think" if THINK_OPEN in template else "none")
    if choice == "none":
        return None
    if choice == "harmony":
        return Reasoning("harmony", special=True)
    think = tokenizer.token_to_id(THINK_OPEN)  # an added token, special in a few vocabularies
    return Reasoning("think", special=think is not None and think in tokenizer.all_special_ids)


def split_reasoning(text: str, reasoning: Reasoning) -> tuple[str | None, str]:
    """A finished answer's text -> (its thinking, or None; its content)."""
    parser = reasoning.parser()
    parser.feed(text)
    parser.finish()
    return parser.message()[:2]


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of one of `markers`."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class ThinkParser:
    """`<think>THINKING</think>ANSWER`, read as it arrives. Unless the prompt `opened` it,
    thinking is only where the text starts with <think> (after whitespace); other text is all
    answer, as written. The whitespace around the thinking and before the answer after it
    goes, as templates strip it from the history."""

    def __init__(self, opened: bool = False):
        self.state = "think" if opened else "start"  # "start", "think" or "answer"
        self.text = ""  # received, not yet handed out
        self.reasoning: list[str] = []  # every piece handed out
        self.content: list[str] = []
        self._strip = True  # strip whitespace leading the current part

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """What is left once the sample has ended (thinking cut short stays thinking)."""
        return self._advance(final=True)

    def message(self) -> tuple[str | None, str, list[dict]]:
        """(thinking or None, content, calls) of the finished answer."""
        return "".join(self.reasoning) or None, "".join(self.content), []

    def _advance(self, final: bool) -> tuple[str, str]:
        thinking, content = "", ""
        if self.state == "start":
            head = self.text.lstrip()
            if head.startswith(THINK_OPEN):
                self.text, self.state = head[len(THINK_OPEN):], "think"
            elif final or not THINK_OPEN.startswith(head):
                self.state, self._strip = "answer", False  # no thinking: the text as written
            else:
                return "", ""  # whitespace, or the start of <think>
        if self.state == "think":
            if self._strip:
                self.text = self.text.lstrip()
            at = self.text.find(THINK_CLOSE)
            if at >= 0:
                thinking = self.text[:at].rstrip()
                self.text = self.text[at + len(THINK_CLOSE):]
                self.state, self._strip = "answer", True
            else:
                # trailing whitespace waits: it goes if </think> follows
                end = len(self.text) - (0 if final else _partial(self.text, (THINK_CLOSE,)))
                thinking = self.text[:end].rstrip()
                self.text = "" if final else self.text[len(thinking):]
            if thinking:
                self.reasoning.append(thinking)
                self._strip = self.state != "think"
        if self.state == "answer":
            content, self.text = (self.text.lstrip() if self._strip else self.text), ""
            if content:
                self.content.append(content)
                self._strip = False
        return thinking, content


class HarmonyParser:
    """gpt-oss's harmony messages, read as they arrive: analysis bodies are thinking, a
    message to `functions.NAME` is a tool call (`calls`, once complete), other bodies (final,
    a commentary preamble) are content. Messages to built-in tools (browser, python) are
    dropped. Text that never opens a message (no harmony at all) is content, at the end."""

    def __init__(self):
        self.state = "header"  # "header" (up to <|message|>) or "body"
        self.text = ""  # received, not yet dealt with
        self.to: str | None = None  # the open body's destination: "reasoning", "content",
        #                             "call" or None (dropped)
        self.name, self.args = "", ""  # the call being read
        self.reasoning: list[str] = []  # every piece handed out
        self.content: list[str] = []
        self.calls: list[dict] = []  # complete calls: {"id", "type", "function"}
        self._opened = False  # a message has begun

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """What is left once the sample has ended; a call whose arguments are not whole JSON
        (a length cut) is not a call."""
        return self._advance(final=True)

    def message(self) -> tuple[str | None, str, list[dict]]:
        return "".join(self.reasoning) or None, "".join(self.content), self.calls

    def _advance(self, final: bool) -> tuple[str, str]:
        out = {"reasoning": [], "content": []}
        while True:
            if self.state == "header":
                at = self.text.find(MESSAGE)
                if at < 0:
                    if final and not self._opened and CHANNEL not in self.text:
                        out["content"].append(self.text)  # not harmony: all content
                    break
                self._open(self.text[:at])
                self.text, self.state = self.text[at + len(MESSAGE):], "body"
                continue
            ends = [(i, e) for e in BODY_ENDS if (i := self.text.find(e)) >= 0]
            if ends:
                at, end = min(ends)
                self._body(self.text[:at], out)
                self.text, self.state = self.text[at + len(end):], "header"
                self._close()
                continue
            keep = 0 if final else _partial(self.text, BODY_ENDS)
            self._body(self.text[:len(self.text) - keep], out)
            self.text = self.text[len(self.text) - keep:]
            if final:
                self._close()
            break
        thinking, content = "".join(out["reasoning"]), "".join(out["content"])
        self.reasoning.append(thinking)
        self.content.append(content)
        return thinking, content

    def _body(self, piece: str, out: dict) -> None:
        if self.to == "call":
            self.args += piece
        elif self.to is not None:
            out[self.to].append(piece)

    def _open(self, header: str) -> None:
        """Route a message by its header, e.g. `assistant<|channel|>commentary
        to=functions.get_weather <|constrain|>json`."""
        self._opened = True
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1)
            self.to = "call" if name.startswith("functions.") else None
            self.name, self.args = name.removeprefix("functions."), ""
        else:
            self.to = "reasoning" if channel and channel.group(1) == "analysis" else "content"

    def _close(self) -> None:
        """The end of a body: a call's arguments are complete."""
        if self.to != "call":
            return
        self.to = None
        try:
            json.loads(self.args)
        except (ValueError, RecursionError):
            return
        self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": self.name, "arguments": self.args}})
