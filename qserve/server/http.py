"""The HTTP plumbing the OpenAI routes (api.py) and Ollama's (ollama.py) share: reading a JSON
body, tokenizing off the event loop, adding a Generation and waiting for it (a refusal or a
shutdown as its HTTP error), and a streamed body that aborts its requests however it ends."""
from __future__ import annotations

import asyncio
import json
import re

from fastapi import Request
from fastapi.responses import StreamingResponse

from qserve.errors import QServeError, QueueFullError
from qserve.server import protocol as P
from qserve.server.async_engine import EngineStopped, Generation

# A lone UTF-16 surrogate can only come from a \uD800-\uDFFF escape (raw UTF-8 cannot hold one)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_json(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise P.bad("the request body is not valid JSON") from None
    except RecursionError:
        raise P.bad("the request body nests JSON too deeply") from None
    if not isinstance(body, dict):
        raise P.bad("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then pay for a second pass
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise P.bad("the request body holds a lone UTF-16 surrogate escape (\\uD800-"
                        "\\uDFFF without its pair), which is not text") from None
    return body


def encode(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Tokenizer.encode for several texts, in a worker thread. The backend's encode_batch
    releases the GIL while it works (encode holds it), so a long prompt being tokenized does
    not stall the event loop, and with it every other request and /health."""
    encodings = tokenizer.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
    return [e.ids for e in encodings]


async def start(gen: Generation, param: str) -> None:
    """Add the generation's requests to the engine; a refusal is its HTTP error (`param`
    names the request field a bad prompt came in)."""
    try:
        await gen.start()
    except QueueFullError as e:
        raise P.APIError(503, str(e), "server_error", code="queue_full") from None
    except EngineStopped as e:
        raise P.APIError(503, str(e), "server_error", code="shutting_down") from None
    except QServeError as e:
        raise P.bad(str(e), param) from None


async def finals(request: Request, gen: Generation):
    """until_done, a server shutting down meanwhile answered 503."""
    try:
        return await until_done(request, gen)
    except EngineStopped as e:
        raise P.APIError(503, str(e), "server_error", code="shutting_down") from None


async def until_done(request: Request, gen: Generation):
    """The final outputs, or None when the client disconnects first (its requests aborted)."""
    task = asyncio.ensure_future(gen.final_outputs())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
        gen.close()


class EventStream(StreamingResponse):
    """SSE (or Ollama's NDJSON) that runs `on_close` however the response ends (done, error,
    or disconnect)."""

    def __init__(self, chunks, on_close, media_type: str = "text/event-stream"):
        super().__init__(chunks, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
