"""models/moe.py: the router picks the experts and weights HF transformers picks."""

import jax
import numpy as np
import pytest

from models import route


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
