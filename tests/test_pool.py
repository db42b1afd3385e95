"""Several engines behind one worker (dp_size): one API, same samples as one engine, zero-copy
syncs on every engine, KV and failures per engine."""

import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rollout import EngineError, RolloutWorker, SamplingParams
from tests.helpers import tiny_worker_config
from trainer_bridge import SyncError, flatten_params, load_hf_params

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11], [30, 31], [60, 61, 62], [7]]
SAMPLED = dict(n=3, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=2024)
GREEDY = dict(temperature=0.0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def params(qwen2_dir):
    return load_hf_params(qwen2_dir)


@pytest.fixture(scope="module")
def single(qwen2_dir, params):
    with RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy")) as w:
        w.sync_params(params)
        yield w


@pytest.fixture(scope="module")
def dp4(qwen2_dir):
    with RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy", dp_size=4)) as w:
        yield w


@pytest.fixture(scope="module")
def dp2tp2(qwen2_dir):
    with RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy", dp_size=2, tp_size=2)) as w:
        yield w


def _shard_pointers(array):
    return {s.device.id: s.data.unsafe_buffer_pointer() for s in array.addressable_shards}


@pytest.mark.parametrize("name", ["dp4", "dp2tp2"])
def test_same_seed_same_completions_as_one_engine(request, name, single, params):
    worker = request.getfixturevalue(name)
    report = worker.sync_params(jax.device_put(params, worker.param_shardings()))
    assert len(report.per_engine) == len(worker.engines)
    expected = single.generate(PROMPTS, **SAMPLED)
    batch = worker.generate(PROMPTS, **SAMPLED)
    assert batch.completions == expected.completions
    np.testing.assert_array_equal(batch.seeds, expected.seeds)
    np.testing.assert_array_equal(batch.prompt_index, expected.prompt_index)
    assert worker.generate(PROMPTS, **GREEDY).completions == single.generate(PROMPTS, **GREEDY).completions
    # Every engine got work: rows were split over the engines.
    assert all(engine.forward_count > 0 for engine in worker.engines)


def test_replicated_tree_is_aliased_by_every_engine(dp4, params):
    tree = jax.device_put(params, dp4.param_shardings())
    report = dp4.sync_params(tree)
    assert report.bytes_copied == 0 and [r.bytes_copied for r in report.per_engine] == [0, 0, 0, 0]
    flat = flatten_params(tree)
    for engine in dp4.engines:
        leaves = engine.weight_leaves()
        (device,) = engine.devices
        for m in dp4.mappings:
            index = next(leaf.index for leaf in dp4.leaves if leaf.path == m.engine)
            served = _shard_pointers(leaves[index])
            assert served == {device.id: _shard_pointers(flat[m.trainer])[device.id]}, m.trainer


def test_tree_sharded_over_all_devices_is_gathered_per_engine(dp2tp2, params, single):
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    flat = flatten_params(params)
    sharded = {
        path: jax.device_put(x, NamedSharding(mesh, P("fsdp") if x.shape[0] % 4 == 0 else P()))
        for path, x in flat.items()
    }
    report = dp2tp2.sync_params(sharded)
    per_engine = [r.bytes_copied for r in report.per_engine]
    assert len(per_engine) == 2 and all(b > 0 for b in per_engine) and report.bytes_copied == sum(per_engine)
    assert dp2tp2.generate(PROMPTS, **GREEDY).completions == single.generate(PROMPTS, **GREEDY).completions


def test_kv_drop_frees_every_engines_pool(dp4, params):
    dp4.sync_params(jax.device_put(params, dp4.param_shardings()))
    before = dp4.memory()
    assert len(before.engines) == 4 and all(e.kv_bytes > 0 for e in before.engines)
    report = dp4.drop_kv()
    assert report.bytes == sum(e.kv_bytes for e in before.engines)
    after = dp4.memory()
    assert [e.kv_bytes for e in after.engines] == [0, 0, 0, 0]
    for engine_before in before.engines:
        (device,) = engine_before.devices
        freed = before.live_bytes_per_device[device] - after.live_bytes_per_device[device]
        assert freed >= engine_before.kv_bytes, (device, freed)
    rebuilt = dp4.rebuild_kv()
    assert rebuilt.bytes == report.bytes
    assert dp4.generate(PROMPTS[:2], **GREEDY).compiles == 0


def test_orbax_checkpoint_is_restored_once_and_aliased_by_every_engine(dp4, params, single, tmp_path):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", params)
    checkpointer.wait_until_finished()
    dp4.sync_params(jax.tree_util.tree_map(lambda x: x * 0.5, params))
    report = dp4.load_checkpoint(tmp_path / "ckpt")
    assert report.bytes_copied == 0 and all(r.leaves_copied == 0 for r in report.per_engine)
    assert dp4.generate(PROMPTS, **GREEDY).completions == single.generate(PROMPTS, **GREEDY).completions


@pytest.mark.parametrize("failed", [0, 1])
def test_a_failed_engine_is_named_and_the_others_serve_on(qwen2_dir, params, single, failed):
    before = set(threading.enumerate())
    worker = RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy", dp_size=2))
    try:
        worker.sync_params(jax.device_put(params, worker.param_shardings()))
        device = str(worker.engines[failed].devices[0])
        held = worker.memory()
        worker.engines[failed].testing.inject_failure(RuntimeError("injected forward failure"))
        with pytest.raises(EngineError, match=rf"engine {failed} \(devices {failed}\).*injected forward failure"):
            worker.generate(PROMPTS, **GREEDY)
        # The live engine takes every row from now on (the first one's facts still read), and
        # weight changes reach it.
        assert worker.generate(PROMPTS, **GREEDY).completions == single.generate(PROMPTS, **GREEDY).completions
        report = worker.sync_params(params)
        assert report.version == 2 and report.per_engine[failed] is None
        assert report.per_engine[1 - failed].leaves_copied > 0
        # The next KV drop frees the failed engine's pool too, for the trainer on its devices.
        with worker.released_for_training() as dropped:
            assert dropped.bytes == held.kv_bytes  # both engines' pools
            after = worker.memory()
        assert after.engines[failed].kv_bytes == 0
        assert all(buffer.is_deleted() for buffer in worker.engines[failed].kv_buffers())
        # (Device 0 is also jax's default device: the calls meanwhile left a few KB there.)
        kv_bytes = held.engines[failed].kv_bytes
        assert held.live_bytes_per_device[device] - after.live_bytes_per_device[device] > 0.9 * kv_bytes > 0
        # With no engine left, a drop still frees what the last one holds, then says it failed
        # (it once raised first, freeing nothing, and the next drop reported success).
        worker.sync_params(params)
        last = worker.engines[1 - failed]
        last.testing.inject_failure(RuntimeError("the last engine failed"))
        with pytest.raises(EngineError, match="the last engine failed"):
            worker.generate(PROMPTS, **GREEDY)
        buffers = last.kv_buffers()  # rebuilt by that generate
        for _ in range(2):
            with pytest.raises(EngineError, match="engine thread failed"):
                worker.drop_kv()
            assert buffers and all(buffer.is_deleted() for buffer in buffers)
    finally:
        worker.close()
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == []


def test_an_engine_failing_during_a_kv_drop_leaves_the_others_dropped_and_serving(qwen2_dir, params, single):
    """An engine that fails after the drop began (its thread died: a leak check, a device
    error) counts as failed: the drop stands for the others, which rebuild and serve at the
    next generate (they once ran their forwards on no KV buffers and failed too)."""
    worker = RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy", dp_size=2))
    try:
        worker.sync_params(params)
        held = worker.memory()
        dying = worker.engines[1]
        drop = dying.drop_kv_buffers

        def fails_first():
            dying.testing.inject_failure(RuntimeError("failed during the KV drop"))
            with pytest.raises(EngineError, match="failed during the KV drop"):
                dying.generate([[5, 17]], SamplingParams(max_new_tokens=1), np.zeros((1, 1), np.int64))
            return drop()

        dying.drop_kv_buffers = fails_first
        dropped = worker.drop_kv()
        assert dropped.bytes == held.kv_bytes  # engine 0's drop, engine 1's pool freed as failed
        assert all(buffer.is_deleted() for buffer in dying.kv_buffers())
        assert worker.generate(PROMPTS, **GREEDY).completions == single.generate(PROMPTS, **GREEDY).completions
    finally:
        worker.close()


def test_an_engine_failing_between_a_syncs_prepare_and_commit_leaves_the_others_on_the_new_weights(
    qwen2_dir, params, single
):
    """The sync skips it, as later calls skip a failed engine: the worker reports the version
    the others serve (it once raised with engine 0 already serving version N+1 and the worker
    reporting N)."""
    worker = RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy", dp_size=2))
    try:
        dying = worker.engines[1]
        replace = dying.replace_weight_leaves

        def fails_first(*args, **kwargs):
            dying.testing.inject_failure(RuntimeError("failed before its swap"))
            with pytest.raises(EngineError, match="failed before its swap"):
                dying.generate([[5, 17]], SamplingParams(max_new_tokens=1), np.zeros((1, 1), np.int64))
            return replace(*args, **kwargs)

        dying.replace_weight_leaves = fails_first
        report = worker.sync_params(params)
        assert report.version == worker.weight_version == 1 and report.per_engine[1] is None
        batch = worker.generate(PROMPTS, **GREEDY)
        assert (batch.token_versions[batch.completion_mask] == 1).all() and batch.weight_version == 1
        assert batch.completions == single.generate(PROMPTS, **GREEDY).completions
    finally:
        worker.close()


def test_an_engine_failing_after_its_swap_is_failed_and_the_trainers_arrays_survive(qwen2_dir, params, single):
    """A failure once an engine's new leaves serve (here its prefix cache's flush) leaves its KV
    state the old weights': the engine is failed, the others serve the new version, and the
    arrays it aliased stay the trainer's (its record of what it owns was lost with the failure,
    and the next KV drop, which frees a failed engine's own arrays, deleted the trainer's)."""
    worker = RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy", dp_size=2))
    try:
        # A replacement whose layout engine 1 refuses swaps on no engine.
        leaves = [engine.weight_leaves() for engine in worker.engines]
        index = next(i for i, leaf in enumerate(leaves[0]) if leaf.dtype == np.float32)
        wrong = jax.device_put(leaves[1][index].astype(np.float16), leaves[1][index].sharding)
        with pytest.raises(SyncError, match="would change from"):
            worker._replace_engine_leaves([{index: leaves[0][index] + 1}, {index: wrong}], "test")
        assert worker.engines[0].weight_leaves()[index] is leaves[0][index] and worker.weight_version == 0

        worker.sync_params(params)  # host arrays: every leaf copied, the engines' own
        placed = jax.device_put(params, worker.param_shardings())
        dying = worker.engines[1]
        dying.testing.fail_next_flush(RuntimeError("flush failed"))
        report = worker.sync_params(placed)
        assert report.version == worker.weight_version == 2 and report.per_engine[1] is None
        assert report.per_engine[0].leaves_copied == 0  # engine 0 aliases the trainer's arrays
        assert not dying.alive
        with pytest.raises(EngineError, match="flush failed"):
            dying.check_alive()
        assert dying._control.stopped.wait(60), "a failed engine's scheduler loop ends: nothing reads what is freed"
        worker.drop_kv()  # frees what the failed engine owns
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(placed))
        worker.rebuild_kv()
        batch = worker.generate(PROMPTS, **GREEDY)
        assert batch.weight_version == 2
        assert batch.completions == single.generate(PROMPTS, **GREEDY).completions
    finally:
        worker.close()
