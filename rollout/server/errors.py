"""Every error a route can raise, mapped to its HTTP answer by type, here only.

Bad input is a 4xx naming the field; a worker that cannot generate now is a 503 (with
``Retry-After`` when waiting helps); anything else is a 500 whose request id is in the log,
never a 503 that would invite a retry of a real failure.
"""

from __future__ import annotations

import logging
import re
import uuid

from trainer_bridge import CheckpointError, SyncError

from ..engine import EngineError
from ..errors import InvalidRequest, LimitExceeded, RolloutError, WorkerClosed, WorkerUnavailable
from .protocol import ApiError

logger = logging.getLogger(__name__)

# The worker's argument names -> the OpenAI request's (prompt fields: see ``_param``).
_PARAMS = {"max_new_tokens": "max_tokens"}


def _param(field: str, prompt_field: str) -> str:
    if field == "prompts" or field.startswith("prompts["):
        return prompt_field
    return _PARAMS.get(field, field)


def _message(message: str, prompt_field: str) -> str:
    message = message.replace("max_new_tokens", "max_tokens")
    return re.sub(r"\bprompts(?=\[|\b)", prompt_field, message)


# What api_error maps to a deliberate answer (every other type is a 500).
KNOWN_ERRORS = (ApiError, RolloutError, FileNotFoundError, SyncError, CheckpointError, EngineError)


def api_error(exc: BaseException, *, prompt_field: str = "prompt", where: str = "") -> ApiError:
    """The API error answering ``exc``. Unknown errors are logged with a request id (the one
    the answer names) and ``where`` (method and path)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, LimitExceeded):
        return ApiError(413, _message(str(exc), prompt_field), param=_param(exc.field, prompt_field), code="limit_exceeded")
    if isinstance(exc, InvalidRequest):
        return ApiError(400, _message(str(exc), prompt_field), param=_param(exc.field, prompt_field))
    if isinstance(exc, FileNotFoundError):
        return ApiError(404, str(exc), param="path", code="not_found")
    if isinstance(exc, (SyncError, CheckpointError)):
        return ApiError(400, str(exc))
    if isinstance(exc, WorkerClosed):
        return ApiError(503, f"the server is shutting down: {exc}", type="service_unavailable", code="worker_closed")
    if isinstance(exc, WorkerUnavailable):
        return ApiError(503, f"generation is paused: {exc}; retry later", type="service_unavailable", code="weights_updating")
    request_id = f"req-{uuid.uuid4().hex[:16]}"
    if isinstance(exc, EngineError):
        logger.error("%s: engine failure (request id %s): %s", where, request_id, exc)
        return ApiError(500, f"engine failure (request id {request_id}): {exc}", type="server_error", code="engine_error")
    logger.error("%s: unexpected error (request id %s)", where, request_id, exc_info=exc)
    return ApiError(500, f"internal error (request id {request_id}): {type(exc).__name__}: {exc}", type="server_error")


def retry_after(error: ApiError, seconds: int) -> dict | None:
    """The ``Retry-After`` header of an error worth retrying."""
    return {"Retry-After": str(seconds)} if error.status == 503 and error.code != "worker_closed" else None
