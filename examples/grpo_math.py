"""GRPO math: group-relative advantages, token log-probs, the PPO-clip objective."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

REWARD_SCALES = ("group", "batch", "none")


def group_advantages(
    rewards, group_size: int, scale: str = "group", eps: float = 1e-6, step_std: float | None = None
) -> np.ndarray:
    """Each reward minus its group's mean, for consecutive groups of ``group_size`` rows, divided
    by (TRL's ``scale_rewards``): ``"group"`` the group's std (DeepSeek's GRPO), ``"batch"`` the
    std of every reward of the step, ``"none"`` nothing (Dr. GRPO). Where ``rewards`` are one
    process's share of the step, ``step_std`` is the std of every process's (``"batch"``).

    Rows are prompt-major (the samples of one prompt are adjacent), as RolloutBatch lays them.
    A group whose samples all earned the same reward gets zero advantage: it teaches nothing.
    The std is the population's (numpy's, ddof 0); TRL's ``torch.std`` is Bessel-corrected,
    which makes its advantages x sqrt((G - 1) / G) of these (x0.87 at G = 4, x0.98 at 32).
    A group's std also blows up small differences: samples a shaped reward pays 0.45 and 0.40
    get advantages of +-1, as large as a right answer's; ``"batch"`` keeps them small.
    """
    if scale not in REWARD_SCALES:
        raise ValueError(f"scale must be one of {REWARD_SCALES}, got {scale!r}")
    rewards = np.asarray(rewards, dtype=np.float32)
    if group_size < 1 or rewards.size % group_size:
        raise ValueError(f"{rewards.size} rewards do not split into groups of {group_size}")
    groups = rewards.reshape(-1, group_size)
    centered = groups - groups.mean(axis=1, keepdims=True)
    if scale == "group":
        centered = centered / (groups.std(axis=1, keepdims=True) + eps)
    elif scale == "batch":
        centered = centered / ((rewards.std() if step_std is None else step_std) + eps)
    # Exactly 0 where every reward is the same (frac_reward_zero_std's test): float32's mean of
    # 12 rewards of 0.45 is off by ~1e-8, and so is their std, which divided it into 0.06.
    same = groups.max(axis=1, keepdims=True) == groups.min(axis=1, keepdims=True)
    return np.where(same, np.float32(0), centered).reshape(-1)


def frac_reward_zero_std(rewards, group_size: int) -> jax.Array:
    """The fraction of groups (``group_size`` consecutive rows) whose samples all earned the
    same reward, TRL's ``frac_reward_zero_std``: their advantages are 0, they teach nothing.
    At 1 a step's update has no signal at all. ``rewards`` may be a global (sharded) array."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if group_size < 1 or rewards.size % group_size:
        raise ValueError(f"{rewards.size} rewards do not split into groups of {group_size}")
    groups = rewards.reshape(-1, group_size)
    # Equal, not a std under some eps: a group of one repeated reward is what zeroes the advantages.
    return jnp.mean(groups.max(axis=1) == groups.min(axis=1))


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1: shape [B, T - 1]."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def ppo_clip_loss(
    new_logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    clip_eps: float = 0.2,
    ref_logprobs: jax.Array | None = None,
    kl_beta: float = 0.0,
    behaviour_logprobs: jax.Array | None = None,
    tis_cap: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-level PPO-clip objective (mean over completion tokens) with an optional KL
    penalty to a reference policy (k3 estimator). All log-prob arrays are [B, T'] and
    ``mask`` marks completion tokens; ``advantages`` is [B] (one per sequence, GRPO) or [B, T']
    (one per token, PPO).

    With ``behaviour_logprobs`` (the rollout engine's, which sampled the tokens) and
    ``tis_cap``, truncated importance sampling corrects for the engine not being exactly the
    trainer's policy: each token's policy-gradient term is weighted by
    ``min(exp(old - behaviour), tis_cap)``, a constant (no gradient through it)."""
    mask = mask.astype(jnp.float32)
    tokens = jnp.maximum(mask.sum(), 1.0)
    log_ratio = new_logprobs - old_logprobs
    ratio = jnp.exp(log_ratio)
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -jnp.minimum(unclipped, clipped)
    tis = {}
    if behaviour_logprobs is not None and tis_cap is not None:
        importance = jnp.exp(old_logprobs - behaviour_logprobs)
        weight = jax.lax.stop_gradient(jnp.minimum(importance, tis_cap))
        per_token = per_token * weight
        tis = {
            "tis_weight": (weight * mask).sum() / tokens,
            "tis_capped": ((importance > tis_cap) * mask).sum() / tokens,
        }
    stats = {
        **tis,
        "clip_fraction": ((jnp.abs(ratio - 1.0) > clip_eps) * mask).sum() / tokens,
        # k3 estimate of KL(old || new) on tokens sampled from old: how far this update moved
        # the policy (r - 1 - log r with r = new / old; unbiased, never negative).
        "approx_kl": ((jnp.expm1(log_ratio) - log_ratio) * mask).sum() / tokens,
    }
    if ref_logprobs is not None and kl_beta > 0:
        delta = ref_logprobs - new_logprobs
        kl = jnp.exp(delta) - delta - 1.0
        per_token = per_token + kl_beta * kl
        stats["ref_kl"] = (kl * mask).sum() / tokens
    loss = (per_token * mask).sum() / tokens
    stats["loss"] = loss
    return loss, stats
