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
    """The worker's message in the request's words: its ``prompts[i]`` is the request's
    ``prompt[i]``, or for a chat (one prompt) the template's rendering of ``messages``; the
    word "prompts" alone stays English."""
    message = message.replace("max_new_tokens", "max_tokens")
    indexed = "the chat template's rendering of messages" if prompt_field == "messages" else rf"{prompt_field}[\1]"
    return re.sub(r"\bprompts\[(\d+)\]", indexed, message)


# Why the worker cannot generate (RolloutWorker.unavailable_reason, WorkerUnavailable.reason,
# the server's own KV hold) -> the 503's code and message: (words in the reason, code, message).
# Matched on the worker's words because its reasons are plain strings; first match wins.
_UNAVAILABLE = (
    ("the worker is closed", "worker_closed", "the server is shutting down: {reason}"),
    # RolloutWorker.released_for_training: the KV cache is freed and the weights handed to the
    # trainer from the drop until the next sync (during the train step and after it alike).
    (
        "a train step",
        "released_for_training",
        "generation is paused: the KV cache is released for training ({reason}); "
        "retry once the trainer has synced new weights",
    ),
    (
        "were freed",
        "weights_freed",
        "generation is paused: {reason} (donated by the trainer); retry once new weights are synced",
    ),
    ("weights are being", "weights_updating", "generation is paused: {reason}; retry later"),
    ("/admin/drop_kv", "kv_cache_dropped", "generation is paused: {reason}; retry after /admin/rebuild_kv"),
    ("KV cache is being", "kv_cache_updating", "generation is paused: {reason}; retry later"),
)
_OTHER_UNAVAILABLE = ("unavailable", "generation is paused: {reason}; retry later")


def unavailable_error(reason: str) -> ApiError:
    """The 503 answering a worker that cannot generate now, for ``reason``."""
    code, message = next(
        ((code, message) for words, code, message in _UNAVAILABLE if words in reason), _OTHER_UNAVAILABLE
    )
    return ApiError(503, message.format(reason=reason), type="service_unavailable", code=code)


# What api_error maps to a deliberate answer (every other type is a 500).
KNOWN_ERRORS = (ApiError, RolloutError, FileNotFoundError, SyncError, CheckpointError, EngineError)


def api_error(exc: BaseException, *, prompt_field: str = "prompt", where: str = "") -> ApiError:
    """The API error answering ``exc``. Unknown errors are logged with a request id (the one
    the answer names) and ``where`` (method and path)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, LimitExceeded):
        return ApiError(
            413, _message(str(exc), prompt_field), param=_param(exc.field, prompt_field), code="limit_exceeded"
        )
    if isinstance(exc, InvalidRequest):
        return ApiError(400, _message(str(exc), prompt_field), param=_param(exc.field, prompt_field))
    if isinstance(exc, FileNotFoundError):
        return ApiError(404, str(exc), param="path", code="not_found")
    if isinstance(exc, (SyncError, CheckpointError)):
        return ApiError(400, str(exc))
    if isinstance(exc, WorkerClosed):
        return ApiError(503, f"the server is shutting down: {exc}", type="service_unavailable", code="worker_closed")
    if isinstance(exc, WorkerUnavailable):
        return unavailable_error(exc.reason)
    request_id = f"req-{uuid.uuid4().hex[:16]}"
    if isinstance(exc, EngineError):
        logger.error("%s: engine failure (request id %s): %s", where, request_id, exc)
        return ApiError(
            500, f"engine failure (request id {request_id}): {exc}", type="server_error", code="engine_error"
        )
    logger.error("%s: unexpected error (request id %s)", where, request_id, exc_info=exc)
    return ApiError(500, f"internal error (request id {request_id}): {type(exc).__name__}: {exc}", type="server_error")


def error_headers(error: ApiError, retry_after_s: int) -> dict:
    """The headers of an error's answer: ``Retry-After`` for one worth retrying, ``Connection:
    close`` for one that closes the connection (uvicorn closes it once the answer is sent)."""
    headers = {}
    if error.status == 503 and error.code != "worker_closed":
        headers["Retry-After"] = str(retry_after_s)
    if error.close:
        headers["Connection"] = "close"
    return headers
