"""models/moe.py: the router picks the experts and weights HF transformers picks, and replays
given experts (rollout routing replay)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import replay_route, route


def reference_route(logits, top_k, norm):
    """HF transformers' Qwen3MoeSparseMoeBlock routing, in numpy float64."""
    logits = np.asarray(logits, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]
    weights = np.take_along_axis(probs, experts, -1)
    if norm:
        weights /= weights.sum(-1, keepdims=True)
    return weights, experts


@pytest.mark.parametrize("norm", [True, False])
def test_routing_follows_hf_transformers(norm):
    logits = np.asarray(jax.random.normal(jax.random.key(1), (16, 8)) * 2.0)
    weights, experts = route(logits, 2, norm)
    expected_weights, expected_experts = reference_route(logits, 2, norm)
    np.testing.assert_array_equal(np.asarray(experts), expected_experts)
    np.testing.assert_allclose(np.asarray(weights), expected_weights, rtol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_replayed_routes_use_the_given_experts_with_this_routers_weights(norm):
    logits = np.asarray(jax.random.normal(jax.random.key(2), (6, 8)) * 2.0)
    _, own = route(logits, 2, norm)
    given = np.array([[7, 0], [1, 2], [-1, -1], [3, 4], [-1, -1], [6, 5]])
    weights, experts = replay_route(logits, given, 2, norm)
    expected = np.where(given >= 0, given, np.asarray(own))
    np.testing.assert_array_equal(np.asarray(experts), expected)
    # The weights are this router's probabilities of those experts (renormalized with norm).
    expected_weights = np.take_along_axis(np.asarray(jax.nn.softmax(logits.astype(np.float64), -1)), expected, -1)
    if norm:
        expected_weights /= expected_weights.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(weights), expected_weights, rtol=1e-6)


def test_replay_takes_the_router_gradient_through_the_replayed_experts_only():
    """With renormalized weights, only the replayed experts' logits reach the output."""
    logits = jax.random.normal(jax.random.key(3), (1, 8))
    given = jnp.array([[5, 2]])

    def output(logits):
        weights, _ = replay_route(logits, given, 2, True)
        return jnp.sum(weights * jnp.array([[1.0, 3.0]]))

    grad = np.asarray(jax.grad(output)(logits))[0]
    assert np.all(np.abs(grad[[5, 2]]) > 0.01)
    # Zero up to float32 rounding (the softmax's normalizer cancels out).
    np.testing.assert_allclose(np.delete(grad, [5, 2]), 0, atol=1e-6)
