"""What every route shares: the backend, the settings, and the request checks they all run."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from starlette.requests import ClientDisconnect

from .backend import Backend
from .config import ServerConfig
from .errors import unavailable_error
from .protocol import ApiError, check_bearer, invalid, parse_body


class SharedState:
    """The backend and settings of one app, and the served model's name."""

    def __init__(self, backend: Backend, config: ServerConfig):
        self.backend, self.config = backend, config
        self.model_name = config.served_model_name or backend.model_name
        self.created = int(time.time())
        # Bodies being read (tasks of the server's loop), and whether the server's drain began.
        self._reading: set[asyncio.Task] = set()
        self._draining = False

    def begin_drain(self) -> None:
        """Answer every request still waiting for its body now, and any later one at once (on
        the server's loop, as its drain begins): none has started work, and a client that
        stalls mid-body held the drain to its timeout."""
        self._draining = True
        for reading in self._reading:
            reading.cancel()

    def check_api_key(self, request: Request) -> None:
        if self.config.api_key is not None:
            check_bearer(request, self.config.api_key, "API key")

    async def read_json(self, request: Request) -> dict:
        """The request's body as a JSON object. It must arrive whole within
        ``body_timeout_s`` (a 408) and before the server's drain begins (a 503 ``worker_closed``);
        both close the connection, whose unread rest of a body is of no use."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        if self._draining:
            raise _drained()
        reading = asyncio.ensure_future(_read_body(request, limit))
        self._reading.add(reading)
        try:
            done, _ = await asyncio.wait({reading}, timeout=self.config.body_timeout_s)
        finally:
            self._reading.discard(reading)
            if not reading.done():
                reading.cancel()
        if not done:
            timeout = self.config.body_timeout_s
            message = f"the request body did not arrive whole within {timeout} s (ServerConfig.body_timeout_s)"
            raise ApiError(408, message, code="request_timeout", close=True)
        if reading.cancelled():  # by begin_drain
            raise _drained()
        return parse_body(reading.result())

    def check_model(self, body: dict) -> str | None:
        """The LoRA adapter the body's ``model`` names (None: the served model itself)."""
        model = body.get("model")
        if model is None:
            raise invalid("model", "'model' is required")
        if not isinstance(model, str):
            raise invalid("model", f"'model' must be a string, got {type(model).__name__}")
        return self.check_model_name(model)

    def check_model_name(self, model: str) -> str | None:
        """None for the served model, ``model`` for a LoRA adapter loaded under that name
        (``/admin/load_lora``'s ``lora_name``, as vLLM serves them); 404 otherwise."""
        if model == self.model_name:
            return None
        adapters = self.backend.adapter_names()
        if model not in adapters:
            served = f"'{self.model_name}'" + (f" and the LoRA adapters {adapters}" if adapters else "")
            message = f"model '{model}' does not exist; this server serves {served}"
            raise ApiError(404, message, param="model", code="model_not_found")
        return model

    def model_card(self, adapter: str | None = None) -> dict:
        """The served model's card, or a LoRA adapter's (whose ``parent`` is the model, as vLLM's)."""
        card = {"id": adapter or self.model_name, "object": "model", "created": self.created}
        card["owned_by"] = "sglang-jax-rollout"
        return card if adapter is None else {**card, "parent": self.model_name}

    def check_available(self) -> None:
        """A 503 saying why generation cannot start now. A KV cache dropped through
        /admin/drop_kv stays dropped until rebuilt (the backend holds it); one the worker dropped
        (a train step) is rebuilt by the first generate once the worker allows generating again."""
        reason = self.backend.unavailable_reason
        if reason is not None:
            raise unavailable_error(reason)


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone: nobody reads the answer, and nothing went wrong here
        raise ApiError(499, "the client disconnected before sending its whole body") from None
    return b"".join(chunks)


def _drained() -> ApiError:
    message = "the server is shutting down: its drain began before the request's body was read"
    return ApiError(503, message, type="service_unavailable", code="worker_closed", close=True)
