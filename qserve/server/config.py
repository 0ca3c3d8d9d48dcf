"""ServerConfig: where `qserve serve` listens and what requests it admits, validated on
construction (the CLI's serve flags map onto its fields)."""
from __future__ import annotations

import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from qserve.errors import ConfigError
from qserve.server.reasoning import PARSERS

LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a 1M-token prompt is about 4 MB of text


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer token required on /v1 and /metrics. None: no key, and then only loopback (or
    # IP-literal) Hosts and loopback or allowed Origins are served (browser CSRF, DNS rebinding).
    api_key: str | None = None
    # Browser origins (scheme://host[:port], or "*") allowed to call the API, with CORS.
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413 before parsing
    # At SIGINT / SIGTERM in-flight requests get this long to finish; then each ends with an
    # error (an error event for a stream, 503 otherwise).
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    # How chat answers' thinking is read off (reasoning.py): auto (from the model's template
    # and vocabulary), none (left in the content), think or harmony.
    reasoning_parser: str = "auto"

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key is empty; give a non-empty key, or leave the flag out "
                              "to serve loopback clients without one")
        self.allowed_origins = tuple(o.rstrip("/") for o in self.allowed_origins)
        for origin in self.allowed_origins:
            parts = urlsplit(origin)
            if origin != "*" and not (parts.scheme in ("http", "https") and parts.hostname
                                      and not parts.path):
                raise ConfigError(f"--allowed-origins {origin!r} is not an origin; give "
                                  f"scheme://host[:port], e.g. http://localhost:3000, or *")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"--max-request-bytes={self.max_request_bytes} must be at least "
                              f"1024")
        if not self.shutdown_timeout_s >= 0:
            raise ConfigError(f"--shutdown-timeout={self.shutdown_timeout_s} must be >= 0 "
                              f"seconds")
        if self.reasoning_parser not in PARSERS:
            raise ConfigError(f"--reasoning-parser {self.reasoning_parser!r} is not one of "
                              f"{', '.join(PARSERS)}")


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, made before the model loads (as vLLM binds first), so
    a host that does not resolve or a port in use is a one-line ConfigError at once, not an
    error from uvicorn after the load; uvicorn then serves on it. Port 0 takes a free port
    (`getsockname()` says which)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError) as e:
        raise ConfigError(f"--host {host!r} is not an address this machine can listen on "
                          f"({getattr(e, 'strerror', None) or e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
