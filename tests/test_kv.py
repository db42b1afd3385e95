"""KV cache drop / rebuild, memory accounting, the train-step context."""

import asyncio
import concurrent.futures
import functools
import gc

import jax
import numpy as np
import psutil
import pytest

from rollout import RolloutWorker, counting_compiles
from rollout.errors import InvalidRequest, WorkerUnavailable
from rollout.kv import live_device_buffers, live_device_bytes
from tests.helpers import tiny_worker_config
from trainer_bridge import load_hf_params

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11]]


@pytest.fixture(scope="module")
def worker(qwen2_dir):
    with RolloutWorker(tiny_worker_config(qwen2_dir, tp_size=2)) as w:
        yield w


def greedy(worker):
    return worker.generate(PROMPTS, temperature=0.0, max_new_tokens=10, ignore_eos=True)


def live_buffers() -> dict:
    gc.collect()  # garbage from earlier tests must not be freed mid-measurement
    return live_device_buffers()


def live_bytes():
    return sum(live_buffers().values())


def test_drop_and_rebuild_free_and_restore_exactly_the_kv_bytes(worker):
    reference = greedy(worker)
    shape, dtype, layers = worker.engine.testing.kv_buffer_spec()
    # Each layer's buffer is split over the engine's 'tensor' axis (and would be replicated over
    # any other devices of its mesh).
    replicas = len(worker.engine.devices) // worker.config.tp_size
    kv_size = int(np.prod(shape)) * dtype.itemsize * layers * replicas
    assert worker.memory().kv_bytes == kv_size
    before = live_bytes()
    dropped = worker.drop_kv()
    assert dropped.bytes == kv_size and dropped.buffers == layers
    # Right after a generate the CPU backend may still hold the previous step's KV arrays.
    # Measured without a GC pass, as drop_kv measures (a pass here could also free unrelated
    # garbage made meanwhile).
    assert before - live_device_bytes() == kv_size + dropped.transient_bytes
    assert worker.memory().kv_bytes == 0
    assert worker.drop_kv().bytes == 0
    # By buffer, not by total: arrays of earlier tests that only the engines' threads still
    # held may be freed meanwhile (a rebuild runs on the scheduler thread).
    settled = live_buffers()
    # The first rebuild too: it runs inside the generate call that follows a drop.
    with counting_compiles() as compiles:
        rebuilt = worker.rebuild_kv()
    assert rebuilt.bytes == kv_size and compiles.value == 0
    new = {key: nbytes for key, nbytes in live_buffers().items() if key not in settled}
    assert sum(new.values()) == kv_size
    assert worker.drop_kv().bytes == kv_size
    assert not new.keys() & live_buffers().keys(), "the drop freed exactly what the rebuild made"
    worker.rebuild_kv()
    for buffer in worker.engine.kv_buffers():
        assert buffer.shape == shape and buffer.dtype == dtype
    again = greedy(worker)
    assert again.completions == reference.completions
    assert again.compiles == 0


def test_memory_read_while_forwards_donate_the_kv_buffers(worker):
    """memory() from another thread than the engine's, whose every forward donates the KV
    buffers: the KV bytes are the pool's each time (a read of a donated buffer was an error)."""
    kv_size = worker.memory().kv_bytes
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(worker.generate, PROMPTS * 8, temperature=1.0, max_new_tokens=48, ignore_eos=True)
        reads = 0
        while not running.done() or reads == 0:
            assert worker.memory().kv_bytes == kv_size
            reads += 1
        running.result()


def test_generate_while_dropped_rebuilds_first(worker):
    reference = greedy(worker)
    worker.drop_kv()
    batch = greedy(worker)
    assert not worker.kv_dropped
    assert batch.completions == reference.completions and batch.compiles == 0


def test_a_held_drop_refuses_generate_until_rebuilt(worker):
    """drop_kv(hold=reason) (a server's /admin/drop_kv): the cache stays dropped, generate is a
    WorkerUnavailable with the reason, a train step's release keeps the hold, rebuild_kv lifts it."""
    reference = greedy(worker)
    for bad in ("", "  ", 5):  # "" held nothing, 5 was taken as the reason
        with pytest.raises(InvalidRequest, match="hold must be a non-empty string"):
            worker.drop_kv(hold=bad)
    assert not worker.kv_dropped
    worker.drop_kv(hold="held for the test")
    try:
        assert worker.unavailable_reason == "held for the test"
        with pytest.raises(WorkerUnavailable, match="held for the test"):
            greedy(worker)
        assert worker.kv_dropped
    finally:
        assert worker.rebuild_kv().bytes > 0
    assert worker.unavailable_reason is None
    assert greedy(worker).completions == reference.completions


def test_a_call_waiting_to_start_when_a_held_drop_lands_is_refused(worker):
    """The server's race: a request that found the cache present, then waited at the gate behind
    the drop (a stream holds it), must be refused once the drop lands, not rebuild the cache."""

    async def scenario():
        stream = worker.astream(PROMPTS[:1], temperature=0.0, max_new_tokens=4, ignore_eos=True)
        await anext(stream)  # admitted: the drop waits for it
        drop = asyncio.create_task(asyncio.to_thread(worker.drop_kv, hold="held for the test"))
        while worker.unavailable_reason != "the KV cache is being dropped":
            await asyncio.sleep(0.001)
        waiting = asyncio.create_task(worker.agenerate(PROMPTS, temperature=0.0, max_new_tokens=2))
        await asyncio.sleep(0)  # it finds the cache present and waits at the gate
        assert not worker.kv_dropped and not waiting.done()
        async for _ in stream:
            pass
        await drop
        with pytest.raises(WorkerUnavailable, match="held for the test"):
            await waiting

    try:
        asyncio.run(scenario())
        assert worker.kv_dropped
    finally:
        worker.rebuild_kv()


def test_train_step_context_releases_trainer_buffers_and_requires_a_sync(worker, qwen2_dir):
    params = jax.device_put(load_hf_params(qwen2_dir), worker.param_shardings())
    report = worker.sync_params(params)
    assert report.leaves_aliased > 0
    reference = greedy(worker)
    trainer_leaves = {id(leaf) for leaf in jax.tree_util.tree_leaves(params)}
    assert any(id(leaf) in trainer_leaves for leaf in worker.engine.weight_leaves())

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(p):
        return jax.tree_util.tree_map(lambda x: x * 1.0, p)

    with worker.released_for_training() as dropped:
        assert dropped.bytes > 0 and worker.kv_dropped
        # The engine holds none of the trainer's arrays: the train step owns them.
        assert not any(id(leaf) in trainer_leaves for leaf in worker.engine.weight_leaves())
        # A call meanwhile (another thread's) is refused without taking the KV cache back.
        with pytest.raises(WorkerUnavailable, match="train step ran since the last sync_params"):
            greedy(worker)
        with pytest.raises(WorkerUnavailable, match="train step ran since the last sync_params"):
            worker.rebuild_kv()  # an explicit one (/admin/rebuild_kv) too
        assert worker.kv_dropped and worker.memory().kv_bytes == 0
        new_params = train_step(params)
    with pytest.raises(RuntimeError, match="train step ran since the last sync_params"):
        greedy(worker)
    worker.sync_params(new_params)
    assert greedy(worker).completions == reference.completions


def test_repeated_cycles_do_not_leak(worker, qwen2_dir):
    """drop -> (train) -> sync -> generate, 20 times: live device bytes and RSS stay flat."""
    params = load_hf_params(qwen2_dir)
    worker.sync_params(params)
    reference = greedy(worker).completions
    kv_bytes = worker.memory().kv_bytes
    live, rss = [], []
    process = psutil.Process()
    for _ in range(20):
        with worker.released_for_training() as dropped:
            live.append(live_bytes())
            rss.append(process.memory_info().rss)
        assert dropped.bytes == kv_bytes
        worker.sync_params(params)
        batch = greedy(worker)
        assert batch.completions == reference and batch.compiles == 0
    assert live[5:] == [live[5]] * 15, "live device bytes while dropped must not grow"
    # Allocator noise aside, RSS must not grow with the number of cycles.
    assert rss[-1] - rss[5] < 32 * 2**20, f"RSS grew by {(rss[-1] - rss[5]) / 2**20:.1f} MiB over 15 cycles"
