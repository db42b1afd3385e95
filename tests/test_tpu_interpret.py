"""The engine on its TPU attention backend ("fa") on the CPU: its Pallas kernel (ragged paged
attention, which also writes the new tokens' K and V into the pool) interpreted by JAX
(``rollout.engine.tpu_interpret_mode``). Greedy tokens and log-probs equal the native
backend's and the Flax model's, one decode step per dispatch and in decode chunks, after a
sync, a KV drop and rebuild, and across an in-flight swap landing at a fixed token; chunks
sample what single steps sample as rows end inside them (``pytest -k interpret``; what this
proves: docs/platforms.md)."""

import numpy as np
import pytest

from models import CausalLM, DecoderConfig, greedy_decode
from rollout import RolloutWorker
from rollout.engine import multistep, tpu_interpret_mode
from tests.helpers import perturbed_params, swap_at_token, tiny_worker_config
from trainer_bridge import load_hf_params

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11]]
NEW_TOKENS = 8
SWAP_AT = 3


def greedy(worker, prompts=PROMPTS):
    return worker.generate(prompts, temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logprobs=True)


def served(worker, params, new_params) -> list:
    """One worker's greedy batches: after a sync, after a KV drop and rebuild, and across an
    in-flight swap (KV recomputed) that lands when the request holds SWAP_AT tokens."""
    worker.sync_params(params)
    synced = greedy(worker)
    worker.drop_kv()
    worker.rebuild_kv()
    rebuilt = greedy(worker)
    swapped, _ = swap_at_token(worker, new_params, SWAP_AT, lambda: greedy(worker, PROMPTS[:1]), recompute_kv=True)
    return [synced, rebuilt, swapped]


# Each engine of the module: its attention backend and decode steps per dispatch. Decode chunks
# at tp 1 only: an interpreted kernel compiles slowly, inside a chunk's loop the more so.
ENGINES = {"native": ("native", 1), "fa": ("fa", 1), "fa-chunks": ("fa", 4)}
CHUNKS_TP = 1


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def workers(request, qwen2_dir):
    """The module's engines at a tp size, started (and kept) inside the interpret switch."""
    tp_size = request.param
    with tpu_interpret_mode():
        started = {}
        try:
            for name, (backend, steps) in ENGINES.items():
                if steps > 1 and tp_size != CHUNKS_TP:
                    continue
                config = tiny_worker_config(
                    qwen2_dir, load_format="dummy", tp_size=tp_size, attention_backend=backend, decode_steps=steps
                )
                started[name] = RolloutWorker(config)
                assert started[name].engine.attention_backend == backend
            yield started
        finally:
            for worker in started.values():
                worker.close()


def test_the_tpu_attention_backend_in_interpret_mode_serves_what_the_native_one_does(qwen2_dir, workers):
    params = load_hf_params(qwen2_dir)
    new_params = perturbed_params(params)
    runs = {name: served(worker, params, new_params) for name, worker in workers.items()}
    if "fa-chunks" in workers:
        assert workers["fa-chunks"].engine.decode_chunk_stats.steps_served > 0
    for name in runs.keys() - {"native"}:
        for native, fa in zip(runs["native"], runs[name]):
            assert fa.completions == native.completions
            np.testing.assert_allclose(fa.logprobs, native.logprobs, atol=1e-5)
            np.testing.assert_array_equal(fa.token_versions, native.token_versions)
        synced, rebuilt, swapped = runs[name]
        reference = greedy_decode(CausalLM(DecoderConfig.from_hf(qwen2_dir)), params, PROMPTS, NEW_TOKENS)
        assert synced.completions == rebuilt.completions == reference
        start = swapped.prompt_width
        versions = swapped.token_versions[0, start : start + NEW_TOKENS].tolist()
        assert versions == [synced.weight_version] * SWAP_AT + [synced.weight_version + 1] * (NEW_TOKENS - SWAP_AT)
        assert swapped.completions[0][:SWAP_AT] == synced.completions[0][:SWAP_AT]
        assert swapped.completions[0] != synced.completions[0], "the swap must change the continuation"


@pytest.mark.parametrize("workers", [CHUNKS_TP], ids=[f"tp{CHUNKS_TP}"], indirect=True)
def test_decode_chunks_on_the_interpreted_tpu_kernel_serve_rows_ending_mid_chunk(qwen2_dir, workers, monkeypatch):
    """Rows the first of which stops on a token mid-chunk: chunks computed ahead hold it as a
    row of no KV slot before rows still served. The kernel runs every row up to the last one
    served, and on a row of no keys it never finished: the plan gives such a row a page of
    padding slots, which it reads as one key. Greedy, as the test above: its programs serve
    (a sampled draw compiles other interpreted ones; chunks sample as single steps do on the
    native attention, tests/test_multistep.py)."""
    gaps = []
    plan = multistep._plan

    def recording(mwb, reqs, live, first_lens, slots, table, page_size, ended_rows_page=False):
        gap = list(live) != list(range(len(live)))
        # Raised on the scheduler thread, the call fails where the chunk would hang.
        assert ended_rows_page or not gap, f"a chunk computes rows {list(live)} of {len(reqs)}, the others unpaged"
        gaps.append(gap)
        return plan(mwb, reqs, live, first_lens, slots, table, page_size, ended_rows_page)

    monkeypatch.setattr(multistep, "_plan", recording)
    params = load_hf_params(qwen2_dir)
    single, chunked = workers["fa"], workers["fa-chunks"]
    sampling = dict(temperature=0.0, max_new_tokens=13, return_logprobs=True)
    single.sync_params(params)
    chunked.sync_params(params)
    # A token the first row draws early, and the last row never: the first stops there, the last runs on.
    unstopped = single.generate(PROMPTS, **sampling).completions
    stop_token = next(t for t in unstopped[0][3:] if t not in unstopped[-1])
    expected = single.generate(PROMPTS, stop_token_ids=[stop_token], **sampling)
    gaps.clear()
    got = chunked.generate(PROMPTS, stop_token_ids=[stop_token], **sampling)
    assert got.completions == expected.completions and got.finish_reasons == expected.finish_reasons
    np.testing.assert_allclose(np.nan_to_num(got.logprobs), np.nan_to_num(expected.logprobs), atol=1e-6)
    assert got.finish_reasons[0] == "stop" and max(map(len, got.completions)) == 13
    assert any(gaps), "no chunk was computed ahead holding a row that ended before others"
    assert chunked.engine.testing.kv_tokens_held() == 0
