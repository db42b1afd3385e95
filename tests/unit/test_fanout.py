"""The group's one future over several engines' futures (rollout/group.py), without engines."""

import asyncio
import concurrent.futures

import pytest

from rollout.engine import EngineError, GenerateOutput
from rollout.group import _merged


def _output(token: int) -> GenerateOutput:
    return GenerateOutput(output_ids=[token], finish_reason="length", completion_tokens=1, cache_miss_count=0)


def test_outputs_come_back_in_global_row_order_once_every_engine_is_done():
    first, second = concurrent.futures.Future(), concurrent.futures.Future()
    merged = _merged([([0, 2], first), ([1], second)])
    first.set_result([_output(10), _output(12)])
    assert not merged.done()  # the other engine's rows still run
    second.set_result([_output(11)])
    assert [o.output_ids for o in merged.result(timeout=1)] == [[10], [11], [12]]


def test_the_first_failing_engine_in_engine_order_is_raised_after_every_engine_is_done():
    first, second = concurrent.futures.Future(), concurrent.futures.Future()
    merged = _merged([([0], first), ([1], second)])
    second.set_exception(EngineError("engine 1 failed"))
    assert not merged.done()
    first.set_exception(EngineError("engine 0 failed"))
    with pytest.raises(EngineError, match="engine 0 failed"):
        merged.result(timeout=1)


def test_cancelling_the_merged_future_cancels_every_engine_future():
    parts = [concurrent.futures.Future(), concurrent.futures.Future()]
    merged = _merged([([0], parts[0]), ([1], parts[1])])

    async def cancelled_wait():
        task = asyncio.ensure_future(asyncio.wrap_future(merged))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_wait())
    assert merged.cancelled() and all(part.cancelled() for part in parts)
