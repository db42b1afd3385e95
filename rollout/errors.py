"""The worker's errors, by what the caller can do about them.

Each subclasses the builtin it replaced (``ValueError``, ``RuntimeError``), so code catching
those keeps working; the HTTP server maps them to statuses by type, in one place
(``rollout/server/errors.py``).
"""

from __future__ import annotations


class RolloutError(Exception):
    """Base of the errors the worker raises on purpose (``except RolloutError`` catches each
    error of this package). A bad param tree or checkpoint is ``trainer_bridge``'s
    ``SyncError`` or ``CheckpointError`` (``ValueError`` s of the package below this one), except
    a pod's ``PeerSyncError``, both a ``PodError`` and a ``SyncError``."""


class InvalidRequest(RolloutError, ValueError):
    """A generate (or admin) argument is wrong: ``field`` names it (``prompts[3]``, ``seed``).
    Retrying the same call fails the same way."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class LimitExceeded(InvalidRequest):
    """A request asks for more than an admission limit allows: ``limit`` names the setting
    (``WorkerConfig.max_rows_per_call``), ``value`` what was asked (``what``: "rows (prompts
    x n)"), ``maximum`` the limit."""

    def __init__(self, field: str, what: str, value: int, limit: str, maximum: int):
        super().__init__(field, f"the request asks for {value} {what}, more than {limit}={maximum}")
        self.limit, self.value, self.maximum = limit, value, maximum


def check_limit(field: str, what: str, value: int, limit: str, maximum: int | None) -> None:
    """Raise :class:`LimitExceeded` when ``value`` is over ``maximum`` (None: no limit)."""
    if maximum is not None and value > maximum:
        raise LimitExceeded(field, what, value, limit, maximum)


class WorkerUnavailable(RolloutError, RuntimeError):
    """The worker cannot generate now; ``reason`` says why (a weight swap, a train step,
    stale or freed weights). ``retryable``: whether waiting may help."""

    retryable = True

    def __init__(self, reason: str, message: str | None = None):
        super().__init__(message or reason)
        self.reason = reason


class WorkerClosed(WorkerUnavailable):
    """The worker was closed (before or during the call). Never comes back."""

    retryable = False

    def __init__(self, message: str = "the RolloutWorker is closed"):
        super().__init__("the worker is closed", message)


class PlatformError(RolloutError, RuntimeError):
    """This JAX/XLA build cannot run the worker correctly on its platform, before anything
    starts; the message says what is wrong and how to fix the environment."""
