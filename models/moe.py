"""Top-k expert routing as HF transformers' Qwen3-MoE does it, shared by the engine (its MoE
forward, ``rollout/engine/moe.py``) and the trainer's Flax model, so both pick the same experts
with the same weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(router_logits, top_k: int, norm_topk_prob: bool):
    """(weights [..., top_k] float32, experts [..., top_k] int32) for router logits [..., E].

    A float32 softmax over all experts, the ``top_k`` largest (lowest index first on ties),
    renormalized to sum to one when ``norm_topk_prob``.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def replay_route(router_logits, routed, top_k: int, norm_topk_prob: bool):
    """:func:`route` with the experts given: where ``routed`` [..., top_k] holds ids (>= 0), those
    experts, weighted by their softmax probabilities (renormalized when ``norm_topk_prob``),
    as the engine weighted them; where it holds -1, this side's own top-k.

    Rollout routing replay (R3): the trainer routes each token to the experts that produced the
    sampled tokens in the engine, and its gradient reaches the router through the chosen experts'
    probabilities.
    """
    _, own = route(router_logits, top_k, norm_topk_prob)
    experts = jnp.where(routed >= 0, routed.astype(jnp.int32), own)
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts
