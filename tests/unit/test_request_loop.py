"""rollout/engine/requests.py: a call's answer reaches its caller as soon as it is ready, and a
call whose engine's result loop ended fails with EngineError."""

import asyncio
import concurrent.futures
import gc
import logging

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


def test_a_rows_task_left_behind_by_a_stream_logs_nothing(caplog):
    """0.0.2 leaves a streamed call's per-row tasks when its consumer stops; one whose row had
    ended ends with StopAsyncIteration, unretrieved. The request loop does not log it (it was an
    ERROR after ordinary server streams); any other unretrieved exception it still logs."""
    loop = requests.request_event_loop()

    async def ended_row():
        return
        yield

    async def failing():
        raise ValueError("a real failure")

    async def leave_tasks():
        # As 0.0.2 does: a task per row's next result, never awaited once the stream is left.
        left = [asyncio.ensure_future(ended_row().__anext__()), asyncio.ensure_future(failing())]
        await asyncio.wait(left)

    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            loop.run_until_complete(leave_tasks())
            gc.collect()
    finally:
        loop.close()
    messages = [r.getMessage() + str(r.exc_info) for r in caplog.records]
    assert [m for m in messages if "never retrieved" in m and "ValueError" in m], messages
    assert not [m for m in messages if "StopAsyncIteration" in m], messages
