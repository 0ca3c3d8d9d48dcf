"""Ollama's REST API (/api/...) over the same engine, for the clients that speak only it.

A request is translated into the OpenAI request it means and validated by protocol.py, so
both APIs run the same sampling, structured outputs and tools; only the shapes differ:

    /api/chat       messages, tools, format ("json" or a JSON schema), options  -> a chat
    /api/generate   prompt (+ system) through the chat template; raw: as written -> a completion
    /api/embed      input (text or texts), unit vectors; /api/embeddings: prompt, as computed
    /api/tags, /api/ps, /api/show, /api/version: the one model this server holds

`stream` defaults to true, as in Ollama: newline-delimited JSON objects, the last with
`done: true`, `done_reason` and the counts and durations (nanoseconds) Ollama reports.
Errors are Ollama's `{"error": "..."}` with the HTTP status.
"""
from __future__ import annotations

import datetime
import json

from qserve.server import protocol as P
from qserve.server.tool_calls import ToolCallParser

# Ollama's options -> the OpenAI (and vLLM) request fields protocol.py reads
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


class OllamaError(Exception):
    """Answered as `{"error": message}` with `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _check(body: dict, images_in: list) -> dict:
    """The options object, with what qserve does not serve refused in one line."""
    for key in ("suffix", "template", "context"):
        if body.get(key):
            raise OllamaError(400, f"'{key}' is not supported by qserve")
    if any(images_in):
        raise OllamaError(400, "images are not served; only text is (a vision-language model "
                               "runs as its language model alone)")
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise OllamaError(400, "'options' must be an object")
    return options


def openai_request(body: dict, chat: bool) -> dict:
    """The OpenAI chat (or, for a raw /api/generate, completion) request `body` means."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise OllamaError(400, "'messages' must be a list of {role, content} objects")
        images = [m.get("images") for m in messages if isinstance(m, dict)]
    else:
        images = [body.get("images")]
    options = _check(body, images)
    out = {"model": body.get("model"), "stream": body.get("stream", True)}
    for ours, theirs in OPTIONS.items():
        if options.get(ours) is not None:
            out[theirs] = options[ours]
    predict = options.get("num_predict")
    if predict is not None and not (isinstance(predict, int) and predict < 0):
        out["max_tokens"] = predict  # -1 (or -2): as many as the context leaves
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise OllamaError(400, f"'format' must be \"json\" or a JSON schema, not {fmt!r}"[:200])
    if chat:
        out["messages"] = [_message(m) for m in messages]
        if body.get("tools"):
            out["tools"] = body["tools"]
    elif body.get("raw"):
        out["prompt"] = body.get("prompt")
    else:  # through the model's chat template, as Ollama's default template does
        system = body.get("system")
        out["messages"] = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": body.get("prompt")}]
    return out


def _message(m) -> dict:
    """An Ollama chat message as OpenAI's: its tool calls' arguments as JSON text."""
    if not isinstance(m, dict):
        return m  # protocol.py refuses it
    out = {k: v for k, v in m.items() if k not in ("images", "tool_calls", "tool_name",
                                                    "thinking")}
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": c["function"].get("name"),
                          "arguments": json.dumps(c["function"].get("arguments", {}))}}
            if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
            for i, c in enumerate(calls)]
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def stats(out) -> dict:
    """Ollama's closing counts and durations (ns) of one finished request."""
    m = out.metrics
    ns = lambda a, b: max(0, int((b - a) * 1e9)) if a is not None and b is not None else 0  # noqa: E731
    end = m.finished_time
    return {"total_duration": ns(m.arrival_time, end), "load_duration": 0,
            "prompt_eval_count": len(out.prompt_token_ids),
            "prompt_eval_duration": ns(m.first_scheduled_time, m.first_token_time),
            "eval_count": sum(c.num_tokens for c in out.outputs),
            "eval_duration": ns(m.first_token_time, end)}


def _calls(openai_calls: list[dict]) -> list[dict]:
    """OpenAI's tool calls (arguments as JSON text) as Ollama's (arguments as an object)."""
    out = []
    for c in openai_calls:
        args = c["function"]["arguments"]
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:  # (the grammar keeps them JSON; a cut call is not a call)
            pass
        out.append({"function": {"name": c["function"]["name"], "arguments": args}})
    return out


class OllamaResponse:
    """One /api/chat or /api/generate answer, whole or as NDJSON lines."""

    def __init__(self, model: str, chat: bool, req: P.GenerateRequest, tool_format):
        self.model, self.chat, self.req, self.tool_format = model, chat, req, tool_format

    def _parser(self) -> ToolCallParser | None:
        return (ToolCallParser(self.req.structure, self.tool_format)
                if self.req.structure.parses_tools else None)

    def _body(self, text: str, calls: list[dict], out=None) -> dict:
        body = {"model": self.model, "created_at": now()}
        if self.chat:
            body["message"] = {"role": "assistant", "content": text}
            if calls:
                body["message"]["tool_calls"] = _calls(calls)
        else:
            body["response"] = text
        body["done"] = out is not None
        if out is not None:
            c = out.outputs[0]
            body["done_reason"] = "length" if c.finish_reason == "length" else "stop"
            body |= stats(out)
        return body

    def whole(self, out) -> dict:
        c, calls = out.outputs[0], []
        text = c.text
        parser = self._parser()
        if parser is not None:
            parser.feed(c.text)
            parser.finish()
            text, calls = parser.message()
        return self._body(text or "", calls, out)

    async def stream(self, gen):
        parser = self._parser()
        try:
            async for _, out in gen:
                c = out.outputs[0]
                text = c.delta_text
                if parser is not None:
                    text, _ = parser.feed(text)  # calls go out whole, at the end
                    if c.finish_reason is not None:
                        text += parser.finish()[0]
                if text:
                    yield _line(self._body(text, []))
                if out.finished:
                    calls = parser.message()[1] if parser is not None else []
                    yield _line(self._body("", calls, out))
        except Exception as e:  # (EngineStopped: the server is shutting down)
            yield _line({"error": str(e)})


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def model_details(arch, path, quant_level: str | None) -> dict:
    """/api/tags' and /api/show's `details` of the served model."""
    from qserve.models.registry import num_params

    n = num_params(arch)
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    return {"parent_model": "", "format": "gguf" if path.suffix == ".gguf" else "safetensors",
            "family": arch.architecture, "families": [arch.architecture],
            "parameter_size": size, "quantization_level": quant_level or ""}
