import asyncio
import threading

import pytest

from rollout.gate import EngineGate, GateClosed


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


def test_a_blocking_entry_on_an_event_loops_thread_is_refused_while_a_change_is_pending():
    """Waiting there could never end: the change waits for the calls in flight, one of which may
    be the loop's own (an agenerate), and the loop is the thread that would wait."""
    draining = threading.Event()

    class Observed(type(threading.Condition())):
        def wait_for(self, predicate, timeout=None):
            if not predicate():
                draining.set()  # the exclusive change waits for the calls in flight
            return super().wait_for(predicate, timeout)

    gate, release = EngineGate(), threading.Event()
    gate._cond = Observed()
    gate.enter()  # the loop's agenerate, in flight

    def sync():
        with gate.exclusive("weights are being swapped"):
            release.wait()

    changer = threading.Thread(target=sync)
    changer.start()
    draining.wait()

    async def blocking_generate_on_the_loop():
        with pytest.raises(GateClosed, match="weights are being swapped"):
            gate.enter()

    asyncio.run(blocking_generate_on_the_loop())
    gate.leave()  # the agenerate ends: the change runs
    release.set()
    changer.join()
    assert gate.try_enter()
