"""Concurrent generate calls, weight swaps that wait only for running calls, compile counting."""

import asyncio
import contextlib
import gc
import logging
import threading

import jax
import jax.numpy as jnp
import pytest

from rollout import OwnCallsInFlight, RolloutWorker, WorkerUnavailable, compile_count, counting_compiles
from tests.helpers import admitted_together, held_mid_call, tiny_worker_config, wait_until
from trainer_bridge import load_hf_params

# Batching across threads and event loops, the sync gate: the worker's Python, which no supported
# jax/flax/transformers version changes, run at one end (the engine calls are tested at both).
pytestmark = pytest.mark.one_end

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11]]


@pytest.fixture(scope="module")
def worker(qwen2_dir):
    # Two prefill sizes: the short prompts here take the first, so a long one compiles anew.
    with RolloutWorker(tiny_worker_config(qwen2_dir, precompile_token_paddings=(64, 512))) as w:
        w.generate(PROMPTS, max_new_tokens=4, temperature=0.0)  # compile outside the tests
        yield w


@pytest.fixture(scope="module")
def params(qwen2_dir):
    return load_hf_params(qwen2_dir)


def _run_in_threads(*fns):
    results, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    # Daemons: a thread stuck after a failure must not keep the session from ending.
    threads = [threading.Thread(target=run, args=(i, fn), name=fn.__name__, daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert not [t.name for t in threads if t.is_alive()], "still running after 300 s"
    return results


def test_generates_from_two_threads_are_batched_together(worker):
    """Two threads' calls share the engine's forwards (the batching is the engine's: the calls
    are admitted together however the threads are scheduled) and get what each alone gets."""
    kwargs = dict(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=11)
    engine = worker.engine
    start = engine.forward_count
    alone = worker.generate(PROMPTS, **kwargs)
    sequential = engine.forward_count - start
    start = engine.forward_count
    with admitted_together(worker, requests=len(PROMPTS) + 2):
        a, b = _run_in_threads(
            lambda: worker.generate(PROMPTS, **kwargs), lambda: worker.generate(PROMPTS[:2], **kwargs)
        )
    together = engine.forward_count - start
    # Serialized calls would need about twice the forwards of one call; batched ones about as many.
    assert together < 1.5 * sequential, (together, sequential)
    assert a.completions == alone.completions
    assert b.completions == alone.completions[:2]


def test_agenerate_runs_many_calls_at_once_on_one_loop(worker):
    kwargs = dict(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    expected = worker.generate(PROMPTS, **kwargs)

    async def main():
        return await asyncio.gather(*(worker.agenerate([p], **kwargs) for p in PROMPTS))

    batches = asyncio.run(main())
    assert [b.completions[0] for b in batches] == expected.completions


def test_astream_yields_tokens_as_they_come_and_matches_generate(worker):
    kwargs = dict(temperature=1.0, max_new_tokens=12, ignore_eos=True, n=2, seed=5)
    expected = worker.generate(PROMPTS, **kwargs)

    async def main():
        return [chunk async for chunk in worker.astream(PROMPTS, **kwargs)]

    chunks = asyncio.run(main())
    rows = [[] for _ in range(expected.size)]
    finished = {}
    for chunk in chunks:
        assert chunk.prompt_index == chunk.row // 2 and chunk.sample_index == chunk.row % 2
        rows[chunk.row].extend(chunk.token_ids)
        if chunk.finish_reason:
            finished[chunk.row] = chunk.finish_reason
    assert rows == expected.completions
    assert finished == dict.fromkeys(range(expected.size), "length")
    assert len(chunks) > expected.size, "tokens arrive in several chunks per row"
    assert {c.weight_version for c in chunks} == {worker.weight_version}


def test_a_stream_closed_once_its_rows_ended_leaves_no_task_unretrieved(worker, caplog):
    """A server closes a stream at its rows' last chunks: 0.0.2's side of it, cancelled then,
    left one task per row whose StopAsyncIteration nobody retrieved (an asyncio ERROR in the
    log after every ordinary stream). Its tasks are gone by the next call's answer."""

    async def until_every_row_ended():
        ended = set()
        async with contextlib.aclosing(
            worker.astream(PROMPTS, temperature=1.0, max_new_tokens=6, ignore_eos=True, n=2, seed=2)
        ) as chunks:
            async for chunk in chunks:
                ended |= {chunk.row} if chunk.finish_reason else set()
                if len(ended) == 2 * len(PROMPTS):
                    break

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for _ in range(3):
            asyncio.run(until_every_row_ended())
        worker.generate(PROMPTS, max_new_tokens=2, temperature=0.0)
        gc.collect()
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_sync_waits_only_for_running_calls_and_versions_are_exact(worker, params, monkeypatch):
    worker.sync_params(params)
    version = worker.weight_version
    long_call = dict(temperature=1.0, max_new_tokens=150, ignore_eos=True, n=4, seed=1)
    # The order in which the code under test leaves the gate and commits the swap (appended by
    # the threads themselves, so the list order is the event order: no clocks compared).
    events = []
    gate, leave = worker._gate, worker._gate.leave
    monkeypatch.setattr(
        gate, "leave", lambda *loop: (events.append(("leave", threading.current_thread().name)), leave(*loop))
    )
    for weights in worker._group.weights:
        monkeypatch.setattr(weights, "commit", _recording(weights.commit, events, "commit"))

    def generate_long():
        return worker.generate(PROMPTS, **long_call)

    def sync_during():
        assert held.wait(300)  # the long call is running
        return worker.sync_params(params)

    def generate_after_sync_started():
        assert held.wait(300)
        wait_until(lambda: worker.unavailable_reason is not None, timeout=300)
        return worker.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=4)

    # The long call is held mid-decode until the sync waits for it.
    with held_mid_call(worker, until=lambda: worker.unavailable_reason is not None) as held:
        long_batch, report, late = _run_in_threads(generate_long, sync_during, generate_after_sync_started)
    assert long_batch.weight_version == version
    assert report.version == version + 1
    assert late.weight_version == version + 1, "a call issued while a swap waits runs after it"
    long_left = events.index(("leave", "generate_long"))
    first_commit = next(i for i, e in enumerate(events) if e[0] == "commit")
    assert long_left < first_commit, f"the swap waited for the running call: {events}"
    assert events[-1] == ("leave", "generate_after_sync_started"), f"the late call ran after the swap: {events}"
    assert (long_batch.weight_versions == version).all()


def test_a_release_for_training_waits_for_a_sync_being_prepared(worker, params, monkeypatch):
    """A sync prepares its leaves (a snapshot of what the engine serves, for the leaves it does
    not change) before it takes the gate: a release for training taken in between would be
    undone by its commit, which would serve the released (soon donated) arrays and let generate
    run during the train step. The release waits for the sync."""
    worker.sync_params(params)
    prepared, go, released, events = threading.Event(), threading.Event(), threading.Event(), []
    prepare = worker._group.prepare

    def prepare_then_wait(*args, **kwargs):
        result = prepare(*args, **kwargs)
        prepared.set()
        go.wait()
        events.append("sync committing")
        return result

    monkeypatch.setattr(worker._group, "prepare", prepare_then_wait)

    def sync():
        return worker.sync_params(params)

    def release():
        assert prepared.wait(300)
        with worker.released_for_training():
            events.append("released")
            released.set()

    def let_the_sync_go():
        try:
            assert prepared.wait(300)
            released.wait(3)  # set within it only where the release did not wait for the sync
        finally:
            go.set()  # the sync goes whatever failed here

    _run_in_threads(sync, release, let_the_sync_go)
    assert events == ["sync committing", "released"]
    with pytest.raises(WorkerUnavailable, match="a train step ran since the last sync_params"):
        worker.generate(PROMPTS, max_new_tokens=2)
    worker.sync_params(params)


def _recording(fn, events, name):
    def wrapped(*args, **kwargs):
        events.append((name, threading.current_thread().name))
        return fn(*args, **kwargs)

    return wrapped


def test_a_change_on_a_loop_whose_own_call_runs_is_refused_and_the_call_finishes(worker, params):
    """drop_kv(), rebuild_kv(), a sync or a release for training on an event loop's thread while
    that loop's agenerate ran waited for that call for ever (the loop cannot run it meanwhile),
    and every generate of every thread after it."""

    async def main():
        task = asyncio.create_task(worker.agenerate([PROMPTS[0]], temperature=0.0, max_new_tokens=200, ignore_eos=True))
        while not worker._gate.active_calls:  # admitted on this loop (it runs between our awaits only)
            await asyncio.sleep(0)
        changes = [worker.drop_kv, worker.rebuild_kv, lambda: worker.sync_params(params)]
        changes.append(lambda: worker.released_for_training().__enter__())
        for change in changes:
            with pytest.raises(OwnCallsInFlight, match="call\\(s\\) of this worker in flight"):
                change()
        return await task

    assert int(asyncio.run(main()).completion_mask.sum()) == 200
    assert not worker.kv_dropped
    assert int(worker.generate([PROMPTS[0]], max_new_tokens=2).completion_mask.sum()) == 2


def test_an_in_flight_change_on_a_loop_whose_call_a_drain_sync_waits_for_is_refused(worker, params):
    """An in-flight sync or a weights checksum on an event loop's thread with an agenerate in
    flight waited for the sync lock, held by another thread's drain sync that waited for that
    call: both hung for good. Refused; the call and the drain sync then finish."""
    drained, outcome = [], []
    worker.sync_params(params)  # its plan compiled: the drain sync below waits for the call at once

    async def main():
        task = asyncio.create_task(worker.agenerate([PROMPTS[0]], temperature=0.0, max_new_tokens=240, ignore_eos=True))
        while not worker._gate.active_calls:
            await asyncio.sleep(0)
        trainer = threading.Thread(target=lambda: drained.append(worker.sync_params(params)), daemon=True)
        trainer.start()
        while worker._gate.exclusive_reason is None:  # the drain sync holds the lock, waits for the call
            assert trainer.is_alive() and not task.done()
            await asyncio.sleep(0.001)
        for change in (lambda: worker.sync_params(params, in_flight=True), worker.weights_checksum):
            with pytest.raises(OwnCallsInFlight, match="while a change that waits for them is pending"):
                change()
        batch = await task
        await asyncio.to_thread(trainer.join, 120)
        return batch

    def run():
        try:
            outcome.append(asyncio.run(main()))
        except BaseException as exc:
            outcome.append(exc)

    version = worker.weight_version
    # On a thread of its own: a change that waited for the lock would deadlock it (the test fails).
    loop_thread = threading.Thread(target=run, daemon=True)
    loop_thread.start()
    loop_thread.join(300)
    assert not loop_thread.is_alive(), "the loop's thread waited for the lock the drain sync held"
    (batch,) = outcome
    assert not isinstance(batch, BaseException), batch
    assert int(batch.completion_mask.sum()) == 240
    assert [report.version for report in drained] == [version + 1] == [worker.weight_version]


def test_compile_counter_sees_what_cache_miss_count_missed(worker):
    before = compile_count()
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0))  # a fresh function: one compilation
    assert compile_count() - before >= 1
    with counting_compiles() as compiles:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
    assert compiles.value >= 1
    # A new padding bucket compiles; the same call again does not.
    first = worker.generate([list(range(1, 120))], temperature=0.0, max_new_tokens=3)
    again = worker.generate([list(range(1, 120))], temperature=0.0, max_new_tokens=3)
    assert first.compiles >= 1 and again.compiles == 0
