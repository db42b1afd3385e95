"""rollout/engine/requests.py: a call's answer reaches its caller as soon as it is ready."""

import asyncio
import threading
import types

from rollout.engine import requests
from rollout.engine.requests import RequestLoop


def test_an_answer_is_returned_as_soon_as_it_is_ready_not_at_the_next_liveness_check(monkeypatch):
    # With a liveness check an hour apart, an answer held until the check would time out here.
    monkeypatch.setattr(requests, "LIVENESS_CHECK_S", 3600.0)
    shell = RequestLoop.__new__(RequestLoop)
    shell._control = types.SimpleNamespace(error=None, stopped=threading.Event())

    async def answer():
        return "tokens"

    async def call():
        shell._result_task = asyncio.get_running_loop().create_future()  # the engine's, never done
        return await asyncio.wait_for(shell._guarded(answer()), timeout=60)

    assert asyncio.run(call()) == "tokens"
