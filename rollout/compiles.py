"""Counting XLA compilations from JAX's own compile events.

The engine's ``cache_miss_count`` only reflects a request's last forward, so it can say 0 for a
call that compiled. JAX records an event for every backend compilation in the process; the
counter here listens to it. Counts are process-wide: a compile on another thread during a call
(the trainer's, another engine's) is counted for that call too, so a count of 0 is proof that
nothing compiled, and a nonzero count is an upper bound.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax

# jax._src.dispatch.BACKEND_COMPILE_EVENT: recorded once per XLA compilation (jax 0.4.x to 0.12).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_count = 0
_installed = False


def _on_duration(event: str, duration: float, **_) -> None:
    global _count
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def compile_count() -> int:
    """XLA compilations in this process since the counter was first used."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _installed = True
        return _count


class CompileCount:
    """Compilations seen between entering a :func:`counting_compiles` block and now/its end."""

    def __init__(self, start: int):
        self._start = start
        self._end: int | None = None

    @property
    def value(self) -> int:
        return (self._end if self._end is not None else compile_count()) - self._start

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"CompileCount({self.value})"


@contextlib.contextmanager
def counting_compiles() -> Iterator[CompileCount]:
    """``with counting_compiles() as compiles: ...``; then ``compiles.value``."""
    counter = CompileCount(compile_count())
    try:
        yield counter
    finally:
        counter._end = compile_count()
