"""Tool calls in a chat: the prompt that offers the tools, and the calls read back out of the
model's text, whole or as it streams.

The prompt: a chat template that lists tools (Llama 3.1+, Qwen 2.5+; `tools=` in Hugging Face's
apply_chat_template) renders the definitions, an assistant's earlier `tool_calls` and the
`role: tool` results itself. A template that ignores `tools` (plain ChatML) gets qserve's
rendering: the definitions in the system message, earlier calls and results as tagged text.

The answer: the grammar (structured.py) makes every call the fixed text
`begin(NAME) ARGS end` of the model's ToolFormat, with ARGS one JSON object. ToolCallParser reads
that text left to right: text outside calls is content; at a complete `begin(NAME)` a call
opens (its first delta: index, id, type, name, empty arguments); ARGS goes out as it arrives,
scanned for the brace that closes it; then `end`, and content again. A reasoning model's
thinking is read off first (reasoning.py): AnswerParser feeds the tool-call parser the content
alone, and takes a harmony model's calls (its own format, not the grammar's) from its parser.
"""
from __future__ import annotations

import json
import uuid

from qserve.server.reasoning import Reasoning
from qserve.server.structured import HERMES, Structure, StructureError, ToolFormat


# ---- the prompt -------------------------------------------------------------------------
def render_chat(tokenizer, messages: list[dict], s: Structure, fmt: ToolFormat,
                variables: dict | None = None) -> str:
    """The prompt text of a chat request (raises the tokenizer's QServeError when the template
    refuses the conversation). `variables`: the request's own template variables
    (chat_template_kwargs, e.g. enable_thinking)."""
    tools = [t.openai() for t in s.tools] if s.tool_mode is not None else None
    involved = tools is not None or any(m["role"] == "tool" or m.get("tool_calls")
                                        for m in messages)
    if involved and tokenizer.chat_template_renders_tools:
        return _apply(tokenizer, _name_tool_results(messages), tools, variables)
    return _apply(tokenizer, tool_messages(messages, s, fmt), None, variables)


def _apply(tokenizer, messages: list[dict], tools: list[dict] | None,
           variables: dict | None) -> str:
    """tokenizer.apply_chat_template with a generation prompt and the request's variables."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                         **(variables or {}))


def _name_tool_results(messages: list[dict]) -> list[dict]:
    """Messages as Hugging Face templates take them, a tool result also carrying the `name` of
    the call it answers (OpenAI sends only `tool_call_id`; some templates print the name)."""
    names, out = {}, []
    for m in messages:
        for c in m.get("tool_calls", ()):
            if c.get("id"):
                names[c["id"]] = c["function"]["name"]
        if m["role"] == "tool" and m.get("tool_call_id") in names:
            m = dict(m, name=names[m["tool_call_id"]])
        out.append(m)
    return out


def tool_messages(messages: list[dict], s: Structure, fmt: ToolFormat = HERMES) -> list[dict]:
    """Messages for a template that cannot list tools: tool definitions in the system message,
    an assistant's earlier tool calls in the format the grammar writes, results as tagged
    user text."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n"
                                                   f"</tool_response>"})
        elif m.get("tool_calls"):
            calls = fmt.separator.join(fmt.write(c["function"]["name"], c["function"]["arguments"])
                                       for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" + calls).strip()})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if s.tools and s.tool_mode is not None:
        listing = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in s.tools)
        example = fmt.write("NAME", {"ARG": "VALUE"})
        intro = ("You can call these functions (JSON signatures, one a line):\n"
                 f"{listing}\nTo call one, answer with:\n{example}\n"
                 "Several calls may follow each other, one a line.")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + intro}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out


def check_tool_history(m: dict, i: int) -> dict:
    """The `tool_calls` of one incoming chat message (an assistant's earlier calls), checked,
    in the shape chat templates read: [{"id", "type", "function": {"name", "arguments"}}],
    arguments parsed to an object where they are JSON. Returns {"tool_calls": [...]} or {}."""
    calls = m.get("tool_calls")
    if calls is None:
        return {}
    if m.get("role") != "assistant" or not isinstance(calls, list):
        raise StructureError(f"messages[{i}].tool_calls must be a list on an assistant "
                             f"message", "messages")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", "{}"), str)
                and isinstance(c.get("id", ""), str)):
            raise StructureError(f"messages[{i}].tool_calls entries must be {{\"id\", \"type\": "
                                 f"\"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                                 "messages")
        try:
            args = json.loads(fn.get("arguments", "{}"))
        except (ValueError, RecursionError):  # kept as the text it was
            args = fn.get("arguments")
        out.append({"id": c.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return {"tool_calls": out}


# ---- the answer -------------------------------------------------------------------------
class ToolCallParser:
    """One choice's tool-calling text, read as it arrives.

    feed(delta) and finish() return (content, tool-call deltas): the content that may go out
    now, and OpenAI's streamed `tool_calls` entries. Content before the first call streams,
    less any tail that could be the start of a call; content after a call is held until the
    end (whitespace between calls is the separator, not content). `calls` holds the complete
    calls, as a non-streamed message lists them."""

    def __init__(self, s: Structure, fmt: ToolFormat):
        self.fmt = fmt
        self.begins = {fmt.begin(t.name): t.name for t in s.tools}
        self.text = ""
        self.pos = 0  # text[:pos] has been dealt with
        self.state = "text"  # "text", "args" (inside ARGS), "end" (after ARGS) or "lost"
        self.calls: list[dict] = []  # complete calls: {"id", "type", "function"}
        self.started = 0  # calls begun (their first delta sent)
        self.content: list[str] = []  # every piece of content, sent or held
        self.held: list[str] = []  # content after a call, sent at the end if not blank
        self._open: dict | None = None  # the call being read: id, name, where it and ARGS start
        self._depth, self._in_string, self._escape = 0, False, False  # ARGS scanned so far

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        """What is left once the sample has ended. A call cut short (a length cut) is not in
        `calls`; its text is not content either (its start has gone out as a call)."""
        content, deltas = self._advance(final=True)
        tail = "".join(self.held).strip()
        if tail:
            self.content.append(tail)
            content += tail
        return content, deltas

    def message(self) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of the finished choice, as a whole message has them."""
        if not self.started:
            return "".join(self.content), []
        content = "".join(self.content)
        if self.state != "text":  # a call cut short: its text, and the rest, stay content
            content += self.text[self._open["at"]:]
        return content.strip() or None, self.calls

    def _advance(self, final: bool) -> tuple[str, list[dict]]:
        out, deltas = [], []
        while self.state != "lost":
            if self.state == "text":
                at, begin = self._next_begin()
                if begin is None:
                    end = len(self.text) if final else self._safe_end()
                    self._content(self.text[self.pos:end], out)
                    self.pos = end
                    break
                self._content(self.text[self.pos:at], out)
                self.pos = at + len(begin)
                self._open = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": self.begins[begin],
                              "at": at, "args_at": self.pos}
                deltas.append({"index": self.started, "id": self._open["id"], "type": "function",
                               "function": {"name": self._open["name"], "arguments": ""}})
                self.started += 1
                self._depth, self._in_string, self._escape = 0, False, False
                self.state = "args"
            elif self.state == "args":
                stop, closed = self._scan_args()
                if stop > self.pos:
                    piece = self.text[self.pos:stop]
                    if deltas and deltas[-1]["index"] == self.started - 1:  # one entry a call
                        deltas[-1]["function"]["arguments"] += piece
                    else:
                        deltas.append({"index": self.started - 1,
                                       "function": {"arguments": piece}})
                    self.pos = stop
                if not closed:
                    break  # ARGS goes on in a later delta
                self.state = "end"
            else:  # "end": the fixed close of the call
                end, rest = self.fmt.end, self.text[self.pos:]
                if rest.startswith(end):
                    args = self.text[self._open["args_at"]:self.pos]
                    self.calls.append({"id": self._open["id"], "type": "function",
                                       "function": {"name": self._open["name"],
                                                    "arguments": args}})
                    self.pos += len(end)
                    self.state = "text"
                elif end.startswith(rest):
                    break  # more of it in a later delta (or, at the end, a call cut short)
                else:  # not the grammar's text (no constraint ran): read no further
                    self.state = "lost"
        return "".join(out), deltas

    def _content(self, piece: str, out: list[str]) -> None:
        if not piece:
            return
        if self.started:
            self.held.append(piece)
        else:
            self.content.append(piece)
            out.append(piece)

    def _next_begin(self) -> tuple[int, str | None]:
        """The first complete call start at or after pos."""
        best, found = len(self.text), None
        for begin in self.begins:
            at = self.text.find(begin, self.pos, best + len(begin))
            if at >= 0 and at < best:
                best, found = at, begin
        return best, found

    def _safe_end(self) -> int:
        """Where content may end now: before the longest tail of text that could still grow
        into a call start."""
        rest = self.text[self.pos:]
        for k in range(min(len(rest), max((len(b) for b in self.begins), default=0)), 0, -1):
            tail = rest[-k:]
            if any(b.startswith(tail) for b in self.begins):
                return len(self.text) - k
        return len(self.text)

    def _scan_args(self) -> tuple[int, bool]:
        """Scan ARGS from pos: (the index just past its closing brace, True), or (the end of
        the text, False) while it is still open. Braces inside JSON strings do not count."""
        text = self.text
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1, True
        return len(text), False


class AnswerParser:
    """One chat choice's text -> its thinking, content and tool calls, as it streams.

    feed(delta) and finish() return (thinking, content, tool-call deltas): the reasoning
    parser reads the text first (when the model thinks), then the tool-call parser reads the
    content it leaves (when the request offers tools). A harmony model writes calls its own
    way, which its reasoning parser reads: each goes out whole, in one delta, once complete."""

    def __init__(self, reasoning: Reasoning | None, s: Structure, fmt: ToolFormat):
        self.reasoning = reasoning.parser() if reasoning is not None else None
        harmony = reasoning is not None and reasoning.kind == "harmony"
        self.harmony_calls = s.parses_tools and harmony
        self.tools = ToolCallParser(s, fmt) if s.parses_tools and not harmony else None
        self.content: list[str] = []  # every piece of content (without a tool-call parser)
        self._sent = 0  # harmony calls sent

    @property
    def calls(self) -> list[dict]:
        """The complete calls so far."""
        if self.tools is not None:
            return self.tools.calls
        return self.reasoning.calls if self.harmony_calls else []

    def feed(self, delta: str) -> tuple[str, str, list[dict]]:
        return self._step(delta, final=False)

    def finish(self) -> tuple[str, str, list[dict]]:
        return self._step("", final=True)

    def read(self, delta: str, last: bool) -> tuple[str, str, list[dict]]:
        """feed(delta), then finish() where it is the choice's last delta: both their pieces."""
        thinking, content, calls = self.feed(delta)
        if not last:
            return thinking, content, calls
        more = self.finish()
        return thinking + more[0], content + more[1], calls + more[2]

    def message(self) -> tuple[str | None, str | None, list[dict]]:
        """(thinking or None, content, tool_calls) of the finished choice, as a whole message
        has them; content is None, as OpenAI's, when calls are all there is."""
        thinking = self.reasoning.message()[0] if self.reasoning is not None else None
        if self.tools is not None:
            return (thinking, *self.tools.message())
        content = "".join(self.content)
        return thinking, (content.strip() or None) if self.calls else content, self.calls

    def _step(self, delta: str, final: bool) -> tuple[str, str, list[dict]]:
        thinking, content, deltas = "", delta, []
        if self.reasoning is not None:
            thinking, content = self.reasoning.finish() if final else self.reasoning.feed(delta)
        if self.tools is not None:
            content, deltas = self.tools.feed(content)
            if final:
                rest, more = self.tools.finish()
                content, deltas = content + rest, deltas + more
            return thinking, content, deltas
        self.content.append(content)
        new = self.calls[self._sent:]
        deltas = [dict(c, index=i) for i, c in enumerate(new, self._sent)]
        self._sent += len(new)
        return thinking, content, deltas


def parse_tool_calls(text: str, s: Structure, fmt: ToolFormat) -> tuple[str | None, list[dict]]:
    """A finished choice's text -> (content, OpenAI tool_calls)."""
    parser = ToolCallParser(s, fmt)
    parser.feed(text)
    parser.finish()
    return parser.message()
