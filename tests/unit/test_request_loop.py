"""rollout/engine/requests.py: a call's answer reaches its caller as soon as it is ready, and a
call whose engine's result loop ended fails with EngineError."""

import asyncio
import concurrent.futures

import pytest

from rollout.engine import EngineError, requests
from rollout.engine.requests import RequestLoop
from rollout.engine.runtime import SchedulerControl


def request_loop(control) -> RequestLoop:
    """A RequestLoop without an engine: what ``_guarded`` reads."""
    loop = RequestLoop.__new__(RequestLoop)
    loop._control = control
    return loop


def test_an_answer_is_returned_as_soon_as_it_is_ready_not_at_the_next_liveness_check(monkeypatch):
    # With a liveness check an hour apart, an answer held until the check would time out here.
    monkeypatch.setattr(requests, "LIVENESS_CHECK_S", 3600.0)
    shell = request_loop(SchedulerControl("test"))

    async def answer():
        return "tokens"

    async def call():
        shell._result_task = asyncio.get_running_loop().create_future()  # the engine's, never done
        return await asyncio.wait_for(shell._guarded(answer()), timeout=10)

    assert asyncio.run(call()) == "tokens"


@pytest.mark.parametrize("ending", ["error", "cancelled"])
def test_a_call_fails_with_engine_error_when_the_result_loop_ends(monkeypatch, ending):
    monkeypatch.setattr(requests, "LIVENESS_CHECK_S", 3600.0)
    control = SchedulerControl("test")
    shell = request_loop(control)

    async def call():
        loop = asyncio.get_running_loop()
        never = loop.create_future()  # the call's answer, which never comes
        shell._result_task = loop.create_future()
        if ending == "error":
            shell._result_task.set_exception(RuntimeError("tokenizer manager died"))
        else:
            shell._result_task.cancel()
        return await asyncio.wait_for(shell._guarded(never), timeout=10)

    with pytest.raises(EngineError):
        asyncio.run(call())
    assert control.error is not None


def test_a_failing_engine_fails_every_queued_call_past_one_given_up():
    """A call given up at its timeout is cancelled in the queue; the engine's failure still
    reaches the calls queued after it (set_exception on the cancelled one raised, and the
    drain stopped there)."""
    control = SchedulerControl("test")
    futures = [concurrent.futures.Future() for _ in range(3)]
    for future in futures:
        control.calls.put((lambda: None, future))
    control.queue_at_boundary(lambda: None, None, boundary := concurrent.futures.Future())
    futures[0].cancel()
    control.fail(RuntimeError("the scheduler thread died"))
    for future in [*futures[1:], boundary]:
        with pytest.raises(EngineError, match="the scheduler thread died"):
            future.result(timeout=0)
