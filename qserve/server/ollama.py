"""Ollama's REST API (/api/...) over the same engine, for the clients that speak only it.

A request is translated into the OpenAI request it means and validated by protocol.py, so
both APIs run the same sampling, structured outputs and tools; only the shapes differ:

    /api/chat       messages, tools, format ("json" or a JSON schema), options  -> a chat
    /api/generate   prompt (+ system) through the chat template; raw: as written -> a completion
    /api/embed      input (text or texts), unit vectors; /api/embeddings: prompt, as computed
    /api/tags, /api/ps, /api/show, /api/version: the one model this server holds

`stream` defaults to true, as in Ollama: newline-delimited JSON objects, the last with
`done: true`, `done_reason` and the counts and durations (nanoseconds) Ollama reports. A
reasoning model's thinking (reasoning.py) comes in `message.thinking` (`thinking` from
/api/generate); `think` false asks the template not to think (enable_thinking: false) and
leaves thinking out of the answer, and "low" / "medium" / "high" (gpt-oss) set its
`reasoning_effort`.
Errors are Ollama's `{"error": "..."}` with the HTTP status. `routes` builds the router that
api.py mounts beside /v1, with its own steps (adding a generation, rendering a chat prompt,
embedding) handed in.
"""
from __future__ import annotations

import asyncio
import datetime
import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from qserve import __version__
from qserve.models.registry import num_params
from qserve.pooling_params import PoolingParams
from qserve.server import http as H
from qserve.server import protocol as P
from qserve.server.tool_calls import AnswerParser

# Ollama's options -> the OpenAI (and vLLM) request fields protocol.py reads
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
EFFORTS = ("low", "medium", "high")  # `think` as gpt-oss's reasoning effort


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
    think = think_of(body)
    if think is not None and "messages" in out:  # the template's own variables
        out["chat_template_kwargs"] = {"enable_thinking": bool(think)} | (
            {"reasoning_effort": think} if think in EFFORTS else {})
    return out


def think_of(body: dict) -> bool | str | None:
    """The request's `think`: true, false, an effort of EFFORTS, or None (the model's way)."""
    think = body.get("think")
    if think is None or isinstance(think, bool) or think in EFFORTS:
        return think
    raise OllamaError(400, f"'think' must be true, false, \"low\", \"medium\" or \"high\", "
                           f"not {json.dumps(think)}"[:200])


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

    def ns(a, b) -> int:
        return max(0, int((b - a) * 1e9)) if a is not None and b is not None else 0
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
    """One /api/chat or /api/generate answer, whole or as NDJSON lines. `think` False: the
    thinking is left out."""

    def __init__(self, model: str, chat: bool, req: P.GenerateRequest, tool_format,
                 think: bool | str | None = None):
        self.model, self.chat, self.req, self.tool_format = model, chat, req, tool_format
        self.show_thinking = think is not False

    def _parser(self) -> AnswerParser | None:
        if self.req.reasoning is None and not self.req.structure.parses_tools:
            return None
        return AnswerParser(self.req.reasoning, self.req.structure, self.tool_format)

    def _body(self, text: str, calls: list[dict], out=None, thinking: str | None = None
              ) -> dict:
        body = {"model": self.model, "created_at": now()}
        thinking = {"thinking": thinking} if thinking and self.show_thinking else {}
        if self.chat:
            body["message"] = {"role": "assistant", "content": text} | thinking
            if calls:
                body["message"]["tool_calls"] = _calls(calls)
        else:
            body["response"] = text
            body |= thinking
        body["done"] = out is not None
        if out is not None:
            c = out.outputs[0]
            body["done_reason"] = "length" if c.finish_reason == "length" else "stop"
            body |= stats(out)
        return body

    def whole(self, out) -> dict:
        c, calls, thinking = out.outputs[0], [], None
        text = c.text
        parser = self._parser()
        if parser is not None:
            parser.feed(c.text)
            parser.finish()
            thinking, text, calls = parser.message()
        return self._body(text or "", calls, out, thinking)

    async def stream(self, gen):
        parser = self._parser()
        try:
            async for _, out in gen:
                c = out.outputs[0]
                thinking, text = "", c.delta_text
                if parser is not None:  # (calls go out whole, at the end)
                    thinking, text, _ = parser.read(text, c.finish_reason is not None)
                if text or (thinking and self.show_thinking):
                    yield _line(self._body(text, [], thinking=thinking))
                if out.finished:
                    calls = parser.message()[2] if parser is not None else []
                    yield _line(self._body("", calls, out))
        except Exception as e:  # (EngineStopped: the server is shutting down)
            yield _line({"error": str(e)})


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def model_details(arch, path, quant_level: str | None) -> dict:
    """/api/tags' and /api/show's `details` of the served model."""
    n = num_params(arch)
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    return {"parent_model": "", "format": "gguf" if path.suffix == ".gguf" else "safetensors",
            "family": arch.architecture, "families": [arch.architecture],
            "parameter_size": size, "quantization_level": quant_level or ""}


# ---- the routes --------------------------------------------------------------------------
def routes(engine, model_name: str, tool_format, reasoning, generation, chat_prompt,
           embed) -> APIRouter:
    """Ollama's /api routes over `engine` (an AsyncEngine serving `model_name`, whose way of
    thinking is `reasoning`, or None), with api.py's own steps:
    `generation(req, prompts, prefix, chat)` adds a validated request's prompts,
    `chat_prompt(req)` renders a chat request's ids, `embed(request, prompts, params)` runs
    embedding requests to their finished outputs."""
    api = APIRouter(prefix="/api")

    def check_model(name) -> None:
        if name not in (None, model_name, f"{model_name}:latest"):
            raise OllamaError(404, f"model '{name}' not found")

    def entry() -> dict:
        path = engine.model_path
        files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
        modified = max(f.stat().st_mtime for f in files)
        return {"name": model_name, "model": model_name,
                "modified_at": datetime.datetime.fromtimestamp(
                    modified, datetime.timezone.utc).isoformat(),
                "size": sum(f.stat().st_size for f in files),
                "details": model_details(engine.arch, path, engine.weight_summary)}

    @api.get("/version")
    async def version():
        return {"version": __version__}

    @api.get("/tags")
    async def tags():
        return {"models": [entry()]}

    @api.get("/ps")
    async def running():  # loaded for as long as the server runs
        return {"models": [entry() | {"expires_at": "2262-04-11T23:47:16Z", "size_vram": 0}]}

    @api.post("/show")
    async def show(request: Request):
        body = await H.read_json(request)
        check_model(body.get("model") or body.get("name") or model_name)
        arch = engine.arch
        return {"modelfile": "", "parameters": "",
                "template": engine.tokenizer.chat_template or "", "details": entry()["details"],
                "model_info": {"general.architecture": arch.architecture,
                               "general.parameter_count": num_params(arch),
                               f"{arch.architecture}.context_length": engine.max_model_len,
                               f"{arch.architecture}.embedding_length": arch.hidden_size,
                               f"{arch.architecture}.block_count": arch.num_layers},
                "capabilities": (["completion", "tools"] if arch.generates else [])
                + (["thinking"] if reasoning is not None else []) + ["embedding"]}

    async def answer(request: Request, chat: bool):
        body = await H.read_json(request)
        check_model(body.get("model"))
        if not body.get("messages") if chat else not body.get("prompt"):
            # Ollama's way to load a model: an empty request, answered done at once
            empty = {"role": "assistant", "content": ""} if chat else ""
            return {"model": model_name, "created_at": now(),
                    ("message" if chat else "response"): empty, "done": True,
                    "done_reason": "load"}
        think = think_of(body)
        if think and reasoning is None:  # as Ollama answers
            raise OllamaError(400, f"{model_name!r} does not support thinking")
        try:
            oa = openai_request(body, chat)
            templated = "messages" in oa
            req = P.parse_chat(oa) if templated else P.parse_completion(oa)
            loop = asyncio.get_running_loop()
            ids = ([await loop.run_in_executor(None, chat_prompt, req)] if templated else
                   await loop.run_in_executor(None, H.encode, engine.tokenizer, req.prompts,
                                              True))
            gen = await generation(req, ids, "ollama", templated)
        except P.APIError as e:
            raise OllamaError(e.status, e.message) from None
        response = OllamaResponse(model_name, chat, req, tool_format, think)
        if req.stream:
            return H.EventStream(response.stream(gen), on_close=gen.close,
                                 media_type="application/x-ndjson")
        try:
            finals = await H.finals(request, gen)
        except P.APIError as e:
            raise OllamaError(e.status, e.message) from None
        if finals is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return response.whole(finals[0])

    @api.post("/chat")
    async def chat(request: Request):
        return await answer(request, chat=True)

    @api.post("/generate")
    async def generate(request: Request):
        return await answer(request, chat=False)

    async def embeddings_of(request: Request, inputs, truncate: bool, params) -> list:
        """The finished outputs of embedding `inputs` (Ollama's text or texts); an input
        past the context keeps its first tokens where `truncate`, as Ollama does."""
        try:
            texts = P.prompts_of(inputs, "input")
            if not all(isinstance(t, str) for t in texts):
                raise P.bad("'input' must be a string or a list of strings", "input")
            ids = await asyncio.get_running_loop().run_in_executor(
                None, H.encode, engine.tokenizer, texts, True)
            most = engine.max_model_len - 1
            if not truncate and any(len(i) > most for i in ids):
                raise P.bad(f"an input has more than this model's {most} tokens", "input")
            finals = await embed(request, [i[:most] for i in ids], params)
        except P.APIError as e:
            raise OllamaError(e.status, e.message) from None
        if finals is None:
            raise OllamaError(499, "the client went away")
        return finals

    @api.post("/embed")
    async def embed_texts(request: Request):
        body = await H.read_json(request)
        check_model(body.get("model"))
        dims = body.get("dimensions")
        if dims is not None and not (isinstance(dims, int) and 1 <= dims <= engine.hidden_size):
            raise OllamaError(400, f"'dimensions' must be from 1 to {engine.hidden_size}")
        finals = await embeddings_of(request, body.get("input"),
                                     body.get("truncate", True) is not False,
                                     PoolingParams(dimensions=dims))
        start = min(o.metrics.arrival_time for o in finals)
        end = max(o.metrics.finished_time or start for o in finals)
        return {"model": model_name, "embeddings": [o.embedding for o in finals],
                "total_duration": int((end - start) * 1e9), "load_duration": 0,
                "prompt_eval_count": sum(len(o.prompt_token_ids) for o in finals)}

    @api.post("/embeddings")
    async def embed_prompt(request: Request):
        """The older endpoint: one prompt, its vector as computed (not scaled to unit
        length, as Ollama's)."""
        body = await H.read_json(request)
        check_model(body.get("model"))
        [out] = await embeddings_of(request, body.get("prompt"), True,
                                    PoolingParams(normalize=False))
        return {"embedding": out.embedding}

    return api
