"""Rollout routing replay without an engine: the recorder's slot table and sinks
(rollout/engine/routing.py), the batch layout of ``routed_experts``, and the Flax model's replay."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import TinyMoeSpec, flax_model_for, router_choices, write_tiny_model
from rollout.batch import pack_rollouts
from rollout.engine.routing import RoutingRecorder, RoutingSink, routing_dtype
from trainer_bridge import load_hf_params

LAYERS, TOP_K = 2, 2


def forward_batch(reqs, slots, extend):
    mode = types.SimpleNamespace(is_extend=lambda: extend)
    return types.SimpleNamespace(reqs=reqs, out_cache_loc=np.asarray(slots), forward_mode=mode)


def request(rid, pool_index, fill_ids):
    return types.SimpleNamespace(rid=rid, req_pool_idx=pool_index, fill_ids=fill_ids)


def routing(first, count):
    """Distinct rows [count, LAYERS, TOP_K] (padding rows after them, as the engine pads)."""
    rows = np.arange(first, first + count + 3) % 100
    return np.repeat(rows[:, None, None], LAYERS, 1).repeat(TOP_K, 2).astype(np.int8)


def test_a_cached_prefix_gets_the_routing_of_the_forward_that_computed_it():
    recorder = RoutingRecorder()
    req_to_token = np.zeros((4, 16), np.int32)
    # Request a (pool row 0) prefills 4 tokens into slots 10..13; nobody asked for them.
    req_to_token[0, :4] = [10, 11, 12, 13]
    recorder.record(forward_batch([request("a", 0, [1, 2, 3, 4])], [10, 11, 12, 13], True), routing(0, 4), req_to_token)
    # Request b (pool row 1) finds the first 3 in the prefix cache and prefills one token (slot 20).
    sink = recorder.sinks["b"] = RoutingSink()
    req_to_token[1, :4] = [10, 11, 12, 20]
    recorder.record(forward_batch([request("b", 1, [1, 2, 3, 9])], [20], True), routing(50, 1), req_to_token)
    np.testing.assert_array_equal(sink.rows()[:, 0, 0], [0, 1, 2, 50])
    # Two decode steps append one row each (slots past the table's end grow it).
    for step in range(2):
        recorder.record(forward_batch([request("b", 1, [])], [500 + step], False), routing(60 + step, 1), req_to_token)
    np.testing.assert_array_equal(sink.rows()[:, 0, 0], [0, 1, 2, 50, 60, 61])
    assert sink.rows().shape == (6, LAYERS, TOP_K) and len(sink) == 6


def test_a_second_prefill_of_a_request_starts_its_rows_over():
    """A retracted request is prefilled again (prompt + its tokens so far): its rows are rebuilt."""
    recorder = RoutingRecorder()
    req_to_token = np.zeros((2, 8), np.int32)
    sink = recorder.sinks["a"] = RoutingSink()
    req_to_token[0, :2] = [1, 2]
    recorder.record(forward_batch([request("a", 0, [7, 8])], [1, 2], True), routing(0, 2), req_to_token)
    recorder.record(forward_batch([request("a", 0, [])], [3], False), routing(9, 1), req_to_token)
    req_to_token[0, :3] = [4, 5, 6]
    recorder.record(forward_batch([request("a", 0, [7, 8, 5])], [4, 5, 6], True), routing(30, 3), req_to_token)
    np.testing.assert_array_equal(sink.rows()[:, 0, 0], [30, 31, 32])


def test_routing_ids_are_narrow_integers():
    """Ids run from 0 to num_experts - 1, and -1 marks no routing."""
    assert routing_dtype(8) == np.int8 and routing_dtype(128) == np.int8  # Qwen3-30B-A3B, 235B-A22B
    assert routing_dtype(129) == np.int16


def test_batch_layout_aligns_routing_with_tokens():
    prompts, completions = [[5, 6, 7], [8]], [[1, 2], [3, 4, 9]]
    # Routing of every position a forward took as input: prompt + completion - 1 rows.
    rows = [
        np.full((len(p) + len(c) - 1, LAYERS, TOP_K), i, np.int8) for i, (p, c) in enumerate(zip(prompts, completions))
    ]
    for row in rows:
        row[:, 0, 0] = np.arange(len(row))
    layout = dict(n=1, completion_width=4, pad_token_id=0, finish_reasons=["length"] * 2, weight_version=0)
    batch = pack_rollouts(prompts, completions, seeds=np.zeros(2), routed_experts=rows, **layout)
    assert batch.routed_experts.shape == (2, 7, LAYERS, TOP_K) and batch.routed_experts.dtype == np.int8
    # Row 1: the prompt sits in column 2, its 3 completion tokens in 3..5; the last one has none.
    np.testing.assert_array_equal(batch.routed_experts[1, :, 0, 0], [-1, -1, 0, 1, 2, -1, -1])
    np.testing.assert_array_equal(batch.routed_experts[0, :, 0, 0], [0, 1, 2, 3, -1, -1, -1])
    with pytest.raises(ValueError, match="row 0: routing for 2 positions, expected 4"):
        pack_rollouts(prompts, completions, seeds=np.zeros(2), routed_experts=[rows[0][:2], rows[1]], **layout)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("moe"), TinyMoeSpec(), with_tokenizer=False)
    return flax_model_for(json.loads((model_dir / "config.json").read_text())), load_hf_params(model_dir)


def test_the_flax_model_routes_to_replayed_experts(moe):
    model, params = moe
    # Jitted: op by op, the forward's every primitive compiles on its own.
    apply = jax.jit(lambda tokens, routed=None: model.apply({"params": params}, tokens, routed_experts=routed))
    choices = jax.jit(lambda tokens, routed=None: router_choices(model, params, tokens, routed_experts=routed))
    tokens = jnp.asarray([[5, 17, 42, 8, 100, 3]])
    own = choices(tokens)
    assert own.shape == (1, 6, len(model.config.sparse_layers), model.config.num_experts_per_tok)
    logits = apply(tokens)
    # Replaying its own choice, or nothing (-1), changes nothing.
    np.testing.assert_array_equal(apply(tokens, own), logits)
    np.testing.assert_array_equal(apply(tokens, jnp.full_like(own, -1)), logits)
    # Other experts for token 3 change its logits alone (the sparse layer is the last: its
    # output reaches no other token).
    other = own.at[0, 3].set((own[0, 3] + 3) % model.config.num_experts)
    replayed = apply(tokens, other)
    changed = np.abs(np.asarray(replayed - logits))[0].max(-1)
    assert changed[3] > 1e-2
    np.testing.assert_array_equal(np.delete(changed, 3), 0)
    with pytest.raises(ValueError, match=r"routed_experts has shape \(1, 6, 2, 2\); this model takes \(1, 6, 1, 2\)"):
        model.apply({"params": params}, tokens, routed_experts=jnp.concatenate([own, own], axis=2))
    # One expert a token for a top-2 model once broadcast to both of its slots.
    with pytest.raises(ValueError, match=r"routed_experts has shape \(1, 6, 1, 1\); this model takes \(1, 6, 1, 2\)"):
        model.apply({"params": params}, tokens, routed_experts=own[..., :1])
    # The forward's own routers still report their own choice under replay.
    np.testing.assert_array_equal(choices(tokens, other)[0, :4], own[0, :4])
