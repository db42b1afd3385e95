"""In-flight weight swaps: exactness at the swap position, per-token versions, drain unchanged."""

import asyncio
import json

import httpx
import numpy as np
import pytest

from rollout import RolloutWorker, compile_count
from tests.helpers import perturbed_params, swap_at_token, swap_during, tiny_worker_config
from trainer_bridge import load_hf_params

PROMPT = [5, 17, 42, 8]
NEW_TOKENS = 24
SWAP_AT = 7  # the swap lands after this many tokens of the running request


@pytest.fixture(scope="module")
def worker(qwen2_dir):
    # One padding bucket for decode batches and one for prefills (tiny_worker_config's): the load
    # test's batches, whatever sizes the timing gives them, compile nothing after a short warm-up.
    config = tiny_worker_config(qwen2_dir, max_running_requests=64)
    with RolloutWorker(config) as w:
        yield w


@pytest.fixture(scope="module")
def params(qwen2_dir):
    return load_hf_params(qwen2_dir)


@pytest.fixture(scope="module")
def new_params(params):
    return perturbed_params(params)


def _greedy(worker, prompt, n):
    return worker.generate([prompt], temperature=0.0, max_new_tokens=n, ignore_eos=True, return_logprobs=True)


def _row(batch, array):
    start = batch.prompt_width
    return array[0, start : start + len(batch.completions[0])]


def test_recompute_kv_swap_is_exact_at_the_swap_position(worker, params, new_params):
    worker.sync_params(params)
    old_version = worker.weight_version
    old = _greedy(worker, PROMPT, NEW_TOKENS)
    batch, report = swap_at_token(
        worker, new_params, SWAP_AT, lambda: _greedy(worker, PROMPT, NEW_TOKENS), recompute_kv=True
    )
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
    batch, _ = swap_at_token(worker, new_params, SWAP_AT, lambda: _greedy(worker, PROMPT, NEW_TOKENS))
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
    # PROMPT's old-weight prefix was cached.
    swap_at_token(worker, new_params, SWAP_AT, lambda: _greedy(worker, PROMPT, NEW_TOKENS))
    fresh = _greedy(worker, PROMPT, 8)
    worker.sync_params(new_params)  # a drain swap: a full flush
    reference = _greedy(worker, PROMPT, 8)
    assert fresh.completions == reference.completions
    assert (fresh.token_versions[fresh.completion_mask] == fresh.weight_version).all()


def test_recompute_kv_needs_in_flight(worker, params):
    with pytest.raises(ValueError, match="in_flight"):
        worker.sync_params(params, recompute_kv=True)


# ---- under load: the HTTP server --------------------------------------------------------------

ADMIN = {"Authorization": "Bearer inflight-admin"}
LOAD_TOKENS = 12


async def _serve_load(worker, url: str, model: str, requests: int, swaps: int, reload_dir: str):
    """``requests`` concurrent completions (half streamed) while ``swaps`` in-flight swaps run
    one after another, each issued while generate calls are running: perturbations keeping
    the KV, and reloads recomputing it. Returns (per request: (status, token_ids,
    token_versions, weight_version)), swap statuses)."""
    limits = httpx.Limits(max_connections=requests + 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def one(i: int):
            body = {
                "model": model,
                "prompt": [5 + i % 200, 17, 42, 8],
                "max_tokens": LOAD_TOKENS,
                "temperature": 1.0,
                "seed": i,
                "ignore_eos": True,
                "stream": i % 2 == 1,
            }
            if not body["stream"]:
                response = await client.post("/v1/completions", json=body)
                if response.status_code != 200:
                    return response.status_code, None, None, None
                data = response.json()
                choice = data["choices"][0]
                return 200, choice["token_ids"], choice["token_versions"], data["weight_version"]
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return response.status_code, None, None, None
                final, done = None, False
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if event["choices"] and event["choices"][0].get("token_ids") is not None:
                            final = event
                if not done or final is None:
                    return "incomplete", None, None, None
                choice = final["choices"][0]
                return 200, choice["token_ids"], choice["token_versions"], final["weight_version"]

        def mid_decode() -> bool:
            # At a forward boundary: a request has sampled some of its tokens (a swap asked for
            # now lands inside it, LOAD_TOKENS leaving it forwards to go), or none is left.
            # Running calls alone are not enough: on a loaded host they may all be waiting for
            # admission, or the whole load may finish before the swap's request is served.
            return pending[0] == 0 or any(0 < n < LOAD_TOKENS for n in worker.engine.testing.output_lengths().values())

        async def swapper():
            statuses = []
            for k in range(swaps):
                await asyncio.to_thread(worker.engine.call_at_boundary, lambda: None, mid_decode)
                if k % 2:
                    body, route = {"path": reload_dir, "format": "hf", "recompute_kv": True}, "/admin/reload_weights"
                else:
                    body, route = {"seed": k, "scale": 0.01, "num_leaves": 3}, "/admin/perturb_weights"
                statuses.append((await client.post(route, json=body, headers=ADMIN)).status_code)
            return statuses

        pending = [requests]

        async def counted(i: int):
            try:
                return await one(i)
            finally:
                pending[0] -= 1

        *outcomes, statuses = await asyncio.gather(*(counted(i) for i in range(requests)), swapper())
        return outcomes, statuses


def test_in_flight_swaps_under_load_lose_nothing_and_compile_nothing(worker, qwen2_dir):
    with worker.serve(admin_token="inflight-admin") as server:
        model = server.backend.model_name
        # Compiles what this load reaches: its batch sizes, re-prefills, the swaps' copies.
        asyncio.run(_serve_load(worker, server.url, model, 32, 2, str(qwen2_dir)))
        first_version = worker.weight_version
        before = compile_count()
        outcomes, statuses = asyncio.run(_serve_load(worker, server.url, model, 200, 20, str(qwen2_dir)))
        compiles = compile_count() - before
    assert statuses == [200] * 20
    assert worker.weight_version == first_version + 20
    mixed = 0
    for status, tokens, versions, start in outcomes:
        assert status == 200
        assert len(tokens) == LOAD_TOKENS and len(versions) == LOAD_TOKENS
        assert versions == sorted(versions), "versions never go back within a request"
        assert first_version <= start <= versions[0] and versions[-1] <= first_version + 20
        mixed += versions[0] != versions[-1]
    assert mixed > 0, "some requests ran across a swap"
    assert compiles == 0


def test_a_swap_during_a_chunked_prefill_without_a_prefix_cache_gives_its_chunks_back(qwen2_dir, params, new_params):
    """Without a prefix cache (``prefix_cache=False``: sglang-jax's ChunkCache) the chunks a
    prompt has prefilled belong to the request alone; a swap keeping the KV restarts its
    prefill and must free them, or the engine fails its idle check for leaked KV."""
    config = tiny_worker_config(
        qwen2_dir, prefix_cache=False, max_prefill_tokens=64, chunked_prefill_size=64, max_running_requests=4
    )
    prompt = list(np.random.default_rng(0).integers(1, 300, 200))
    with RolloutWorker(config) as worker:
        worker.sync_params(params)
        engine = worker.engine
        start = engine.forward_count
        # Held after two of the prompt's four chunks: the swap lands half-way through its prefill.
        batch, report = swap_during(
            worker, new_params, lambda: engine.forward_count >= start + 2, lambda: _greedy(worker, prompt, 6)
        )
        assert batch.prefill_tokens[0] == 128 + 200  # two chunks, then the whole prompt again
        assert (batch.token_versions[batch.completion_mask] == report.version).all()
        assert engine.testing.kv_tokens_held() == 0
        assert _greedy(worker, prompt, 6).completions == batch.completions
