import threading

import pytest

from rollout.gate import EngineGate


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
