"""Streaming one generate call from several engines: their updates merged into one stream in
global row order, and turned into chunks of the tokens new since each row's last chunk."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from .batch import StreamChunk
from .engine import GenerateOutput

# (the engine's global rows, its stream of (its own row, output so far))
EngineStream = tuple[list[int], AsyncIterator[tuple[int, GenerateOutput]]]


async def merged(streams: Sequence[EngineStream]) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """``(global row, output so far)`` from every engine as they arrive. An engine's failure
    ends the stream at once with its error; leaving early stops every engine's stream."""
    updates: asyncio.Queue = asyncio.Queue()

    async def pump(rows, stream):
        async for row, output in stream:
            await updates.put((rows[row], output))

    tasks = [asyncio.ensure_future(pump(rows, stream)) for rows, stream in streams]
    pending = set(tasks)

    def ended(task):
        pending.discard(task)
        if not pending or (not task.cancelled() and task.exception() is not None):
            updates.put_nowait(None)

    for task in tasks:
        task.add_done_callback(ended)
    try:
        while (update := await updates.get()) is not None:
            yield update
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
    finally:
        for task in tasks:
            task.cancel()
        # Every pump's outcome is collected (no "exception was never retrieved").
        await asyncio.gather(*tasks, return_exceptions=True)


async def chunks(
    updates: AsyncIterator[tuple[int, GenerateOutput]], rows: int, n: int, version: int
) -> AsyncIterator[StreamChunk]:
    """One chunk per row update that brings tokens or ends the row (``n`` samples a prompt,
    ``rows`` in all, generated with weight ``version``). Closing it closes ``updates``."""
    sent = [0] * rows
    async with contextlib.aclosing(updates):
        async for row, output in updates:
            new = output.output_ids[sent[row] :]
            end = len(output.output_ids)
            logprobs = None if output.logprobs is None else output.logprobs[sent[row] : end]
            versions = None if output.token_versions is None else output.token_versions[sent[row] : end]
            sent[row] = end
            if new or output.finish_reason:
                reason = output.finish_reason or None
                yield StreamChunk(
                    row, row // n, row % n, new, reason, version, logprobs, versions, output.cached_tokens
                )
