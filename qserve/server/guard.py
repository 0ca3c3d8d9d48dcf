"""RequestGuard: what every HTTP request must pass before the app reads its body.

    Host / Origin   without an API key, a browser page on another site must not be able to
                    use a server on loopback: a cross-site POST (CSRF) carries a foreign
                    Origin, and DNS rebinding a Host the attacker names. So a Host must be a
                    loopback name or an IP literal (which cannot be rebound) or the bound
                    --host, and an Origin, when sent, loopback or one of --allowed-origins.
                    With a key, every /v1 request needs it, which a foreign page cannot send.
    body size       a Content-Length over the limit is refused at once; a chunked body is
                    counted as it arrives and refused when it passes the limit. Both 413.
    crashes         an exception escaping the app (a bug) is logged here and not re-raised, so
                    the client got its 500 (in OpenAI's shape) and the keep-alive connection
                    stays open; uvicorn would close it.
"""
from __future__ import annotations

import ipaddress
import logging
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from qserve.server.config import LOOPBACK, ServerConfig
from qserve.server.protocol import APIError

log = logging.getLogger("qserve.server")


class RequestGuard:
    """ASGI middleware, outermost: Host / Origin, body size, and the last word on crashes."""

    def __init__(self, app, config: ServerConfig):
        self.app = app
        self.max_bytes = config.max_request_bytes
        self.open = config.api_key is None  # no key: check Host and Origin
        self.hosts = set(LOOPBACK)
        if config.host not in ("0.0.0.0", "::", ""):
            self.hosts.add(config.host.lower().strip("[]"))
        self.origins = set(config.allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        error = self._refusal(headers) if self.open else None
        length = headers.get("content-length", "")
        if error is None and length.isdigit() and int(length) > self.max_bytes:
            error = self._too_large()
        if error is not None:
            response = JSONResponse(error.body(), status_code=error.status)
            return await response(scope, receive, send)
        try:
            await self.app(scope, self._counting(receive), send)
        except Exception:  # the app already answered 500; keep the connection usable
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])

    def _refusal(self, headers: Headers) -> APIError | None:
        host = _hostname(headers.get("host", ""))
        if not (host in self.hosts or _is_ip(host)):
            return APIError(403, f"Host {host!r} is not allowed: without an API key this "
                                 f"server answers only requests addressed to localhost or an "
                                 f"IP address (set --api-key to serve other host names)",
                            code="host_not_allowed")
        origin = headers.get("origin")
        if origin is None or origin.rstrip("/") in self.origins or "*" in self.origins:
            return None
        if _hostname(urlsplit(origin).netloc) not in LOOPBACK:
            return APIError(403, f"Origin {origin!r} is not allowed; without an API key this "
                                 f"server answers pages from loopback origins only (see "
                                 f"--allowed-origins)", code="origin_not_allowed")
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of "
                             f"{self.max_bytes:,} bytes (--max-request-bytes)",
                        code="request_too_large")

    def _counting(self, receive):
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # raised inside the handler's `await request.body()`
                    raise self._too_large()
            return message
        return counted


def _hostname(netloc: str) -> str:
    """'LocalHost:8000' -> 'localhost', '[::1]:8000' -> '::1'."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:].partition("]")[0]
    if netloc.count(":") == 1:
        return netloc.partition(":")[0]
    return netloc


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
