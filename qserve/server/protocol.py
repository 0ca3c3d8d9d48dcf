"""OpenAI's wire format: request bodies -> SamplingParams, engine outputs -> response JSON.

Validation happens here, at the edge: a wrong type or an out-of-range value becomes an
`APIError` (400, OpenAI's error shape) naming the field. Fields OpenAI has and qserve does
not use (`user`, `logit_bias`, ...) and unknown fields are ignored, as OpenAI does.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from qserve.outputs import CompletionOutput, RequestOutput
from qserve.pooling_params import PoolingParams
from qserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from qserve.server.reasoning import Reasoning
from qserve.server.structured import Structure, StructureError, parse_structure
from qserve.server.tool_calls import check_tool_history

MAX_N = 32
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# template variables qserve sets itself, which chat_template_kwargs may not
TEMPLATE_OWN = ("messages", "tools", "documents", "add_generation_prompt", "bos_token",
                "eos_token")


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class GenerateRequest:
    """What a completion or chat request asks for, validated."""

    model: str | None
    prompts: list[str | list[int]]  # chat: empty until the template is applied
    messages: list[dict] | None  # chat only
    params: SamplingParams  # max_tokens is a placeholder until the prompt length is known
    max_tokens: int | None  # None: as many as the context leaves; 0 (echo only): the prompt
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # top-N alternatives to report per token; None: no logprobs
    structure: Structure = dataclasses.field(default_factory=Structure)  # response_format, tools
    # chat: chat_template_kwargs, the template's own variables (e.g. enable_thinking: false)
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    # chat: how the answer's thinking is read off (reasoning.py); set once the prompt is known
    reasoning: Reasoning | None = None


# ---- requests ---------------------------------------------------------------------------
_NUMBER = (int, float)


def _get(body: dict, name: str, kinds: tuple, what: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad(f"'{name}' must be {what}, not {type(value).__name__} {value!r}"[:200], name)
    if float in kinds and isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # JSON integers have no bound
            raise bad(f"'{name}' is too large a number", name) from None
    return value


def prompts_of(value, name: str) -> list[str | list[int]]:
    """A completion's `prompt` or an embedding's `input`: a string, a list of strings, a list
    of token ids or a list of token-id lists, as a list of prompts (none of them empty)."""
    if isinstance(value, str):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(_is_ids(p) for p in value):
        prompts = [list(value)]
    elif isinstance(value, list) and value and all(
            isinstance(p, list) and p and all(_is_ids(t) for t in p) for p in value):
        prompts = [list(p) for p in value]
    else:
        raise bad(f"'{name}' must be a string, a list of strings, a list of token ids, or a "
                  f"list of token-id lists", name)
    if any(p == "" for p in prompts):
        raise bad(f"'{name}' is empty; give at least one token of text", name)
    return prompts


def parse_completion(body: dict) -> GenerateRequest:
    prompts = prompts_of(body.get("prompt"), "prompt")
    logprobs = _get(body, "logprobs", (int,), "an integer from 0 to 20")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad(f"'logprobs'={logprobs} must be in [0, {MAX_LOGPROBS}]", "logprobs")
    return _common(body, prompts, None, _get(body, "max_tokens", (int,), "an integer", 16),
                   logprobs, echo=_get(body, "echo", (bool,), "a boolean", False))


@dataclass
class EmbeddingRequest:
    """POST /v1/embeddings, validated: OpenAI's fields and vLLM's `normalize`."""

    model: str | None
    inputs: list[str | list[int]]
    params: PoolingParams
    base64: bool  # encoding_format "base64": little-endian float32 bytes, base64-encoded


def parse_embeddings(body: dict, hidden_size: int) -> EmbeddingRequest:
    inputs = prompts_of(body.get("input"), "input")
    fmt = _get(body, "encoding_format", (str,), "a string", "float")
    if fmt not in ("float", "base64"):
        raise bad(f"'encoding_format' {fmt!r} must be float or base64"[:200], "encoding_format")
    dims = _get(body, "dimensions", (int,), "a positive integer")
    if dims is not None and not 1 <= dims <= hidden_size:
        raise bad(f"'dimensions'={dims} must be from 1 to the model's {hidden_size}",
                  "dimensions")
    normalize = _get(body, "normalize", (bool,), "a boolean", True)
    return EmbeddingRequest(_get(body, "model", (str,), "a string"), inputs,
                            PoolingParams(normalize=normalize, dimensions=dims), fmt == "base64")


def embeddings_response(req: EmbeddingRequest, model: str, finals: list[RequestOutput]
                        ) -> dict:
    """OpenAI's embeddings list: one entry per input, in order, and the tokens they took."""
    import base64

    import numpy as np

    def encode(vector: list[float]):
        if not req.base64:
            return vector
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")

    tokens = sum(len(out.prompt_token_ids) for out in finals)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(out.embedding)}
                     for i, out in enumerate(finals)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def parse_tokenize(body: dict) -> tuple[str | None, str, bool]:
    """POST /tokenize without `messages` (those make a chat request): the model asked for, the
    text, and whether to add the tokenizer's special tokens. vLLM's shape sends `prompt` and
    `add_special_tokens` (default true); llama.cpp's server sends `content` and `add_special`
    (default false)."""
    model = _get(body, "model", (str,), "a string")
    if "prompt" in body:
        text = _get(body, "prompt", (str,), "a string", "")
        special = _get(body, "add_special_tokens", (bool,), "a boolean", True)
    elif "content" in body:
        text = _get(body, "content", (str,), "a string", "")
        special = _get(body, "add_special", (bool,), "a boolean", False)
    else:
        raise bad("give the text to tokenize as 'prompt' (or 'content'), or a chat as "
                  "'messages'", "prompt")
    return model, text, special


def parse_detokenize(body: dict, vocab_size: int) -> tuple[str | None, list[int]]:
    """POST /detokenize: the model asked for and `tokens`, a list of ids in the vocabulary."""
    model = _get(body, "model", (str,), "a string")
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and all(_is_ids(t) for t in tokens)):
        raise bad("'tokens' must be a list of token ids", "tokens")
    wrong = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if wrong is not None:
        raise bad(f"'tokens' holds {wrong}, not a token id of this model (0 to "
                  f"{vocab_size - 1})", "tokens")
    return model, tokens


def _is_ids(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_chat(body: dict) -> GenerateRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise bad(f"messages[{i}] must have a role of {', '.join(CHAT_ROLES)}", "messages")
        try:
            calls = check_tool_history(m, i)
        except StructureError as e:
            raise bad(str(e), e.param) from None
        content = m.get("content")
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            calls = {"tool_call_id": m["tool_call_id"]}  # which call this result answers
        clean.append({"role": "system" if m["role"] == "developer" else m["role"],
                      "content": "" if content is None and calls else _content(content, i),
                      **calls})
    max_tokens = _get(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,), "an integer")
    want = _get(body, "logprobs", (bool,), "a boolean", False)
    top = _get(body, "top_logprobs", (int,), "an integer from 0 to 20")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad(f"'top_logprobs'={top} must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
    if top is not None and not want:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    variables = _get(body, "chat_template_kwargs", (dict,), "an object", {})
    own = next((k for k in variables if k in TEMPLATE_OWN), None)
    if own is not None:
        raise bad(f"'chat_template_kwargs' may not set {own!r}, which qserve sets itself",
                  "chat_template_kwargs")
    req = _common(body, [], clean, max_tokens, (top or 0) if want else None, echo=False)
    req.template_kwargs = variables
    return req


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                what = (f"a part of type {kind!r}" if isinstance(kind, str)
                        else f"the part {str(part)[:40]!r}")
                raise bad(f"messages[{i}].content: {what} is not served; only text parts are "
                          f"(a vision-language model runs as its language model alone)",
                          "messages")
            if not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: a text part's 'text' must be a string",
                          "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _common(body: dict, prompts, messages, max_tokens: int | None, logprobs: int | None,
            echo: bool) -> GenerateRequest:
    model = _get(body, "model", (str,), "a string")
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        raise bad(f"'max_tokens'={max_tokens} must be at least 1 (0 only with 'echo': true, "
                  f"which returns the prompt alone)", "max_tokens")
    temperature = _get(body, "temperature", _NUMBER, "a number", 1.0)
    if not 0 <= temperature <= 2:
        raise bad(f"'temperature'={temperature} must be in [0, 2]", "temperature")
    n = _get(body, "n", (int,), "an integer", 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"'n'={n} must be in [1, {MAX_N}]", "n")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad("'stop' must be a string or a list of strings", "stop")
    stream_options = _get(body, "stream_options", (dict,), "an object", {})
    sampling = dict(
        n=n, temperature=temperature,
        top_p=_get(body, "top_p", _NUMBER, "a number", 1.0),
        top_k=_get(body, "top_k", (int,), "an integer", 0),
        min_p=_get(body, "min_p", _NUMBER, "a number", 0.0),
        repetition_penalty=_get(body, "repetition_penalty", _NUMBER, "a number", 1.0),
        presence_penalty=_get(body, "presence_penalty", _NUMBER, "a number", 0.0),
        frequency_penalty=_get(body, "frequency_penalty", _NUMBER, "a number", 0.0),
        seed=_get(body, "seed", (int,), "an integer"),
        stop=[s for s in stop or [] if s],
        stop_token_ids=_get(body, "stop_token_ids", (list,), "a list of token ids", []),
        ignore_eos=_get(body, "ignore_eos", (bool,), "a boolean", False),
        min_tokens=_get(body, "min_tokens", (int,), "an integer", 0),
        logprobs=logprobs,
        # echo with logprobs reports the prompt's tokens too, as OpenAI's legacy completions
        # did (what lm-evaluation-harness scores a continuation with)
        prompt_logprobs=logprobs if echo else None,
    )
    _get(body, "user", (str,), "a string")
    if max_tokens is not None and sampling["min_tokens"] > max_tokens:
        raise bad(f"'min_tokens'={sampling['min_tokens']} must be at most 'max_tokens'="
                  f"{max_tokens}", "min_tokens")
    try:  # validate now, before tokenizing; max_tokens is fixed once the prompt length is known
        params = SamplingParams(max_tokens=max(max_tokens or 1, sampling["min_tokens"], 1),
                                **sampling)
    except SamplingParamsError as e:
        raise bad(str(e), e.param) from None
    try:
        structure = parse_structure(body, chat=messages is not None)
    except StructureError as e:
        raise bad(str(e), e.param) from None
    return GenerateRequest(model, prompts, messages, params, max_tokens,
                           _get(body, "stream", (bool,), "a boolean", False),
                           bool(stream_options.get("include_usage")), echo, logprobs, structure)


def fit_to_context(req: GenerateRequest, prompt_lens: list[int], max_model_len: int,
                   param: str = "prompt") -> SamplingParams:
    """The request's params with max_tokens set; a prompt or a prompt + max_tokens over the
    context is refused with code `context_length_exceeded`, as OpenAI does."""
    longest = max(prompt_lens)
    if longest >= max_model_len:
        raise bad(f"This model's maximum context length is {max_model_len} tokens; the prompt "
                  f"has {longest} tokens. Shorten it to at most {max_model_len - 1} tokens.",
                  param, "context_length_exceeded")
    if req.max_tokens is None:
        room = max_model_len - longest
        if req.params.min_tokens > room:
            raise bad(f"This model's maximum context length is {max_model_len} tokens; the "
                      f"prompt has {longest} tokens, which leaves room for {room}, fewer than "
                      f"min_tokens={req.params.min_tokens}. Lower min_tokens or shorten the "
                      f"prompt.", "min_tokens", "context_length_exceeded")
        return dataclasses.replace(req.params, max_tokens=room)
    if longest + req.max_tokens > max_model_len:
        raise bad(f"This model's maximum context length is {max_model_len} tokens; you asked "
                  f"for {longest + req.max_tokens} ({longest} in the prompt, {req.max_tokens} "
                  f"in the completion). Lower max_tokens or shorten the prompt.",
                  "max_tokens", "context_length_exceeded")
    # max_tokens 0 (with echo) samples one token, which the response leaves out
    return dataclasses.replace(req.params, max_tokens=max(req.max_tokens, 1))


# ---- responses --------------------------------------------------------------------------
def finish_reason(c: CompletionOutput, tool_calls: bool = False) -> str | None:
    """OpenAI's reasons; an abort (only at shutdown) reads as "stop"; an answer that called a
    tool and was not cut short, "tool_calls"."""
    if c.finish_reason is None:
        return None
    if c.finish_reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(outputs: list[RequestOutput], prompt_only: bool = False) -> dict:
    """prompt_only: echo with max_tokens 0, whose one sampled token the response omits."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = 0 if prompt_only else sum(c.num_tokens for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def envelope(rid: str, kind: str, created: int, model: str, choices: list, **extra) -> dict:
    return {"id": rid, "object": kind, "created": created, "model": model,
            "choices": choices, **extra}


def now() -> int:
    return int(time.time())


class LogprobFormatter:
    """Engine logprobs ({token_id: logprob} per token, top-N plus the chosen) in OpenAI's two
    shapes. Token strings are decoded here, in the handler, not on the engine thread."""

    def __init__(self, tokenizer, top_n: int):
        self.tokenizer, self.top_n = tokenizer, top_n
        self._strings: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        s = self._strings.get(token_id)
        if s is None:
            s = self._strings[token_id] = self.tokenizer.decode([token_id],
                                                                skip_special_tokens=False)
        return s

    def _top(self, lp: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(lp.items(), key=lambda kv: -kv[1])[: self.top_n]

    def completion(self, ids: list[int], lps: list[dict[int, float]], offset: int) -> dict:
        tokens, chosen, tops, offsets = [], [], [], []
        for tid, lp in zip(ids, lps):
            s = self.token(tid)
            tokens.append(s)
            chosen.append(lp[tid])
            tops.append({self.token(t): v for t, v in self._top(lp)})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops,
                "text_offset": offsets}

    def prompt(self, ids: list[int], lps: list[dict[int, float] | None]) -> dict:
        """completion()'s shape for echoed prompt tokens: the first has no logprob (null), as
        nothing precedes it; offsets count from the prompt's start."""
        rest = self.completion(ids[1:], lps[1:], len(self.token(ids[0])))
        return {"tokens": [self.token(ids[0]), *rest["tokens"]],
                "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]],
                "text_offset": [0, *rest["text_offset"]]}

    @staticmethod
    def join(first: dict, then: dict | None) -> dict:
        """Two completion() objects, one after the other."""
        return first if then is None else {k: first[k] + then[k] for k in first}

    def chat(self, ids: list[int], lps: list[dict[int, float]]) -> dict:
        def item(tid: int, v: float) -> dict:
            s = self.token(tid)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        return {"content": [dict(item(tid, lp[tid]),
                                 top_logprobs=[item(t, v) for t, v in self._top(lp)])
                            for tid, lp in zip(ids, lps)]}
