"""The ASGI app: OpenAI's /v1 routes, Ollama's /api routes (ollama.py), /health and
/metrics, over one AsyncEngine.

Every HTTP request shares the engine thread's continuous batching. The RequestGuard (guard.py)
checks its Host, Origin and size first; a handler validates the body (protocol.py), tokenizes
in a worker thread, adds its prompts, then either waits for the final outputs or streams
Server-Sent Events; a stream whose client goes away is aborted, which frees its KV blocks at
the engine's next step boundary.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import signal
import uuid
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from qserve.errors import QServeError
from qserve.pooling_params import PoolingParams
from qserve.server import ollama as O
from qserve.server import protocol as P
from qserve.server.async_engine import AsyncEngine, EngineStopped, EngineThread, Generation
from qserve.server import http as H
from qserve.server.config import ServerConfig
from qserve.server.guard import RequestGuard
from qserve.server.metrics import CONTENT_TYPE, Metrics
from qserve.server.reasoning import reasoning_format
from qserve.server.structured import Grammars, StructureError, ToolFormat
from qserve.server.tool_calls import AnswerParser, render_chat

log = logging.getLogger("qserve.server")


def serve(engine, model_name: str, config: ServerConfig | None = None,
          thread: EngineThread | None = None, sock=None) -> None:
    """Serve `engine` (an LLMEngine; `thread`: the EngineThread that loaded it) until SIGINT
    or SIGTERM, then return normally. `sock`: a socket already bound to the config's address
    (config.listen_socket); without one uvicorn binds it.

    On a signal the server stops accepting connections and lets in-flight requests finish for
    up to `config.shutdown_timeout_s`; then each still running ends with an error.
    """
    make_server(engine, model_name, config or ServerConfig(), thread).run(
        sockets=None if sock is None else [sock])


def make_server(engine, model_name: str, config: ServerConfig,
                thread: EngineThread | None = None) -> "_Server":
    """The uvicorn server for `engine`, not started (`.run()` blocks until it stops)."""
    metrics = Metrics()
    async_engine = AsyncEngine(engine, on_finished=metrics.observe,
                               on_aborted=metrics.observe_abort, thread=thread)
    metrics.watch(async_engine)
    app = build_app(async_engine, model_name, metrics, config)
    # uvicorn's own limit is a backstop: _Server ends the requests at shutdown_timeout_s
    uv_config = uvicorn.Config(app, host=config.host, port=config.port,
                               log_level=config.log_level,
                               timeout_graceful_shutdown=config.shutdown_timeout_s + 10)
    return _Server(uv_config, async_engine, config.shutdown_timeout_s)


class _Server(uvicorn.Server):
    """uvicorn's Server, except that SIGINT / SIGTERM is the normal way to stop, so the process
    exits 0 (uvicorn itself re-raises the signal after its graceful shutdown), and that requests
    still running at the shutdown timeout end with an error rather than being cancelled: a
    stream gets an error event, and no handler dies with a traceback."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout_s: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s

    def handle_exit(self, sig, frame):
        if self.should_exit and sig == signal.SIGINT:  # a second Ctrl-C: stop waiting
            self.force_exit = True
        self.should_exit = True

    async def _wait_tasks_to_complete(self) -> None:
        # uvicorn.Server.shutdown calls this under its own timeout, then cancels what is left.
        try:
            await asyncio.wait_for(super()._wait_tasks_to_complete(), self.shutdown_timeout_s)
        except asyncio.TimeoutError:
            log.warning("shutdown timeout (%gs) reached: ending the requests still running",
                        self.shutdown_timeout_s)
            await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)
            await super()._wait_tasks_to_complete()


def build_app(engine: AsyncEngine, model_name: str, metrics: Metrics,
              config: ServerConfig | None = None) -> RequestGuard:
    """The app (inside its RequestGuard); its lifespan starts the engine thread and, on
    shutdown, aborts what is left."""
    config = config or ServerConfig()
    api_key = config.api_key

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="qserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    created = P.now()
    grammars = Grammars(engine.tokenizer)
    reasoning = reasoning_format(config.reasoning_parser, engine.tokenizer)

    # ---- errors and auth ---------------------------------------------------------------
    @app.exception_handler(P.APIError)
    async def _api_error(request, e: P.APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):  # RequestGuard logs it
        return JSONResponse(P.APIError(500, f"internal error: {type(e).__name__}",
                                       "server_error").body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = (f"no route {request.method} {request.url.path}" if e.status_code in (404, 405)
                   else str(e.detail))
        return JSONResponse(P.APIError(e.status_code, message, code=code).body(),
                            status_code=e.status_code)

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(),
                                                                 api_key.encode()):
            why = "a wrong API key" if given else "no API key (Authorization: Bearer KEY)"
            raise P.APIError(401, f"the request carries {why}", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    # ---- plain routes ------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[Depends(require_key)])
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "qserve",
                "max_model_len": engine.max_model_len}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card()

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise P.APIError(404, f"the model {name!r} does not exist; this server serves "
                                  f"{model_name!r}", param="model", code="model_not_found")

    # ---- generation --------------------------------------------------------------------
    @v1.post("/completions")
    async def completions(request: Request):
        req = P.parse_completion(await H.read_json(request))
        check_model(req.model)
        tok = engine.tokenizer
        texts = [p for p in req.prompts if isinstance(p, str)]
        encoded = iter(await asyncio.get_running_loop().run_in_executor(
            None, H.encode, tok, texts, True))
        prompts = [next(encoded) if isinstance(p, str) else p for p in req.prompts]
        return await _run(request, req, prompts, "cmpl", "text_completion")

    def chat_prompt(req: P.GenerateRequest) -> list[int]:
        """A chat request's prompt ids, through the model's template (in a worker thread)."""
        tok = engine.tokenizer
        try:
            text = render_chat(tok, req.messages, req.structure, grammars.fmt,
                               req.template_kwargs)
        except QServeError as e:  # a template that refuses this conversation
            raise P.bad(str(e), "messages") from None
        return H.encode(tok, [text], False)[0]

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req = P.parse_chat(await H.read_json(request))
        check_model(req.model)
        ids = await asyncio.get_running_loop().run_in_executor(None, chat_prompt, req)
        return await _run(request, req, [ids], "chatcmpl", "chat.completion")

    @v1.post("/embeddings")
    async def embeddings(request: Request):
        req = P.parse_embeddings(await H.read_json(request), engine.hidden_size)
        check_model(req.model)
        texts = [p for p in req.inputs if isinstance(p, str)]
        encoded = iter(await asyncio.get_running_loop().run_in_executor(
            None, H.encode, engine.tokenizer, texts, True))
        prompts = [next(encoded) if isinstance(p, str) else p for p in req.inputs]
        for i, ids in enumerate(prompts):
            if not ids:
                raise P.bad(f"input {i} is empty; give at least one token of text", "input")
            if len(ids) >= engine.max_model_len:
                raise P.bad(f"input {i} has {len(ids)} tokens; this model takes at most "
                            f"{engine.max_model_len - 1}", "input", "context_length_exceeded")
        finals = await embed(request, prompts, req.params)
        if finals is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(P.embeddings_response(req, model_name, finals))

    async def embed(request: Request, prompts: list[list[int]], params: PoolingParams):
        """The finished embedding outputs of `prompts` (token ids), in order; None where the
        client went away first."""
        gen = Generation(engine, f"embd-{uuid.uuid4().hex[:16]}", prompts, params)
        await H.start(gen, "input")
        return await H.finals(request, gen)

    # ---- the tokenizer, as vLLM's and llama.cpp's servers offer it ----------------------
    @app.post("/tokenize", dependencies=[Depends(require_key)])
    async def tokenize(request: Request):
        body = await H.read_json(request)
        loop = asyncio.get_running_loop()
        if "messages" in body:  # a chat request's prompt, as it would run
            req = P.parse_chat(body)
            check_model(req.model)
            ids = await loop.run_in_executor(None, chat_prompt, req)
        else:
            model, text, special = P.parse_tokenize(body)
            check_model(model)
            ids = (await loop.run_in_executor(None, H.encode, engine.tokenizer, [text],
                                              special))[0]
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(require_key)])
    async def detokenize(request: Request):
        model, ids = P.parse_detokenize(await H.read_json(request), engine.tokenizer.vocab_size)
        check_model(model)
        text = await asyncio.get_running_loop().run_in_executor(
            None, lambda: engine.tokenizer.decode(ids, skip_special_tokens=False))
        return {"prompt": text, "content": text}  # vLLM's key, llama.cpp's

    async def _run(request: Request, req: P.GenerateRequest, prompts: list[list[int]],
                   prefix: str, kind: str):
        gen = await generation(req, prompts, prefix, kind == "chat.completion")
        echo_texts = None
        if req.echo:  # token ids are decoded only now that the engine has checked them
            echo_texts = [p if isinstance(p, str) else engine.tokenizer.decode(ids)
                          for p, ids in zip(req.prompts, prompts)]
        response = _Response(gen.request_ids[0], kind, model_name, req, gen.params.n, engine,
                             echo_texts, grammars.fmt)
        if req.stream:
            return H.EventStream(response.stream(gen), on_close=gen.close)
        finals = await H.finals(request, gen)
        if finals is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(response.whole(finals))

    async def generation(req: P.GenerateRequest, prompts: list[list[int]], prefix: str,
                         chat: bool) -> Generation:
        """The request's prompts added to the engine: max_tokens fitted to the context, its
        grammar compiled, a chat's way of thinking set (req.reasoning), deltas for a stream
        and the final output alone otherwise."""
        if not all(prompts):
            raise P.bad("the prompt is empty; give at least one token of text", "prompt")
        param = "messages" if chat else "prompt"
        params = P.fit_to_context(req, [len(p) for p in prompts], engine.max_model_len, param)
        structure = req.structure
        # harmony writes tool calls its own way (read back by its parser), not the grammar's
        harmony_tools = reasoning is not None and reasoning.kind == "harmony" and (
            structure.parses_tools)
        if chat and reasoning is not None and (harmony_tools or not structure.forces_text):
            req.reasoning = reasoning.for_prompt(engine.tokenizer, prompts[0])
            if reasoning.special:  # its markers are special tokens: the parser needs them
                params = dataclasses.replace(params, skip_special_tokens=False)
            if harmony_tools:
                structure = dataclasses.replace(structure, grammar=None)
        if structure.grammar is not None:  # compiling takes milliseconds: off the loop
            try:
                constraint = await asyncio.get_running_loop().run_in_executor(
                    None, grammars.constraint, structure)
            except StructureError as e:
                raise P.bad(str(e), e.param) from None
            params = dataclasses.replace(params, constraint=constraint)
        # a stream sends what each step added; a whole response needs only the end
        params = dataclasses.replace(params, output_kind="delta" if req.stream else "final_only")
        gen = Generation(engine, f"{prefix}-{uuid.uuid4().hex[:16]}", prompts, params)
        await H.start(gen, param)
        return gen

    app.include_router(v1)

    # ---- Ollama's API (ollama.py) ------------------------------------------------------
    app.include_router(O.routes(engine, model_name, grammars.fmt, reasoning, generation,
                                chat_prompt, embed), dependencies=[Depends(require_key)])

    @app.exception_handler(O.OllamaError)
    async def _ollama_error(request, e: O.OllamaError):
        return JSONResponse({"error": e.message}, status_code=e.status)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"])
    return RequestGuard(app, config)


class _Response:
    """Builds one request's completion or chat JSON, whole or as stream chunks."""

    def __init__(self, rid: str, kind: str, model: str, req: P.GenerateRequest, n: int,
                 engine: AsyncEngine, echo_texts: list[str] | None, tool_format: ToolFormat):
        self.id, self.kind, self.model, self.req, self.n = rid, kind, model, req, n
        self.chat = kind == "chat.completion"
        self.tools = req.structure  # parses_tools: chat text holds tool calls
        self.tool_format = tool_format  # how this model's text writes them
        # chat text read into thinking, content and calls (AnswerParser)
        self.parses = self.chat and (req.reasoning is not None or req.structure.parses_tools)
        self.created = P.now()
        self.echo = echo_texts
        self.lp = (P.LogprobFormatter(engine.tokenizer, req.logprobs)
                   if req.logprobs is not None else None)
        # echo with max_tokens 0: the prompt alone (the engine samples one token, left out)
        self.prompt_only = req.echo and req.max_tokens == 0

    def _logprobs(self, c, offset: int, out=None):
        """c's tokens' logprobs (a whole sample's, or a stream chunk's new ones); with `out`
        (its RequestOutput, for an echoed prompt's first chunk) the prompt's tokens first."""
        if self.lp is None or c.logprobs is None:
            return None
        ids, lps = c.token_ids, c.logprobs[:len(c.token_ids)]
        if self.chat:
            return self.lp.chat(ids, lps)
        made = None if self.prompt_only else self.lp.completion(ids, lps, offset)
        if out is None or out.prompt_logprobs is None:  # (an abort before the prompt ran)
            return made
        return self.lp.join(self.lp.prompt(out.prompt_token_ids, out.prompt_logprobs), made)

    def _parser(self) -> AnswerParser:
        return AnswerParser(self.req.reasoning, self.tools, self.tool_format)

    def whole(self, finals) -> dict:
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                head = self.echo[i] if self.echo else ""
                thinking, content, calls = None, c.text, []
                if self.parses:
                    parser = self._parser()
                    parser.feed(c.text)
                    parser.finish()
                    thinking, content, calls = parser.message()
                choice = {"index": i * self.n + c.index,
                          "logprobs": self._logprobs(c, len(head), out if self.echo else None),
                          "finish_reason": P.finish_reason(c, bool(calls))}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": content}
                    if thinking is not None:
                        choice["message"]["reasoning_content"] = thinking
                    if calls:
                        choice["message"]["tool_calls"] = calls
                else:
                    choice["text"] = head + ("" if self.prompt_only else c.text)
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        return P.envelope(self.id, self.kind, self.created, self.model, choices,
                          usage=P.usage(finals, self.prompt_only))

    async def stream(self, gen: Generation):
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if self.req.include_usage else {}
        started: set[int] = set()  # choice indexes with a chunk sent
        offsets: dict[int, int] = {}  # choice index -> characters sent (completions' offsets)
        finished: set[int] = set()
        last: dict[int, object] = {}
        parsers: dict[int, AnswerParser] = {}  # choice index -> its text read so far
        try:
            async for i, out in gen:
                last[i] = out
                choices = []
                for c in out.outputs:
                    index = i * self.n + c.index
                    thinking, text, calls = "", c.delta_text, []
                    if self.parses and index not in finished:
                        if index not in parsers:
                            parsers[index] = self._parser()
                        thinking, text, calls = parsers[index].read(
                            text, c.finish_reason is not None)
                    reason = P.finish_reason(c, index in parsers and bool(parsers[index].calls))
                    first = index not in started
                    if self.prompt_only:  # one chunk: the prompt, cut at length
                        text, reason = "", "length" if first else None
                    if not (first or thinking or text or calls
                            or (reason and index not in finished)):
                        continue
                    if first and self.echo:
                        text = self.echo[i] + text
                    # a first chunk's own tokens follow its echoed prompt
                    at = offsets.get(index, 0) + (len(self.echo[i]) if first and self.echo else 0)
                    choice = {"index": index,
                              "logprobs": self._logprobs(c, at,
                                                         out if first and self.echo else None),
                              "finish_reason": reason}
                    if self.chat:
                        delta = {"role": "assistant"} if first else {}
                        if thinking:  # vLLM's and llama.cpp's field
                            delta["reasoning_content"] = thinking
                        if text or (first and not calls and not thinking):
                            delta["content"] = text
                        if calls:  # a call's start (index, id, name), then its arguments
                            delta["tool_calls"] = calls
                        choice["delta"] = delta
                    else:
                        choice["text"] = text
                    started.add(index)
                    offsets[index] = offsets.get(index, 0) + len(text)
                    if reason:
                        finished.add(index)
                    choices.append(choice)
                if choices:
                    yield _sse(P.envelope(self.id, kind, self.created, self.model, choices,
                                          **extra))
        except EngineStopped as e:
            yield _sse(P.APIError(503, str(e), "server_error", code="shutting_down").body())
            return
        if self.req.include_usage:
            finals = [last[i] for i in sorted(last)]
            yield _sse(P.envelope(self.id, kind, self.created, self.model, [],
                                  usage=P.usage(finals, self.prompt_only)))
        yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
