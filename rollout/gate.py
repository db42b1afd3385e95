"""Admission of engine calls versus exclusive changes (weight swaps, KV drop and rebuild).

Generate calls run concurrently (the engine batches them). An exclusive change first stops
admitting new calls, then waits for the admitted ones to finish, runs alone, and re-opens:
a sync issued while generates run waits only for those, and every call sees one weight
version from start to end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Iterator

from .errors import RolloutError


class GateClosed(RuntimeError):
    """A blocking entry refused where waiting could deadlock; ``reason``: the change pending."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class OwnCallsInFlight(RolloutError, RuntimeError):
    """A blocking change (a sync, a KV drop, a release for training) on a thread whose event loop
    has calls of the worker in flight: it would wait for them, which that loop cannot run while
    its thread waits."""


class EngineGate:
    def __init__(self):
        self._cond = threading.Condition()
        self._active = 0
        self._reason: str | None = None
        self._owner: int | None = None
        self._depth = 0
        # Calls admitted by aenter, by the event loop they run on.
        self._loop_calls: collections.Counter = collections.Counter()

    @property
    def exclusive_reason(self) -> str | None:
        """What exclusive change is pending or running, or None."""
        return self._reason

    @property
    def active_calls(self) -> int:
        return self._active

    def try_enter(self, loop: asyncio.AbstractEventLoop | None = None) -> bool:
        with self._cond:
            if self._reason is not None:
                return False
            self._active += 1
            if loop is not None:
                self._loop_calls[loop] += 1
            return True

    def enter(self) -> None:
        """Wait until no exclusive change is pending, then count a call in. On a thread that
        runs an event loop with calls of its own admitted (:meth:`aenter`), a pending change is
        :class:`GateClosed` at once: it waits for those calls, which that loop can no longer run."""
        loop = _running_loop()
        with self._cond:
            if self._reason is not None and loop is not None and self._loop_calls[loop]:
                raise GateClosed(self._reason)
            self._cond.wait_for(lambda: self._reason is None)
            self._active += 1

    async def aenter(self, poll_s: float = 0.005) -> asyncio.AbstractEventLoop:
        """Count a call of the running event loop in, once no change is pending; returns the
        loop, for :meth:`leave`."""
        # Polling keeps the caller's event loop free and needs no executor thread, which an
        # exclusive change issued from the same loop's executor might be waiting for.
        loop = asyncio.get_running_loop()
        while not self.try_enter(loop):
            await asyncio.sleep(poll_s)
        return loop

    def leave(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Count a call out; ``loop``: the one :meth:`aenter` admitted it on."""
        with self._cond:
            self._active -= 1
            if loop is not None:
                self._loop_calls[loop] -= 1
                if not self._loop_calls[loop]:
                    del self._loop_calls[loop]
            self._cond.notify_all()

    def own_calls(self) -> int:
        """Calls admitted (:meth:`aenter`) on the event loop this thread runs, not yet left."""
        loop = _running_loop()
        with self._cond:
            return self._loop_calls[loop] if loop is not None else 0

    def check_no_own_calls(self, what: str) -> None:
        """:class:`OwnCallsInFlight` if this thread runs an event loop with calls admitted
        (:meth:`aenter`) that have not left: ``what`` would wait for them for ever."""
        calls = self.own_calls()
        if calls:
            raise OwnCallsInFlight(
                f"{what} on a thread whose event loop has {calls} call(s) of this worker in flight: it waits for "
                "them, which that loop cannot run while its thread waits. Await them first, or make this call "
                "from another thread (await asyncio.to_thread(...))"
            )

    @contextlib.contextmanager
    def holding(self, lock: threading.RLock, what: str, poll_s: float = 0.05) -> Iterator[None]:
        """Hold ``lock``, which a change holds while it waits in :meth:`exclusive`. On a thread
        whose event loop has calls admitted, such a change would wait for those calls and this
        thread for the change, for ever (the loop cannot run them while its thread waits): once
        a change is pending and the lock still taken, :class:`OwnCallsInFlight` instead (also where
        the pending change is not the lock's holder: a refusal that waiting might have avoided,
        never a deadlock)."""
        calls = self.own_calls()
        if not calls:
            with lock:
                yield
            return
        while not lock.acquire(timeout=poll_s):
            reason = self._reason
            if reason is not None:
                raise OwnCallsInFlight(
                    f"{what} on a thread whose event loop has {calls} call(s) of this worker in flight, while a "
                    f"change that waits for them is pending ({reason}): the lock it waits for may be held by that "
                    "change, which waits for calls that loop cannot run while its thread waits. Await them first, "
                    "or make this call from another thread (await asyncio.to_thread(...))"
                )
        try:
            yield
        finally:
            lock.release()

    @contextlib.contextmanager
    def exclusive(self, reason: str) -> Iterator[None]:
        """Run the block with no admitted call in flight and none admitted meanwhile.
        Re-entrant on the owning thread; exclusive blocks of other threads queue. On a thread
        whose event loop has calls in flight, :class:`OwnCallsInFlight` (nothing closed)."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
            else:
                self.check_no_own_calls(f"waiting for calls to end ({reason})")  # the lock is re-entrant
                self._cond.wait_for(lambda: self._reason is None)
                self._reason, self._owner, self._depth = reason, me, 1
                try:
                    self._cond.wait_for(lambda: self._active == 0)
                except BaseException:  # an interrupt while calls drain: re-open, or nothing is admitted again
                    self._reopen()
                    raise
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0:
                    self._reopen()

    def _reopen(self) -> None:
        self._reason, self._owner, self._depth = None, None, 0
        self._cond.notify_all()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
