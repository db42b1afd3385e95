import asyncio
import collections
import threading

import pytest

from rollout.gate import EngineGate, GateClosed, OwnCallsInFlight


class _InterruptedDrain(type(threading.Condition())):
    """A condition whose wait for the admitted calls to drain is interrupted (Ctrl-C)."""

    def wait_for(self, predicate, timeout=None):
        if predicate():
            return True
        raise KeyboardInterrupt


def test_an_interrupt_while_calls_drain_reopens_the_gate():
    gate = EngineGate()
    gate._cond = _InterruptedDrain()
    gate.enter()  # a generate call in flight
    with pytest.raises(KeyboardInterrupt), gate.exclusive("sync_params"):
        pytest.fail("the exclusive block ran with a call in flight")
    assert gate.exclusive_reason is None
    gate.leave()
    assert gate.try_enter()  # new calls are admitted again
    gate.leave()
    with gate.exclusive("sync_params"):
        assert gate.exclusive_reason == "sync_params"


def test_exclusive_blocks_nest_on_the_owning_thread():
    gate = EngineGate()
    with gate.exclusive("outer"):
        with gate.exclusive("inner"):
            assert not gate.try_enter()
        assert gate.exclusive_reason == "outer"
        assert not gate.try_enter()
    assert gate.try_enter()


class Observed(type(threading.Condition())):
    """A condition that says which threads waited on it (with the predicate false)."""

    def __init__(self):
        super().__init__()
        self.waiting: dict[str, threading.Event] = collections.defaultdict(threading.Event)

    def wait_for(self, predicate, timeout=None):
        if not predicate():
            self.waiting[threading.current_thread().name].set()
        return super().wait_for(predicate, timeout)


def test_a_blocking_entry_is_refused_on_a_loop_whose_own_calls_a_pending_change_waits_for():
    """Waiting there could never end: the change waits for the loop's agenerate, and the loop is
    the thread that would wait. A loop with no call admitted waits as any thread does."""
    gate, release = EngineGate(), threading.Event()
    gate._cond = Observed()
    outcome = {}

    def sync():
        with gate.exclusive("weights are being swapped"):
            release.wait()

    async def loop_with_a_call():
        loop = await gate.aenter()  # the loop's agenerate, in flight
        changer = threading.Thread(target=sync, name="changer")
        changer.start()
        assert gate._cond.waiting["changer"].wait(60)  # the change waits for the call in flight
        with pytest.raises(GateClosed, match="weights are being swapped"):
            gate.enter()  # a blocking generate on the same loop
        other = threading.Thread(target=lambda: asyncio.run(loop_without_calls()), name="other loop")
        other.start()
        assert gate._cond.waiting["other loop"].wait(60), "refused: it has no call of its own"
        gate.leave(loop)  # the agenerate ends: the change runs, then the other loop's call
        release.set()
        changer.join(60)
        other.join(60)
        assert not changer.is_alive() and not other.is_alive()

    async def loop_without_calls():
        gate.enter()
        outcome["entered"] = True
        gate.leave()

    errors = []

    def run(main):
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported below, on the test's thread
            errors.append(exc)

    # On a thread of its own: a gate that let the loop wait would deadlock it (the test fails).
    first = threading.Thread(target=run, args=(loop_with_a_call,), daemon=True)
    first.start()
    first.join(120)
    assert not first.is_alive(), "the loop's blocking entry waited for the change waiting for the loop's call"
    assert errors == [] and outcome == {"entered": True} and gate.try_enter() and gate._loop_calls == {}


def test_a_change_on_a_loop_whose_own_calls_are_in_flight_is_refused_and_closes_nothing():
    """drop_kv() (or a sync) on an event loop's thread while that loop's agenerate ran waited
    for that call for ever, and every other thread's generate behind it."""
    gate = EngineGate()

    async def main():
        loop = await gate.aenter()  # this loop's own call, in flight
        with pytest.raises(OwnCallsInFlight, match=r"drop_kv\(\) on a thread whose event loop has 1 call"):
            gate.check_no_own_calls("drop_kv()")
        with pytest.raises(OwnCallsInFlight), gate.exclusive("the KV cache is being dropped"):
            pytest.fail("the exclusive block ran with the loop's own call in flight")
        assert gate.exclusive_reason is None and gate.try_enter()  # nothing was closed
        gate.leave()
        gate.leave(loop)
        with gate.exclusive("the KV cache is being dropped"):  # none of its own left: it runs
            assert gate.exclusive_reason == "the KV cache is being dropped"

    asyncio.run(main())


def test_waiting_for_a_lock_a_change_holds_while_it_waits_for_the_loops_own_calls_is_refused():
    """An in-flight sync (or a weights checksum) on a loop's thread with calls in flight waited
    for the sync lock, which a drain sync of another thread held while it waited for those
    calls: both waited for ever. Without such a change pending the lock is simply waited for."""
    gate, lock = EngineGate(), threading.RLock()
    holder_waits, holder_done = threading.Event(), threading.Event()

    def drain_change():  # as a drain sync: the lock, then the gate's exclusive section
        with lock:
            holder_waits.set()
            with gate.exclusive("weights are being swapped"):
                pass
        holder_done.set()

    async def main():
        loop = await gate.aenter()  # this loop's own call, in flight
        with gate.holding(lock, "sync_params()"):  # free: taken at once
            pass
        change = threading.Thread(target=drain_change, daemon=True)
        change.start()
        while gate.exclusive_reason is None:  # the change holds the lock and waits for the call
            assert change.is_alive()
            await asyncio.sleep(0.001)
        assert holder_waits.is_set()
        with pytest.raises(
            OwnCallsInFlight, match=r"sync_params\(\) on a thread .* is pending \(weights are being swapped\)"
        ):
            with gate.holding(lock, "sync_params()"):
                pytest.fail("the lock was taken while its holder waited for this loop's call")
        gate.leave(loop)  # the call ends: the change runs
        await asyncio.to_thread(holder_done.wait, 60)
        assert holder_done.is_set()
        change.join()

    errors = []

    def run():
        try:
            asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)

    # On a thread of its own: a lock that let the loop wait would deadlock it (the test fails).
    loop_thread = threading.Thread(target=run, daemon=True)
    loop_thread.start()
    loop_thread.join(120)
    assert not loop_thread.is_alive(), "the loop's thread waited for a lock whose holder waited for its call"
    assert errors == []
    # No own calls (another thread, or none in flight): the lock is waited for, not refused.
    with gate.holding(lock, "sync_params()"):
        assert lock._is_owned()
