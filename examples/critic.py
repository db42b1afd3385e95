"""The PPO critic: a causal LM's backbone with a scalar value head.

``separate``: a model of the policy's family (its backbone, no LM head) plus a value head,
initialized from the policy's backbone and trained on its own. ``shared``: one backbone, the
policy's, with two heads; the critic's tree is then the value head alone.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainer_bridge import replicate, replicated_beside

CRITIC_MODES = ("separate", "shared")


class ValueHead(nn.Module):
    """Hidden states [B, T, H] -> values [B, T], in float32 whatever the backbone's dtype."""

    @nn.compact
    def __call__(self, hidden):
        # Zero-initialized: the first values are 0, not noise a fresh head would add to the returns.
        dense = nn.Dense(1, kernel_init=nn.initializers.zeros, dtype=jnp.float32, param_dtype=jnp.float32)
        return dense(hidden.astype(jnp.float32))[..., 0]


class Critic(nn.Module):
    """``lm``'s hidden states through a value head: ``apply(params, tokens, mask, positions)`` -> [B, T].

    ``lm`` is the policy's model class (any with ``hidden_states``); only its backbone's params
    are used, the LM head is never called.
    """

    lm: nn.Module

    @nn.compact
    def __call__(self, tokens, attention_mask, positions):
        return ValueHead(name="value_head")(self.lm.hidden_states(tokens, attention_mask, positions))


def init_critic(mode: str, policy_model: nn.Module, policy_params: dict, seed: int = 0) -> tuple[dict, Critic | None]:
    """The critic's initial params (placed like the policy's) and, for ``separate``, its model."""
    if mode not in CRITIC_MODES:
        raise ValueError(f"critic must be one of {CRITIC_MODES}, got {mode!r}")
    # Replicated over the policy's devices, in its mesh's order: a jitted step takes both trees together.
    replicated = replicated_beside(jax.tree_util.tree_leaves(policy_params)[0].sharding)
    hidden = jnp.zeros((1, 1, policy_model.config.hidden_size), jnp.float32)
    head = ValueHead().init(jax.random.key(seed), hidden)["params"]
    if replicated is not None:  # every process made the same head
        head = jax.tree_util.tree_map(lambda x: replicate(x, replicated), head)
    if mode == "shared":
        return {"value_head": head}, None
    critic = Critic(policy_model.clone())
    dummy = jnp.zeros((1, 2), jnp.int32)
    shapes = jax.eval_shape(lambda: critic.init(jax.random.key(seed), dummy, dummy > 0, dummy)["params"])
    # The backbone starts as a copy of the policy's (the policy's buffers are donated to its train step).
    backbone = {name: jax.tree_util.tree_map(jnp.copy, policy_params[name]) for name in shapes["lm"]}
    return {"lm": backbone, "value_head": head}, critic
