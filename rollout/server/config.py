"""Settings of the HTTP server."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How :func:`rollout.server.start_server` serves a worker.

    ``admin_token``: the bearer token of the ``/admin`` routes; None leaves them unmounted
    (404). ``api_key``: when set, the ``/v1`` routes require it as a bearer token.
    ``served_model_name``: the model name clients pass (default: the model directory's name).
    """

    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port (see Server.port)
    admin_token: str | None = None
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1  # the Retry-After of a 503 while weights or KV are changing
    drain_timeout_s: float = 30.0  # how long close() lets running requests finish
    keep_alive_s: float = 75.0  # idle keep-alive connections are closed after this
    # How long a request's head (request line and headers) may take to arrive whole, from the
    # connection's opening or the next request's first byte (a 408, or a plain close when
    # nothing came): uvicorn itself waits for a stalled head for good.
    header_timeout_s: float = 30.0
    # How long a request's body may take to arrive whole once the route reads it (a 408, and the
    # connection closed, then): uvicorn itself waits for a stalled body for good.
    body_timeout_s: float = 60.0
    # Admission limits of one generation request (413 naming the limit; None: no limit): the
    # prompts, the rows (prompts x n) and the tokens (prompt + max_tokens over every row) it
    # may ask for; they bound the memory and engine time one request claims.
    max_prompts_per_request: int | None = 256
    max_rows_per_request: int | None = 1024
    max_tokens_per_request: int | None = 1 << 20
    # Admin reloads read only paths under this directory (403 otherwise); None: any path the
    # process can read.
    reload_root: str | None = None

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port must be an int in [0, 65535], got {self.port!r}")
        for name in ("admin_token", "api_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"ServerConfig.{name} must be a non-empty string or None")
        for name in ("max_prompts_per_request", "max_rows_per_request", "max_tokens_per_request"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ServerConfig.{name} must be a positive int or None, got {value!r}")
        if self.reload_root is not None and not os.path.isdir(self.reload_root):
            raise ValueError(f"ServerConfig.reload_root must be an existing directory, got {self.reload_root!r}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_body_bytes < 1 or self.retry_after_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("ServerConfig.max_body_bytes must be >= 1, retry_after_s and drain_timeout_s >= 0")
