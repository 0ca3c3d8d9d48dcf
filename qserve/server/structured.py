"""Structured outputs and tool calls: OpenAI's `response_format`, `tools` and `tool_choice`.

A request's structure becomes a grammar (xgrammar compiles JSON schemas and structural tags
against the model's vocabulary); the grammar rides down to the engine as a TokenConstraint on
SamplingParams, and the sampler asks it for a token mask each step. A tool call is written in
the model family's own format (ToolFormat: Qwen's `<tool_call>` tags, Llama 3's bare JSON),
`CALL = open {"name": NAME, "arguments": ARGS} close`:

    response_format json_object         any JSON object
    response_format json_schema         that schema
    tool_choice named                   one CALL of that function
    tool_choice required                CALL (separator CALL)*; one CALL if not parallel
    tool_choice auto                    free text, and from the format's trigger on a CALL
    auto + response_format              the response schema's JSON, or CALL (separator CALL)*

ARGS follows the function's parameter schema. tool_calls.py renders the prompt side and parses
the calls back out of the text, also as they stream.

Why xgrammar: it precomputes, per grammar, which tokens each grammar position allows, so a
step's mask on a CPU costs microseconds; it is what vLLM and SGLang use. llguidance computes
masks lazily (no compile cost) but each mask costs more, and a server re-uses its schemas.

GrammarConstraint keeps one matcher per sample, found by the sample's output so far: a matcher
is advanced over the tokens it has not seen, or rolled back where the output differs. So it
needs no hook in the engine beyond the mask: the n samples of a request diverge on their own,
and a sequence preempted (recomputed or swapped) keeps its tokens and so its grammar state.
With speculative decoding the verifier masks the target at each draft position (the rows see
O, O + x_1, ...), so a draft the grammar forbids is rejected like any other unlikely one.

Masks do not stall the batch. Most are never filled: a greedy or temperature-only row samples
first and asks `allows` (one accept_token), and only a refused token costs a mask (see
engine/sampler.py). A fill inside a length-bounded JSON string takes up to ~10 ms of CPU; the
bench's 16 greedy json answers refused 436 of 1,391 tokens, and their grammar work fell from
1.40 s to 0.52 s. For rows that must mask first (top-k, top-p, min-p) the server's output
thread, which receives each step's tokens while the engine thread starts the next forward
pass, calls `prefetch` to fill the next masks then; `mask` copies them (and fills itself only
what was not prefetched, e.g. a first token).
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field

import torch

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
    description: str | None = None

    def openai(self) -> dict:
        """The definition as OpenAI (and a chat template's `tools`) spells it; the description
        is "" when none was given (templates such as Hermes 3's concatenate it)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description or "",
            "parameters": self.parameters}}


@dataclass
class Structure:
    """The parsed structure fields of one request. `grammar` is ("json_schema", schema text),
    ("tools", the response_format schema text or "") or None (unconstrained)."""

    tools: list[Tool] = field(default_factory=list)
    tool_mode: str | None = None  # None (no tool calls), "auto", "required" or "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: more than one call in an answer
    grammar: tuple[str, str] | None = None

    @property
    def parses_tools(self) -> bool:
        return self.tool_mode is not None

    @property
    def forces_text(self) -> bool:
        """Whether the grammar writes the answer from its first token (JSON, or calls only),
        which leaves a reasoning model no room to think first; tool_choice auto without a
        response_format leaves free text until a call."""
        free = self.grammar == ("tools", "") and self.tool_mode == "auto"
        return self.grammar is not None and not free


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
    s.parallel = body.get("parallel_tool_calls") is not False
    if s.tool_mode is not None:
        # with tools, response_format shapes the answer that is not a call: only under "auto"
        # (required / a named function leave no such answer, so the tool grammar wins)
        answer = schema if s.tool_mode == "auto" else None
        s.grammar = ("tools", "" if answer is None else _dump(answer))
    elif schema is not None:
        s.grammar = ("json_schema", _dump(schema))
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
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise StructureError(f"tools[{i}].function.parameters must be a JSON schema of an "
                                 f"object ({{\"type\": \"object\", ...}})", "tools")
        if "type" not in params:  # arguments are always an object, as OpenAI writes them
            params = {"type": "object", **params}
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise StructureError(f"tools[{i}].function.description must be a string", "tools")
        out.append(Tool(name, params, description))
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


def _dump(obj) -> str:
    """JSON text that keeps key order: a schema's property order is the order the grammar
    writes them in."""
    return json.dumps(obj, ensure_ascii=False)


# ---- how a model family writes a tool call ----------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    """One family's call text: `open {"name": NAME, "<key>": ARGS} close`, calls joined by
    `separator`. In free text (tool_choice auto) a call starts where `trigger` does."""

    name: str
    open: str
    close: str
    key: str  # the arguments' field: "arguments" or "parameters"
    separator: str = "\n"

    def begin(self, name: str) -> str:
        """The fixed text of a call to `name` up to its arguments."""
        return f'{self.open}{{"name": {json.dumps(name)}, "{self.key}": '

    @property
    def end(self) -> str:
        return "}" + self.close

    @property
    def trigger(self) -> str:
        return self.open or '{"name": '

    def write(self, name: str, arguments) -> str:
        """A call as text (an earlier call in the prompt): the grammar's separators."""
        return self.begin(name) + _dump(arguments) + self.end


# Qwen 2.5/3, Hermes, SmolLM3 and qserve's own prompt (a template that cannot list tools)
HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments")
# Llama 3.1-3.3: a bare JSON object with "parameters"
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "parameters")


def tool_format(tokenizer) -> ToolFormat:
    """The call format the model's chat template teaches: Llama 3's JSON when its template
    lists tools and asks for {"name": ..., "parameters": ...}, else Hermes-style tags."""
    source = tokenizer.tool_use_template or tokenizer.chat_template or ""
    if (tokenizer.chat_template_renders_tools and "<tool_call>" not in source
            and re.search(r'"parameters"\s*:', source)):
        return LLAMA3_JSON
    return HERMES


# ---- grammars ---------------------------------------------------------------------------
class Grammars:
    """Compiles structures against one model's vocabulary and tool-call format (thread-safe;
    call it off the event loop: the first compile builds the vocabulary table, a schema takes
    milliseconds). Logit columns past the tokenizer's vocabulary (padded embeddings) are never
    allowed."""

    def __init__(self, tokenizer, fmt: ToolFormat | None = None):
        self.tokenizer = tokenizer
        self.fmt = fmt or tool_format(tokenizer)
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
        param = "response_format"
        try:
            if kind == "json_schema":
                # any_whitespace=False: separators are fixed, so a small model cannot wander
                # off into whitespace forever
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            else:
                answer = _json(json.loads(text)) if text else None
                param = "tools"
                compiled = compiler.compile_structural_tag(self._tool_tag(s, answer))
        except Exception as e:  # xgrammar raises RuntimeError / ValueError for bad schemas
            msg = str(e).splitlines()[-1] if str(e) else type(e).__name__
            msg = re.sub(r"^\[[\d:]+\] \S+: ", "", msg)
            raise StructureError(f"the JSON schema cannot be used: {msg}"[:300], param) from None
        return GrammarConstraint(compiled, self.vocab_size)

    def _tool_tag(self, s: Structure, answer: dict | None) -> dict:
        """The structural tag of a tool-calling request (the table in the module docstring);
        `answer`: the response_format content a tool_choice "auto" answer may be instead."""
        fmt = self.fmt
        tags = [{"type": "tag", "begin": fmt.begin(t.name), "content": _json(t.parameters),
                 "end": fmt.end}
                for t in s.tools if s.tool_mode != "named" or t.name == s.named]
        if s.tool_mode == "auto" and answer is None:
            calls = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
                     "stop_after_first": not s.parallel}
        else:
            calls = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
                     "at_least_one": True,
                     "stop_after_first": s.tool_mode == "named" or not s.parallel}
            if answer is not None:
                calls = {"type": "or", "elements": [answer, calls]}
        return {"type": "structural_tag", "format": calls}


def _json(schema: dict) -> dict:
    """A structural tag's JSON content with the separators of compile_json_schema(...,
    any_whitespace=False): `, ` and `: `, no other whitespace, so the text a call writes is
    the text tool_calls.py parses, and a small model cannot wander off into whitespace."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(_dump(schema), any_whitespace=False))
    return {"type": "grammar", "grammar": ebnf}


@dataclass
class _Track:
    """One sample's matcher and the output tokens it has been fed."""

    matcher: object
    tokens: list[int] = field(default_factory=list)
    left: bool = False  # a token the grammar refused (ignore_eos past its end): no mask since
    next_mask: torch.Tensor | None = None  # (ceil(V/32),) prefetched for exactly `tokens`


class GrammarConstraint:
    """A compiled grammar as a TokenConstraint: the sampler calls `allows` (or `mask`) on the
    engine thread with every row of this request in a step. For rows that mask first, the
    server's output thread calls `prefetch` with the samples' outputs as soon as a step has
    produced them, so the next masks are filled while the engine runs its next forward pass;
    `mask` then only copies them."""

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

    def allows(self, outputs: list[list[int]], tokens: list[int]) -> list[bool]:
        """Whether tokens[r] may follow outputs[r]. An allowed token is taken as that row's
        next, so the next step's call starts from it."""
        result = []
        with self._lock:
            claimed: set[int] = set()
            for out, token in zip(outputs, tokens):
                track = self._claim(out, claimed)
                if track.left or track.matcher.is_terminated():
                    result.append(True)  # what the mask allows: everything
                    continue
                ok = 0 <= token < self.vocab_size and track.matcher.accept_token(token)
                if ok:
                    track.tokens.append(token)
                    track.next_mask = None
                result.append(ok)
        return result

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
        """The unclaimed track closest to `out` (a prefix of it, when the sample ran before;
        else the longest common start, then the least to roll back), brought up to `out`; a
        new one when all are claimed."""
        best, best_key, best_common = None, None, -1
        for k, t in enumerate(self._tracks):
            if k in claimed:
                continue
            n = len(t.tokens)
            common = n if out[:n] == t.tokens else _common_prefix(out, t.tokens)
            if best_key is None or (common, common - n) > best_key:
                best, best_key, best_common = k, (common, common - n), common
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
