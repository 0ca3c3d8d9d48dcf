"""Structured outputs and tool calls: OpenAI's `response_format`, `tools` and `tool_choice`.

A request's structure becomes a grammar (xgrammar compiles JSON schemas and structural tags
against the model's vocabulary); the grammar rides down to the engine as a TokenConstraint on
SamplingParams, and the sampler asks it for a token mask each step:

    response_format json_object         any JSON object
    response_format json_schema         that schema
    tool_choice named                   the function's arguments (a JSON object)
    tool_choice required                [{"name": tool, "arguments": {...}}, ...], at least one
    tool_choice auto                    free text; after "<tool_call>" one call and its close tag

Why xgrammar: it precomputes, per grammar, which tokens each grammar position allows, so a
step's mask on a CPU costs microseconds; it is what vLLM and SGLang use. llguidance computes
masks lazily (no compile cost) but each mask costs more, and a server re-uses its schemas.

GrammarConstraint keeps one matcher per sample, found by the sample's output so far: a matcher
is advanced over the tokens it has not seen, or rolled back where the output differs. So it
needs no hook in the engine beyond the mask: the n samples of a request diverge on their own,
and a sequence preempted (recomputed or swapped) keeps its tokens and so its grammar state.
With speculative decoding the verifier masks the target at each draft position (the rows see
O, O + x_1, ...), so a draft the grammar forbids is rejected like any other unlikely one.

Masks do not stall the batch: the server's output thread, which receives each step's tokens
while the engine thread starts the next forward pass, calls `prefetch` to fill the next masks
then; `mask` copies them (and fills itself only what was not prefetched, e.g. a first token).
xgrammar caches the token sets per grammar position, so a fill is mostly a lookup.
"""
from __future__ import annotations

import json
import re
import threading
import uuid
from dataclasses import dataclass, field

import torch

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMS = {"type": "object", "properties": {}}


class StructureError(ValueError):
    """A malformed response_format / tools / tool_choice, or a schema the grammar engine
    refuses; `param` names the field (the 400's `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# ---- what a request asks for ------------------------------------------------------------
@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # a JSON schema for the arguments object


@dataclass
class Structure:
    """The parsed structure fields of one request. `grammar` is ("json_schema", text) or
    ("tool_tag", text) or None (unconstrained)."""

    tools: list[Tool] = field(default_factory=list)
    tool_mode: str | None = None  # None (no tool calls), "auto", "required" or "named"
    named: str | None = None  # the function tool_choice names
    grammar: tuple[str, str] | None = None

    @property
    def parses_tools(self) -> bool:
        return self.tool_mode is not None


def parse_structure(body: dict, chat: bool) -> Structure:
    """response_format, tools and tool_choice of a request body, checked. Raises StructureError."""
    s = Structure()
    rf = body.get("response_format")
    schema = None if rf is None else _response_schema(rf)
    if not chat:
        for name in ("tools", "tool_choice"):
            if body.get(name) is not None:
                raise StructureError(f"'{name}' is for /v1/chat/completions", name)
        s.grammar = None if schema is None else ("json_schema", _dump(schema))
        return s
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not isinstance(body.get("parallel_tool_calls", True), bool):
        raise StructureError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is not None:
        s.tools = _tools(tools)
    if choice is not None and not s.tools:
        raise StructureError("'tool_choice' needs a non-empty 'tools' list", "tool_choice")
    if s.tools:
        s.tool_mode, s.named = _tool_choice("auto" if choice is None else choice, s.tools)
    if s.tool_mode == "none":
        s.tool_mode, s.tools = None, []
    if s.tool_mode is not None and schema is not None:
        raise StructureError("give 'response_format' or 'tools', not both (or tool_choice "
                             "\"none\")", "response_format")
    if schema is not None:
        s.grammar = ("json_schema", _dump(schema))
    elif s.tool_mode == "named":
        params = next(t.parameters for t in s.tools if t.name == s.named)
        s.grammar = ("json_schema", _dump(params))
    elif s.tool_mode == "required":
        calls = {"type": "array", "minItems": 1,
                 "items": {"anyOf": [_call_schema(t) for t in s.tools]}}
        if body.get("parallel_tool_calls") is False:
            calls["maxItems"] = 1
        s.grammar = ("json_schema", _dump(calls))
    elif s.tool_mode == "auto":
        s.grammar = ("tool_tag", _dump([{"name": t.name, "parameters": t.parameters}
                                        for t in s.tools]))
    return s


def _response_schema(rf) -> dict | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise StructureError("'response_format' must be {\"type\": \"text\"}, {\"type\": "
                             "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                             "{\"name\": ..., \"schema\": {...}}}", "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"type": "object"}
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise StructureError("'response_format.json_schema' must be an object with a "
                             "'schema'", "response_format")
    schema = js.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise StructureError("'response_format.json_schema.schema' must be a JSON schema "
                             "object", "response_format")
    return schema if isinstance(schema, dict) else ({} if schema else {"not": {}})


def _tools(tools) -> list[Tool]:
    if not isinstance(tools, list) or not tools:
        raise StructureError("'tools' must be a non-empty list of {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not _NAME.match(name):
            raise StructureError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                 f"{{\"name\": ...}}}} with a name of 1-64 letters, digits, _ "
                                 f"or -", "tools")
        if name in seen:
            raise StructureError(f"tools[{i}]: the name {name!r} is used twice", "tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = _EMPTY_PARAMS
        if not isinstance(params, dict):
            raise StructureError(f"tools[{i}].function.parameters must be a JSON schema "
                                 f"object", "tools")
        out.append(Tool(name, params))
    return out


def _tool_choice(choice, tools: list[Tool]) -> tuple[str, str | None]:
    if choice in ("auto", "none", "required"):
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) and choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise StructureError("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                             "tool_choice")
    if name not in {t.name for t in tools}:
        raise StructureError(f"'tool_choice' names {name[:64]!r}, which is not in 'tools'",
                             "tool_choice")
    return "named", name


def _call_schema(t: Tool) -> dict:
    return {"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _dump(obj) -> str:
    """JSON text that keeps key order: a schema's property order is the order the grammar
    writes them in."""
    return json.dumps(obj, ensure_ascii=False)


# ---- the prompt side of tools -----------------------------------------------------------
def tool_messages(messages: list[dict], s: Structure) -> list[dict]:
    """Messages as a plain chat template renders them: tool definitions in the system
    message, an assistant's earlier tool calls and the tool results as tagged text."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n"
                                                   f"</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(f"{TOOL_OPEN}\n{_dump(c)}\n{TOOL_CLOSE}" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" + calls).strip()})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if s.tools and s.tool_mode is not None:
        listing = "\n".join(_dump({"type": "function", "function": {
            "name": t.name, "parameters": t.parameters}}) for t in s.tools)
        intro = ("You can call these functions (JSON signatures, one a line):\n"
                 f"{listing}\nTo call one, answer with {TOOL_OPEN}{{\"name\": NAME, "
                 f"\"arguments\": {{...}}}}{TOOL_CLOSE}; several calls may follow each other.")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + intro}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out


def check_tool_history(m: dict, i: int) -> dict:
    """The `tool_calls` of one incoming chat message (an assistant's earlier calls), checked.
    Returns {"tool_calls": [{name, arguments}]} or {}."""
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
                and isinstance(fn.get("arguments", "{}"), str)):
            raise StructureError(f"messages[{i}].tool_calls entries must be {{\"type\": "
                                 f"\"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                                 "messages")
        try:
            args = json.loads(fn.get("arguments", "{}"))
        except (ValueError, RecursionError):  # kept as the text it was
            args = fn.get("arguments")
        out.append({"name": fn["name"], "arguments": args})
    return {"tool_calls": out}


# ---- the output side of tools -----------------------------------------------------------
def parse_tool_calls(text: str, s: Structure) -> tuple[str | None, list[dict]]:
    """A finished sample's text -> (content, OpenAI tool_calls). Text that does not parse as
    the calls its mode promises (a length cut, say) stays content, with no calls."""
    calls: list[tuple[str, object]] = []
    content: str | None = text
    if s.tool_mode == "named":
        try:
            calls, content = [(s.named, json.loads(text))], None
        except (ValueError, RecursionError):
            pass
    elif s.tool_mode == "required":
        try:
            items = json.loads(text)
            calls, content = [(c["name"], c["arguments"]) for c in items], None
        except (ValueError, TypeError, KeyError, RecursionError):
            calls = []
    elif s.tool_mode == "auto":
        rest, pos = [], 0
        for m in re.finditer(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), text,
                             re.S):
            try:
                c = json.loads(m.group(1))
                calls.append((c["name"], c["arguments"]))
            except (ValueError, TypeError, KeyError, RecursionError):
                continue
            rest.append(text[pos:m.start()])
            pos = m.end()
        rest.append(text[pos:])
        content = "".join(rest).strip() or None if calls else text
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": _dump_args(args)}}
                     for name, args in calls]


def _dump_args(args) -> str:
    return json.dumps(args, ensure_ascii=False)


class ToolStream:
    """One streamed choice of a tool-calling request: what text may go out as content now.
    Named / required calls are all JSON, held until the end; in auto mode content streams
    until the text could be opening a call ("<tool_c..."), and from a call on it is held."""

    def __init__(self, s: Structure):
        self.s = s
        self.text = ""
        self.sent = 0  # characters of text sent as content

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.s.tool_mode != "auto":
            return ""
        at = self.text.find(TOOL_OPEN, self.sent)
        end = at if at >= 0 else len(self.text) - _partial_suffix(self.text, TOOL_OPEN)
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet sent, tool calls) once the sample has finished."""
        content, calls = parse_tool_calls(self.text, self.s)
        if not calls:
            return self.text[self.sent:], []
        if self.s.tool_mode != "auto" or content is None:
            return "", calls
        # auto: the content outside the calls, less what already went out
        sent = self.text[:self.sent]
        return (content[len(sent):] if content.startswith(sent) else ""), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# ---- grammars ---------------------------------------------------------------------------
class Grammars:
    """Compiles structures against one model's vocabulary (thread-safe; call it off the event
    loop: the first compile builds the vocabulary table, a schema takes milliseconds). Logit
    columns past the tokenizer's vocabulary (padded embeddings) are never allowed."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise StructureError("structured outputs need the xgrammar package "
                                         "(pip install 'qserve[server]')",
                                         "response_format") from None
                backend = self.tokenizer.backend
                # the vocabulary's encoding (byte-level, byte fallback, raw) from its decoder
                meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
                vocab = [backend.id_to_token(i) or "" for i in range(self.vocab_size)]
                info = xgr.TokenizerInfo(
                    vocab, vocab_type=xgr.VocabType(meta["vocab_type"]),
                    vocab_size=self.vocab_size,
                    stop_token_ids=sorted(self.tokenizer.eos_token_ids),
                    add_prefix_space=meta["add_prefix_space"])
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def constraint(self, s: Structure) -> GrammarConstraint | None:
        """The TokenConstraint for a request's structure (None when it has none)."""
        if s.grammar is None:
            return None
        compiler = self._get_compiler()
        kind, text = s.grammar
        param = "response_format" if not s.parses_tools else "tools"
        try:
            if kind == "json_schema":
                # any_whitespace=False: separators are fixed, so a small model cannot wander
                # off into whitespace forever
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            else:
                compiled = self._compile_tool_tag(compiler, json.loads(text))
        except Exception as e:  # xgrammar raises RuntimeError / ValueError for bad schemas
            msg = str(e).splitlines()[-1] if str(e) else type(e).__name__
            msg = re.sub(r"^\[[\d:]+\] \S+: ", "", msg)
            raise StructureError(f"the JSON schema cannot be used: {msg}"[:300], param) from None
        return GrammarConstraint(compiled, self.vocab_size)

    @staticmethod
    def _compile_tool_tag(compiler, tools: list[dict]):
        import xgrammar as xgr

        tags = [xgr.StructuralTagItem(begin=f'{TOOL_OPEN}{{"name": {json.dumps(t["name"])}, '
                                            f'"arguments": ',
                                      schema=json.dumps(t["parameters"]), end=f"}}{TOOL_CLOSE}")
                for t in tools]
        return compiler.compile_structural_tag(tags, [TOOL_OPEN])


@dataclass
class _Track:
    """One sample's matcher and the output tokens it has been fed."""

    matcher: object
    tokens: list[int] = field(default_factory=list)
    left: bool = False  # a token the grammar refused (ignore_eos past its end): no mask since
    next_mask: torch.Tensor | None = None  # (ceil(V/32),) prefetched for exactly `tokens`


class GrammarConstraint:
    """A compiled grammar as a TokenConstraint: the sampler calls `mask` on the engine thread
    with every row of this request in a step. The server's output thread calls `prefetch`
    with the samples' outputs as soon as a step has produced them, so the next masks are
    filled while the engine runs its next forward pass; `mask` then only copies them."""

    def __init__(self, compiled, vocab_size: int):
        self.compiled, self.vocab_size = compiled, vocab_size
        self._tracks: list[_Track] = []  # at most one per sample that ran in the same step
        self._lock = threading.Lock()  # the engine thread (mask) and output thread (prefetch)

    def mask(self, logits: torch.Tensor, outputs: list[list[int]]) -> None:
        """logits (R, V) in place: -inf where row r's grammar state after outputs[r] forbids."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(outputs), self.vocab_size)  # (R, ceil(V/32))
        with self._lock:
            claimed: set[int] = set()
            for r, out in enumerate(outputs):
                track = self._claim(out, claimed)
                if track.next_mask is not None:
                    bitmask[r] = track.next_mask
                else:
                    self._fill(track, bitmask, r)
        V = min(self.vocab_size, logits.shape[1])
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=V)
        logits[:, V:] = float("-inf")  # ids the tokenizer does not have

    def prefetch(self, outputs: list[list[int]]) -> None:
        """Fill the masks that follow `outputs` (the unfinished samples' output token ids after
        a step) ahead of the `mask` call that will ask for them."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(outputs), self.vocab_size)
        with self._lock:
            claimed: set[int] = set()
            for r, out in enumerate(outputs):
                track = self._claim(out, claimed)
                if track.next_mask is None:
                    self._fill(track, bitmask, r)
                    track.next_mask = bitmask[r]

    @staticmethod
    def _fill(track: _Track, bitmask: torch.Tensor, r: int) -> None:
        if track.left or track.matcher.is_terminated():
            bitmask[r] = -1  # all bits set: everything allowed
        else:
            track.matcher.fill_next_token_bitmask(bitmask, r)

    def _claim(self, out: list[int], claimed: set[int]) -> _Track:
        """The unclaimed track closest to `out` (a prefix of it, when the sample ran before),
        brought up to `out`; a new one when all are claimed."""
        best, best_common = None, -1
        for k, t in enumerate(self._tracks):
            if k in claimed:
                continue
            n = len(t.tokens)
            common = n if out[:n] == t.tokens else _common_prefix(out, t.tokens)
            if common > best_common:
                best, best_common = k, common
                if common == n:
                    break
        if best is None:
            self._tracks.append(_Track(self._new_matcher()))
            best, best_common = len(self._tracks) - 1, 0
        claimed.add(best)
        track = self._tracks[best]
        back = len(track.tokens) - best_common
        if back or best_common < len(out):
            track.next_mask = None  # for another state
        if back:
            if track.left:  # refused tokens were never fed: start again
                track.matcher, track.left, best_common = self._new_matcher(), False, 0
            else:
                track.matcher.rollback(back)
            del track.tokens[best_common:]
        for token in out[best_common:]:
            if not track.left and not track.matcher.accept_token(token):
                track.left = True
            track.tokens.append(token)
        return track

    def _new_matcher(self):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
