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
