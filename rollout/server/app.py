"""The FastAPI app: errors, the request log, and the routers (OpenAI-compatible, health, admin)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .admin import AdminState, admin_router
from .backend import Backend
from .config import ServerConfig
from .errors import KNOWN_ERRORS, api_error, error_headers
from .protocol import ApiError
from .routes import health_router, openai_router
from .state import SharedState

logger = logging.getLogger(__name__)


def build_app(backend: Backend, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="sglang-jax-rollout", docs_url=None, redoc_url=None, openapi_url=None)
    state = SharedState(backend, config)
    app.state.closers = closers = []  # what Server.close() runs once the server stopped
    app.state.model_name = state.model_name  # the name clients pass (and the log shows)
    app.state.begin_drain = state.begin_drain  # what Server.close() runs on the server's loop first

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), type=kind).body(), status_code=exc.status_code)

    async def any_error(request: Request, exc: Exception):
        prompt_field = getattr(request.state, "prompt_field", "prompt")
        error = api_error(exc, prompt_field=prompt_field, where=f"{request.method} {request.url.path}")
        return JSONResponse(error.body(), status_code=error.status, headers=error_headers(error, config.retry_after_s))

    # Known types are answered by the app, the rest by _UnexpectedErrors; Exception stays
    # registered for an error in the middleware itself (Starlette's outermost answers it).
    for kind in (*KNOWN_ERRORS, Exception):
        app.add_exception_handler(kind, any_error)

    app.add_middleware(_UnexpectedErrors, answer=any_error)
    app.add_middleware(_CancelledAtShutdown)
    app.add_middleware(_RequestLog)
    app.include_router(health_router(state))
    app.include_router(openai_router(state))
    if config.admin_token is not None:
        admin = AdminState()
        app.include_router(admin_router(state, admin))
        closers.append(admin.close)
    return app


class _UnexpectedErrors:
    """An unexpected error is answered here (a 500 naming the request id under which
    ``api_error`` logged its traceback), not re-raised. Re-raised, Starlette's outermost
    middleware answered it, uvicorn logged it a second time and closed the client's keep-alive
    connection (its next request on it could be reset), and the request log saw no status. One
    raised after its response began (a stream) still ends the connection: nothing else can."""

    def __init__(self, app, answer):
        self.app = app
        self.answer = answer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception as exc:
            if started:
                raise
            response = await self.answer(Request(scope), exc)
            await response(scope, receive, send)


class _RequestLog:
    """One INFO line per request: method, path, status, tokens (prompt/completion), seconds."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]

        async def capture(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            prompt, completion = scope.get("state", {}).get("tokens", (0, 0))
            logger.info(
                "%s %s %d tokens=%d/%d %.3fs",
                scope["method"],
                _printable(scope["path"]),
                status[0],
                prompt,
                completion,
                time.perf_counter() - start,
            )


def _printable(path: str) -> str:
    """``path`` (percent-decoded) with its control characters escaped: a client's ``%0A`` would
    otherwise write a line of its own making into the log."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in path)


class _CancelledAtShutdown:
    """A request still running when the drain timeout passes is cancelled by uvicorn, which then
    answered a plain-text 500: it gets the 503 ``worker_closed`` error instead (as JSON, or as
    its stream's last event once the stream began), and its task ends there."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = {"started": False, "ended": False, "stream": False}

        async def tracking(message):
            if message["type"] == "http.response.start":
                sent["started"] = True
                sent["stream"] = any(
                    v.startswith(b"text/event-stream") for k, v in message["headers"] if k == b"content-type"
                )
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except asyncio.CancelledError:
            if sent["ended"]:
                raise
            error = ApiError(
                503,
                "the server is shutting down: the request was still running when the drain timeout "
                "(ServerConfig.drain_timeout_s) passed",
                type="service_unavailable",
                code="worker_closed",
            )
            body = json.dumps(error.body()).encode()
            if not sent["started"]:
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
            elif sent["stream"]:
                body = b"data: " + body + b"\n\n"
            else:
                body = b""
            await send({"type": "http.response.body", "body": body, "more_body": False})
