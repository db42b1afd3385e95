"""The engine on its TPU attention backend ("fa") on the CPU: its Pallas kernel (ragged paged
attention, which also writes the new tokens' K and V into the pool) interpreted by JAX
(``rollout.engine.tpu_interpret_mode``). Greedy tokens and log-probs equal the native
backend's and the Flax model's, after a sync, a KV drop and rebuild, and across an in-flight
swap landing at a fixed token (``pytest -k interpret``; what this proves: docs/platforms.md)."""

import numpy as np
import pytest

from models import CausalLM, DecoderConfig, greedy_decode
from rollout import RolloutWorker
from rollout.engine import tpu_interpret_mode
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


@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_tpu_attention_backend_in_interpret_mode_serves_what_the_native_one_does(qwen2_dir, tp_size):
    params = load_hf_params(qwen2_dir)
    new_params = perturbed_params(params)
    runs = {}
    with tpu_interpret_mode():
        for backend in ("native", "fa"):
            config = tiny_worker_config(qwen2_dir, load_format="dummy", tp_size=tp_size, attention_backend=backend)
            with RolloutWorker(config) as worker:
                assert worker.engine.attention_backend == backend
                runs[backend] = served(worker, params, new_params)
    for native, fa in zip(runs["native"], runs["fa"]):
        assert fa.completions == native.completions
        np.testing.assert_allclose(fa.logprobs, native.logprobs, atol=1e-5)
        np.testing.assert_array_equal(fa.token_versions, native.token_versions)
    synced, rebuilt, swapped = runs["fa"]
    reference = greedy_decode(CausalLM(DecoderConfig.from_hf(qwen2_dir)), params, PROMPTS, NEW_TOKENS)
    assert synced.completions == rebuilt.completions == reference
    start = swapped.prompt_width
    versions = swapped.token_versions[0, start : start + NEW_TOKENS].tolist()
    assert versions == [synced.weight_version] * SWAP_AT + [synced.weight_version + 1] * (NEW_TOKENS - SWAP_AT)
    assert swapped.completions[0][:SWAP_AT] == synced.completions[0][:SWAP_AT]
    assert swapped.completions[0] != synced.completions[0], "the swap must change the continuation"
