"""In-flight weight swaps: exactness at the swap position, per-token versions, drain unchanged."""

import threading
import time

import numpy as np
import pytest

from rollout import RolloutWorker
from tests.helpers import tiny_worker_config
from trainer_bridge import load_hf_params

PROMPT = [5, 17, 42, 8]
NEW_TOKENS = 24
SWAP_AT = 7  # the swap lands after this many tokens of the running request


@pytest.fixture(scope="module")
def worker(qwen2_dir):
    with RolloutWorker(tiny_worker_config(qwen2_dir)) as w:
        yield w


@pytest.fixture(scope="module")
def params(qwen2_dir):
    return load_hf_params(qwen2_dir)


@pytest.fixture(scope="module")
def new_params(params):
    rng = np.random.default_rng(0)
    return _map(lambda x: x + (0.5 * x.std() * rng.standard_normal(x.shape)).astype(x.dtype), params)


def _map(fn, tree):
    return {k: _map(fn, v) if isinstance(v, dict) else fn(np.asarray(v)) for k, v in tree.items()}


def _greedy(worker, prompt, n):
    return worker.generate([prompt], temperature=0.0, max_new_tokens=n, ignore_eos=True, return_logprobs=True)


def _swap_at_token(worker, new_params, position, **swap):
    """Generate PROMPT greedily while an in-flight sync lands exactly when the request has
    ``position`` tokens: a boundary call holds the scheduler there (its condition is checked at
    every forward boundary) until the sync has queued its swap, which then runs at that same
    boundary. Returns (batch, sync report)."""
    engine = worker.engine
    held, release, results, errors = threading.Event(), threading.Event(), {}, []

    def hold():
        held.set()
        release.wait()

    def reached():
        return any(n >= position for n in engine.output_lengths().values())

    def run(name, fn):
        try:
            results[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            held.set()

    threads = [threading.Thread(target=run, args=("hold", lambda: engine.call_at_boundary(hold, when=reached)))]
    threads.append(threading.Thread(target=run, args=("batch", lambda: _greedy(worker, PROMPT, NEW_TOKENS))))
    for t in threads:
        t.start()
    assert held.wait(300) and not errors, errors
    sync = threading.Thread(target=run, args=("report", lambda: worker.sync_params(new_params, in_flight=True, **swap)))
    sync.start()
    while engine.boundary_calls_queued == 0 and sync.is_alive():  # the swap is queued behind the hold
        time.sleep(0.001)
    release.set()
    for t in [*threads, sync]:
        t.join(300)
    assert not errors, errors
    return results["batch"], results["report"]


def _row(batch, array):
    start = batch.prompt_width
    return array[0, start : start + len(batch.completions[0])]


def test_recompute_kv_swap_is_exact_at_the_swap_position(worker, params, new_params):
    worker.sync_params(params)
    old_version = worker.weight_version
    old = _greedy(worker, PROMPT, NEW_TOKENS)
    batch, report = _swap_at_token(worker, new_params, SWAP_AT, recompute_kv=True)
    tokens = batch.completions[0]
    assert report.version == old_version + 1 and batch.weight_version == old_version
    versions = _row(batch, batch.token_versions)
    assert versions.tolist() == [old_version] * SWAP_AT + [old_version + 1] * (NEW_TOKENS - SWAP_AT)
    # Before: the old weights' greedy continuation; after: the new weights' continuation of
    # the same prefix, and the log-probs of the weights that sampled each token.
    assert tokens[:SWAP_AT] == old.completions[0][:SWAP_AT]
    new = _greedy(worker, PROMPT + tokens[:SWAP_AT], NEW_TOKENS - SWAP_AT)
    assert tokens[SWAP_AT:] == new.completions[0]
    assert tokens[SWAP_AT:] != old.completions[0][SWAP_AT:], "the new weights must change the continuation"
    logprobs = _row(batch, batch.logprobs)
    np.testing.assert_allclose(logprobs[:SWAP_AT], _row(old, old.logprobs)[:SWAP_AT], atol=1e-4)
    np.testing.assert_allclose(logprobs[SWAP_AT:], _row(new, new.logprobs), atol=1e-4)


def test_keeping_kv_labels_versions_exactly_and_measures_the_divergence(worker, params, new_params, record_property):
    worker.sync_params(params)
    old_version = worker.weight_version
    old = _greedy(worker, PROMPT, NEW_TOKENS)
    batch, _ = _swap_at_token(worker, new_params, SWAP_AT)
    tokens = batch.completions[0]
    versions = _row(batch, batch.token_versions)
    assert versions.tolist() == [old_version] * SWAP_AT + [old_version + 1] * (NEW_TOKENS - SWAP_AT)
    assert tokens[:SWAP_AT] == old.completions[0][:SWAP_AT]
    # The first token after the swap reads the prefix's old KV with new weights; the exact
    # (recomputed) continuation is the reference the divergence is measured against.
    exact = _greedy(worker, PROMPT + tokens[:SWAP_AT], NEW_TOKENS - SWAP_AT).completions[0]
    differing = int(np.sum(np.array(tokens[SWAP_AT:]) != np.array(exact)))
    first = next((i for i, (a, b) in enumerate(zip(tokens[SWAP_AT:], exact)) if a != b), None)
    record_property("keep_kv_differing_tokens", differing)
    record_property("keep_kv_first_difference", first)
    assert len(tokens) == NEW_TOKENS


def test_prefix_cache_is_flushed_for_new_requests_while_old_kv_keeps_running(worker, params, new_params):
    """A request that starts after an in-flight swap, with the same prompt as the one still
    running on old KV, computes its prefix under the new weights (nothing cached is reused)."""
    worker.sync_params(params)
    _swap_at_token(worker, new_params, SWAP_AT)  # PROMPT's old-weight prefix was cached
    fresh = _greedy(worker, PROMPT, 8)
    worker.sync_params(new_params)  # a drain swap: a full flush
    reference = _greedy(worker, PROMPT, 8)
    assert fresh.completions == reference.completions
    assert (fresh.token_versions[fresh.completion_mask] == fresh.weight_version).all()


def test_recompute_kv_needs_in_flight(worker, params):
    with pytest.raises(ValueError, match="in_flight"):
        worker.sync_params(params, recompute_kv=True)
