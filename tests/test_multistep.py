"""Several decode steps per dispatch (EngineOptions.decode_steps, rollout/engine/multistep.py):
the same tokens, log-probs and versions as one step per dispatch, with every scheduler decision
(finish, stop, abort, in-flight swap) still landing at its step."""

import asyncio
import re
import threading
import weakref

import jax
import numpy as np
import pytest

from rollout import RolloutWorker
from rollout.engine import EngineError, EngineHandle, multistep, patches, profile_steps, stubbed_device
from rollout.engine.programs import engine_compiler_options, forward_cells
from rollout.errors import WorkerUnavailable
from tests.helpers import donated_during, perturbed_params, swap_at_token, tiny_options, tiny_worker_config
from trainer_bridge import load_hf_params

STEPS = 4
LOGS = {"return_logprobs": True}
PROMPTS = [[5, 17, 42, 8], [9, 3], [100, 101, 102, 103, 104, 105, 7], [12]]


def _config(qwen2_dir, **overrides):
    # Shapes compiled at start-up (the chunk's loop included): one decode and one prefill bucket
    # (tiny_worker_config's), so both workers run every batch at the same padded shapes.
    return tiny_worker_config(qwen2_dir, precompile=True, **overrides)


# A batch of each of the sampler's draws (rollout/engine/patches.py: one program each).
DRAWS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=1.0, seed=1),
    "filtered": dict(temperature=1.0, top_p=0.9, seed=1),
}


@pytest.fixture(scope="module")
def plain_and_its_first_compiles(qwen2_dir):
    """The worker, what a batch of each draw compiles right after start-up, and whether each
    forward of its start-up's precompile came with penalties."""
    from sgl_jax.srt.managers.tp_worker import ModelWorker

    forward = ModelWorker.forward_batch_generation
    penalized = []

    def recording(self, batch, *args, **kwargs):
        metadata = args[2] if len(args) > 2 else kwargs.get("sampling_metadata")
        penalized.append(bool(metadata is not None and metadata.do_penalties))
        return forward(self, batch, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelWorker, "forward_batch_generation", recording)
        w = RolloutWorker(_config(qwen2_dir))
    with w:
        first = {
            name: w.generate(PROMPTS, max_new_tokens=3, ignore_eos=True, **kw).compiles for name, kw in DRAWS.items()
        }
        yield w, first, penalized


@pytest.fixture(scope="module")
def plain(plain_and_its_first_compiles):
    return plain_and_its_first_compiles[0]


def test_a_precompiled_engine_compiles_nothing_for_any_draw(plain_and_its_first_compiles):
    """The precompile's made-up batches filter (top-k, top-p, min-p); it compiles the greedy and
    the unfiltered draw's programs too, for the same batch sizes. It compiles no sampler for
    penalties, which no sampler applies (0.0.2 precompiled one per draw and batch size)."""
    _, first, penalized = plain_and_its_first_compiles
    assert first == dict.fromkeys(DRAWS, 0)
    assert penalized and not any(penalized), penalized


@pytest.fixture(scope="module")
def chunked(qwen2_dir):
    # Static chunks, a GPU's by default (EngineOptions.static_decode_chunks); the paged and the
    # small-pool engines below run the CPU's default, the walk and draw chosen on the device.
    with RolloutWorker(_config(qwen2_dir, decode_steps=STEPS, static_decode_chunks=True)) as w:
        yield w


def _calls(worker, stop_token):
    """Concurrent calls whose rows end mid-chunk: different lengths, a stop token, sampled and
    greedy rows, seeded."""

    async def run():
        return await asyncio.gather(
            worker.agenerate(PROMPTS, n=2, temperature=1.0, max_new_tokens=11, ignore_eos=True, seed=3, **LOGS),
            worker.agenerate(PROMPTS[:2], temperature=0.0, max_new_tokens=6, ignore_eos=True, **LOGS),
            worker.agenerate(
                PROMPTS[2:],
                n=3,
                temperature=0.8,
                top_p=0.9,
                max_new_tokens=19,
                seed=5,
                stop_token_ids=[stop_token],
                **LOGS,
            ),
        )

    return asyncio.run(run())


def _same(a, b):
    assert a.completions == b.completions and a.finish_reasons == b.finish_reasons
    # Versions from each call's first: the workers' counts differ once one synced alone.
    np.testing.assert_array_equal(_from_start(a), _from_start(b))
    np.testing.assert_array_equal(a.kept_counts, b.kept_counts)
    np.testing.assert_allclose(np.nan_to_num(a.logprobs), np.nan_to_num(b.logprobs), atol=1e-5)


def _from_start(batch) -> np.ndarray:
    return np.where(batch.completion_mask, batch.token_versions - batch.weight_version, batch.token_versions)


def test_chunks_sample_what_one_step_at_a_time_samples(plain, chunked):
    # A token the sampled rows draw early: some rows stop on it mid-chunk.
    probe = plain.generate(PROMPTS[2:], n=3, temperature=0.8, top_p=0.9, max_new_tokens=19, seed=5)
    stop_token = probe.completions[0][5]
    before = chunked.engine.decode_chunk_stats
    expected, got = _calls(plain, stop_token), _calls(chunked, stop_token)
    for a, b in zip(expected, got):
        _same(a, b)
    assert "stop" in got[2].finish_reasons and min(len(c) for c in got[2].completions) < 19
    after = chunked.engine.decode_chunk_stats
    assert after.dispatched > before.dispatched and after.steps_served > before.steps_served
    # Rows that ended before their chunk did: computed steps thrown away, their slots freed.
    assert after.row_steps_discarded > before.row_steps_discarded
    assert chunked.engine.testing.kv_tokens_held() == 0
    assert plain.engine.decode_chunk_stats is None


def test_a_call_arriving_mid_chunk_joins_when_the_chunks_run_out(plain, chunked, monkeypatch):
    """A call whose requests arrive while the chunks compute the running rows' next steps waits
    for those steps to be served, then joins in one prefill: its admission no longer ends the
    chunks, throwing away what the device computed (multi-turn episodes, whose turns arrive
    while others decode, ran x1.7 slower with chunks than without). Both calls sample what one
    step at a time samples."""
    first = dict(temperature=1.0, max_new_tokens=4 * STEPS, ignore_eos=True, seed=3, **LOGS)
    second = dict(n=2, temperature=1.0, max_new_tokens=STEPS + 3, ignore_eos=True, seed=4, **LOGS)
    expected = plain.generate(PROMPTS, **first), plain.generate(PROMPTS[:2], **second)
    mid_chunk, events = threading.Event(), []
    serve, release = multistep.DecodeChunks.serve, multistep.DecodeChunks.release

    def serving(self, batch):
        if self.chunk.next_step == 1 and not mid_chunk.is_set():
            mid_chunk.set()
            # Held until the second call's requests can be read: the scheduler receives them
            # at its next step, the chunk's third of four.
            self.scheduler.recv_from_tokenizer.poll(300_000)
        events.append(("served with requests waiting", len(self.scheduler.waiting_queue)))
        return serve(self, batch)

    def releasing(self):
        events.extend(("unserved steps released", c.steps - c.next_step) for c in (self.chunk, self.ahead) if c)
        return release(self)

    monkeypatch.setattr(multistep.DecodeChunks, "serve", serving)
    monkeypatch.setattr(multistep.DecodeChunks, "release", releasing)
    results = {}
    running = threading.Thread(target=lambda: results.update(first=chunked.generate(PROMPTS, **first)))
    running.start()
    assert mid_chunk.wait(300)
    got = chunked.generate(PROMPTS[:2], **second)
    running.join(300)
    for a, b in zip(expected, (results["first"], got)):
        _same(a, b)
    assert any(name == "served with requests waiting" and count for name, count in events)
    assert not [event for event in events if event[0] == "unserved steps released" and event[1]]
    assert chunked.engine.testing.kv_tokens_held() == 0


@pytest.mark.parametrize("recompute_kv", [True, False], ids=["recompute-kv", "keep-kv"])
def test_an_in_flight_swap_lands_at_its_step_inside_a_chunk(plain, chunked, qwen2_dir, recompute_kv):
    """Either kind of swap: the KV of the tokens before it recomputed with the new weights, or
    kept as the old weights wrote it."""
    params = load_hf_params(qwen2_dir)
    new_params = perturbed_params(params)
    swap_at = STEPS + 2  # the second chunk's third step

    def greedy(worker, prompt, n):
        return worker.generate([prompt], temperature=0.0, max_new_tokens=n, ignore_eos=True, **LOGS)

    results = []
    for worker in (plain, chunked):
        worker.sync_params(params)
        version = worker.weight_version
        batch, _ = swap_at_token(
            worker, new_params, swap_at, lambda w=worker: greedy(w, PROMPTS[0], 16), recompute_kv=recompute_kv
        )
        start = batch.prompt_width
        versions = batch.token_versions[0, start : start + 16] - version
        assert versions.tolist() == [0] * swap_at + [1] * (16 - swap_at)
        results.append(batch)
        worker.sync_params(params)
    _same(*results)
    assert chunked.engine.testing.kv_tokens_held() == 0


def test_a_cancelled_call_leaves_no_slot_of_its_chunks(chunked):
    engine = chunked.engine

    async def cancelled() -> int:
        stream = chunked.astream([PROMPTS[0]], max_new_tokens=200, ignore_eos=True)
        async for _ in stream:  # the first tokens: the call's first chunk ran
            break
        start = engine.forward_count
        await stream.aclose()
        return start

    start = asyncio.run(cancelled())
    assert engine.testing.kv_tokens_held() == 0
    # Abandoned steps: those already served when the abort reached the scheduler, then the
    # abort lands at the next step boundary as it does without chunks.
    assert engine.forward_count - start < 200 // 4
    assert chunked.generate([PROMPTS[1]], max_new_tokens=5, ignore_eos=True).completions[0]


def test_weights_donated_under_a_chunk_fail_its_call_and_the_next_sync_serves_again(chunked, qwen2_dir):
    """The chunk dispatched ahead finds the weights freed (a train step donated them outside
    released_for_training): the call fails saying so, no slot is left, and a sync serves again."""
    params = jax.device_put(load_hf_params(qwen2_dir), chunked.param_shardings())
    engine = chunked.engine
    try:
        chunked.sync_params(params)
        expected = chunked.generate(PROMPTS, max_new_tokens=STEPS + 2, temperature=0.0, ignore_eos=True)
        dispatched = engine.decode_chunk_stats.dispatched
        stepped, error = donated_during(
            lambda: chunked.generate(PROMPTS, n=2, max_new_tokens=200, ignore_eos=True),
            # This call's chunks run: the next one, dispatched ahead, meets the freed weights.
            lambda: engine.decode_chunk_stats.dispatched > dispatched,
            params,
        )
        assert isinstance(error, WorkerUnavailable) and "freed while it ran" in str(error)
        assert engine.alive and engine.testing.kv_tokens_held() == 0 and engine.testing.requests_remembered() == 0
        chunked.sync_params(stepped)
        again = chunked.generate(PROMPTS, max_new_tokens=STEPS + 2, temperature=0.0, ignore_eos=True)
        assert again.completions == expected.completions
    finally:
        chunked.sync_params(load_hf_params(qwen2_dir))


def test_the_engines_programs_are_jitted_under_the_engine_compile_options(chunked):
    """Workaround gpu-dot-merger's wiring: the forward the engine calls and the decode chunk are
    jitted under ``engine_compiler_options`` of their devices (none on a CPU; on a GPU the option
    that keeps XLA from merging sibling dots, tests/unit/test_patches.py), and the engine still
    compiles nothing in steady state."""
    runner = chunked.engine.testing.model_runner
    forward = forward_cells(runner)["jitted_run_model"].cell_contents
    assert getattr(forward, "compiler_options", None) == engine_compiler_options("cpu") == {}
    assert multistep.chunk_program("cpu").compiler_options == {}
    assert engine_compiler_options("gpu") == {"xla_gpu_dot_merger_threshold_mb": 0}
    chunked.generate(PROMPTS, max_new_tokens=STEPS + 1, temperature=0.0, ignore_eos=True)
    again = chunked.generate(PROMPTS, max_new_tokens=STEPS + 1, temperature=0.0, ignore_eos=True)
    assert again.compiles == 0


def test_precompiled_chunks_compile_nothing(chunked):
    out = chunked.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=9, ignore_eos=True, seed=1)
    assert out.compiles == 0
    assert chunked.engine.decode_chunk_stats.dispatched > 0


def test_rows_growing_past_a_kv_walk_sample_the_same_and_compile_nothing(plain, chunked, monkeypatch):
    """Rows that pass 128 keys (a decode KV chunk) mid-call, inside a chunk (the longest row
    decodes from 123 keys, 4 steps a chunk): from that chunk on they walk two KV chunks, a
    static count from the rows' lengths at the chunk's last step (attention.decode_kv_walk),
    compiled at start-up like the first walk; a walk too short for a row drops its last keys."""
    walks = []
    run_chunk = multistep.run_chunk

    def recording(worker, mwb, metadata, plan, max_steps, kv_walk, first_ids=None):
        walks.append(kv_walk)
        return run_chunk(worker, mwb, metadata, plan, max_steps, kv_walk, first_ids)

    monkeypatch.setattr(multistep, "run_chunk", recording)
    prompts = [list(range(1, 123)), list(range(3, 115))]
    kwargs = dict(n=2, temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=7, **LOGS)
    expected, got = plain.generate(prompts, **kwargs), chunked.generate(prompts, **kwargs)
    _same(expected, got)
    assert got.compiles == 0
    assert walks[0] == 1 and walks[-1] == 2


@pytest.mark.parametrize("draw", ["greedy", "sampled"])
def test_a_chunks_only_loop_of_unknown_trip_count_is_its_steps_and_it_has_no_conditional(chunked, monkeypatch, draw):
    """What a GPU runs without waiting for the host: XLA's GPU backend copies the predicate of a
    loop of unknown trip count, and the branch index of a conditional, to the host and waits,
    at every iteration. In a static chunk's program (a GPU's by default, compiled for the CPU
    here) the attention's loops have known trip counts (its KV walk), the draw is the batch's,
    and there is no penalties' conditional. (A filtering draw keeps the shared filters'
    conditionals.)"""
    calls = []
    program = multistep.chunk_program

    def recording(platform):
        def call(*args, **kwargs):
            calls.append((args, kwargs))
            return program(platform)(*args, **kwargs)

        return call

    monkeypatch.setattr(multistep, "chunk_program", recording)
    chunked.generate(PROMPTS[:1], max_new_tokens=STEPS + 1, ignore_eos=True, **DRAWS[draw])
    (args, kwargs), *_ = calls

    def spec(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x

    args, kwargs = jax.tree.map(spec, (args, kwargs))
    text = program("cpu").lower(*args, **kwargs).compile().as_text()
    unknown = [loop for loop in re.findall(r".* while\(.*", text) if "known_trip_count" not in loop]
    assert len(unknown) == 1 and 'op_name="jit(_decode_chunk)/while"' in unknown[0]  # the steps' loop
    assert " conditional(" not in text


@pytest.mark.parametrize("draw", ["greedy", "sampled"])
def test_a_one_step_draw_has_no_conditional(plain, monkeypatch, draw):
    """The one-step path's draw is chosen on the host: its program has no conditional, which a
    GPU would wait on the host for at every step."""
    calls = []
    jitted = patches._jitted_draw

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return jitted(*args, **kwargs)

    monkeypatch.setattr(patches, "_jitted_draw", recording)
    plain.generate(PROMPTS[:1], max_new_tokens=2, ignore_eos=True, **DRAWS[draw])
    args, kwargs = calls[-1]
    assert kwargs["draw"] == {"greedy": "greedy", "sampled": "sample"}[draw]
    text = jitted.lower(*args, **kwargs).compile().as_text()
    assert " conditional(" not in text


def test_the_kv_buffers_a_chunk_consumes_live_until_it_is_fetched(chunked, monkeypatch):
    """At jax 0.8 the thread dropping the last reference to an array donated to a computation
    still running waits for that computation: had the pool's buffers died as a chunk's loop
    took them over, dispatching the chunk ahead would wait for the chunk being served, and the
    host's work between chunks would no longer overlap the device's. (At jax 0.12 dropping
    them does not wait; held, they cost no memory either way: the loop's outputs reuse them.)"""
    consumed = {}  # id of a chunk's sampled ids on the device -> weak references to its inputs
    alive_at_fetch = []
    run_chunk, fetch = multistep.run_chunk, multistep.DecodeChunk.fetch

    def recording_run(worker, *args, **kwargs):
        pool = [weakref.ref(buffer) for buffer in worker.model_runner.token_to_kv_pool.kv_buffer]
        outputs, misses = run_chunk(worker, *args, **kwargs)
        consumed[id(outputs[0])] = pool
        return outputs, misses

    def checking_fetch(chunk):
        if chunk.pending is not None:
            alive_at_fetch.append(all(ref() is not None for ref in consumed.pop(id(chunk.pending[0]))))
        fetch(chunk)

    monkeypatch.setattr(multistep, "run_chunk", recording_run)
    monkeypatch.setattr(multistep.DecodeChunk, "fetch", checking_fetch)
    chunked.generate(PROMPTS, temperature=1.0, max_new_tokens=3 * STEPS + 1, ignore_eos=True, seed=2)
    assert alive_at_fetch == [True] * 3  # the first chunk, then two dispatched ahead


def test_a_stubbed_device_serves_each_chunk_shapes_first_outputs(chunked):
    kwargs = dict(temperature=0.0, max_new_tokens=2 * STEPS + 1, ignore_eos=True)
    real = chunked.generate(PROMPTS, **kwargs).completions
    others = [[token + 1 for token in prompt] for prompt in PROMPTS]
    dispatched = chunked.engine.decode_chunk_stats.dispatched
    with stubbed_device():
        first = chunked.generate(PROMPTS, **kwargs).completions
        second = chunked.generate(others, **kwargs).completions
    # Each call: its prefill's token, then two chunks of the same shape. The first chunk of that
    # shape runs; every later one returns its outputs, whatever the prompts.
    assert [c[: 1 + STEPS] for c in first] == [c[: 1 + STEPS] for c in real]
    assert [c[1 + STEPS :] for c in first] == [c[1 : 1 + STEPS] for c in real] != [c[1 + STEPS :] for c in real]
    assert [c[1:] for c in second] == [c[1:] for c in first]
    assert [c[0] for c in second] != [c[0] for c in real]
    assert chunked.engine.decode_chunk_stats.dispatched == dispatched + 4
    assert chunked.generate(PROMPTS, **kwargs).completions == real


def test_profile_steps_times_each_chunk_as_its_steps(chunked):
    """A chunk is one profiled decode step of its count of steps, timed to its outputs."""
    with profile_steps() as times:
        chunked.generate(PROMPTS, temperature=1.0, max_new_tokens=2 * STEPS + 1, ignore_eos=True, seed=3)
    chunks = [step for step in times.steps if step.mode == "decode"]
    assert [step.steps for step in chunks] == [STEPS, STEPS]
    assert all(step.forward_s > 0 for step in chunks)


def test_an_engine_that_cannot_chunk_is_refused_before_it_starts(qwen2_dir):
    # The unit layer checks each reason (tests/unit/test_engine_handle.py).
    with pytest.raises(EngineError, match="record_routing off"):
        EngineHandle(tiny_options(qwen2_dir, decode_steps=STEPS, record_routing=True))


def test_chunks_on_a_paged_pool_free_the_pages_they_do_not_use(plain, qwen2_dir):
    config = _config(qwen2_dir, decode_steps=STEPS, page_size=4)
    with RolloutWorker(config) as paged:
        probe = plain.generate(PROMPTS[2:], n=3, temperature=0.8, top_p=0.9, max_new_tokens=19, seed=5)
        stop_token = probe.completions[0][5]
        for a, b in zip(_calls(plain, stop_token), _calls(paged, stop_token)):
            assert a.completions == b.completions
            np.testing.assert_allclose(np.nan_to_num(a.logprobs), np.nan_to_num(b.logprobs), atol=1e-4)
        assert paged.engine.decode_chunk_stats.row_steps_discarded > 0
        assert paged.engine.testing.kv_tokens_held() == 0


def test_a_session_pins_the_same_prefix_with_chunks(plain, chunked):
    """A session's turn finishing inside a chunk pins exactly its tokens (prompt and completion
    but the last): the chunk's slots past them are freed, the pin's are the radix cache's."""
    first = [10 + i for i in range(30)]
    results = []
    for worker in (plain, chunked):
        turn = worker.generate([first], max_new_tokens=7, ignore_eos=True, seed=1, session="s")
        following = first + turn.completions[0] + [5, 6, 7]
        second = worker.generate([following], max_new_tokens=9, ignore_eos=True, seed=2, session="s")
        (stats,) = worker.session_stats()
        results.append((turn.completions, second.completions, second.cached_tokens.tolist(), stats.pinned_tokens))
        assert worker.release_session("s")
        worker.engine.testing.flush_prefix_cache()
        assert worker.engine.testing.kv_tokens_held() == 0
    assert results[0] == results[1] and results[1][2] == [30 + 7 - 1]


def test_chunks_on_a_pool_smaller_than_the_batch_return_every_row_whole(qwen2_dir):
    """6 rows x (20 + 80) tokens on a 128-token pool: the engine queues and retracts rows, and a
    chunk takes the slots the pool has left (shorter chunks, or one step at a time); every row
    ends whole, and no slot is held afterwards."""
    with RolloutWorker(tiny_worker_config(qwen2_dir, max_total_tokens=128, decode_steps=STEPS)) as small:
        prompts = [list(range(10 + i, 30 + i)) for i in range(3)]
        batch = small.generate(prompts, n=2, temperature=1.0, max_new_tokens=80, ignore_eos=True, seed=5)
        assert [len(c) for c in batch.completions] == [80] * 6
        assert batch.finish_reasons == ["length"] * 6
        assert small.engine.decode_chunk_stats.steps_served > 0
        assert small.engine.testing.kv_tokens_held() == 0
