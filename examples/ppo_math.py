"""PPO math: per-token rewards with a KL penalty, GAE, whitening, the value and entropy terms.

Every array is token-aligned with :func:`examples.grpo_math.token_logprobs`: ``[B, T - 1]``,
index ``t`` being the action "emit token ``t + 1``" taken in the state "tokens up to ``t``",
and ``mask`` marks the completion's tokens (prompt and padding are never actions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KL_ESTIMATORS = ("k1", "k3")


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = "k1") -> jax.Array:
    """Per-token estimate of KL(policy || reference) on tokens the policy sampled.

    k1 is ``log p - log p_ref`` (unbiased, can be negative: InstructGPT, TRL's default); k3 is
    ``exp(r) - 1 - r`` with ``r = log p_ref - log p`` (unbiased and never negative).
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        log_ratio = ref_logprobs - logprobs
        return jnp.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def token_rewards(scores: jax.Array, mask: jax.Array, kl: jax.Array | None = None, kl_coef: float = 0.0) -> jax.Array:
    """The task's score ([B]) at each row's last completion token, minus ``kl_coef * kl`` on
    every completion token. A row with no completion token gets nothing."""
    mask = mask.astype(jnp.float32)
    columns = jnp.arange(mask.shape[1])
    last = jnp.max(jnp.where(mask > 0, columns, -1), axis=1)
    rewards = jnp.where(columns[None, :] == last[:, None], scores[:, None], 0.0) * mask
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    return rewards


def gae(
    rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
    """Generalized advantage estimation over the masked tokens of each row: (advantages, returns).

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where
    "next" is the row's next masked token (masked-out positions are skipped) and after the
    last one the episode ends (``V_next = A_next = 0``). Returns are ``A + V``; both are 0 off
    the mask.
    """
    mask = mask.astype(jnp.float32)
    rewards = rewards.astype(jnp.float32)
    values = values.astype(jnp.float32)

    def back(carry, column):
        next_value, next_adv = carry
        r, v, m = column
        adv = r + gamma * next_value - v + gamma * lam * next_adv
        # Off the mask the carry passes through unchanged.
        carry = (m * v + (1 - m) * next_value, m * adv + (1 - m) * next_adv)
        return carry, m * adv

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, advantages = jax.lax.scan(back, (zeros, zeros), (rewards.T, values.T, mask.T), reverse=True)
    advantages = advantages.T
    return advantages, (advantages + values) * mask


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.astype(jnp.float32)
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def masked_whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """``(x - mean) / std`` over the masked entries; 0 off the mask."""
    mean = masked_mean(x, mask)
    var = masked_mean(jnp.square(x - mean), mask)
    return (x - mean) * jax.lax.rsqrt(var + eps) * mask


def clipped_value_loss(values, old_values, returns, mask, clip: float) -> tuple[jax.Array, jax.Array]:
    """``0.5 * max((V - R)^2, (V_clipped - R)^2)`` averaged over the mask, with ``V_clipped``
    the new value kept within ``clip`` of the rollout's; and the fraction of tokens where the
    clip moved the value and the clipped term was the larger (PPO2's value clipping, as in
    OpenAI's baselines and TRL)."""
    clipped = old_values + jnp.clip(values - old_values, -clip, clip)
    plain_err = jnp.square(values - returns)
    clipped_err = jnp.square(clipped - returns)
    loss = 0.5 * masked_mean(jnp.maximum(plain_err, clipped_err), mask)
    # Within the clip, old + (V - old) can round away from V: that is not clipping.
    taken = (jnp.abs(values - old_values) > clip) & (clipped_err > plain_err)
    return loss, masked_mean(taken.astype(jnp.float32), mask)


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of each next-token distribution, aligned with ``token_logprobs``: [B, T - 1]."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -(jnp.exp(logp) * logp).sum(axis=-1)


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
    """``1 - Var(R - V) / Var(R)`` over the mask: 1 a perfect critic, 0 no better than the mean,
    negative worse than the mean."""

    def var(x):
        return masked_mean(jnp.square(x - masked_mean(x, mask)), mask)

    return 1.0 - var(returns - values) / jnp.maximum(var(returns), 1e-8)
