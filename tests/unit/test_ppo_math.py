"""examples/ppo_math.py: GAE, token rewards, KL estimators, the value loss and its statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.ppo_math import (
    clipped_value_loss,
    explained_variance,
    gae,
    kl_penalty,
    masked_whiten,
    token_entropy,
    token_rewards,
)

# Three rows of six actions: left prompt, completions of 3, 1 and 0 tokens, right padding.
MASK = np.array(
    [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]],
    dtype=np.float32,
)


def gae_reference(rewards, values, mask, gamma, lam):
    """GAE row by row over the masked positions, the textbook recursion in float64."""
    advantages = np.zeros_like(rewards, dtype=np.float64)
    for row in range(rewards.shape[0]):
        steps = np.flatnonzero(mask[row])
        next_value = next_adv = 0.0
        for t in steps[::-1]:
            delta = rewards[row, t] + gamma * next_value - values[row, t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[row, t]
            advantages[row, t] = next_adv
    return advantages, (advantages + values) * mask


def test_gae_against_a_hand_computed_reference():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=MASK.shape).astype(np.float32) * MASK
    values = rng.normal(size=MASK.shape).astype(np.float32)  # garbage off the mask: must not leak in
    gamma, lam = 0.9, 0.8
    advantages, returns = gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(MASK), gamma, lam)
    expected_adv, expected_ret = gae_reference(rewards, values, MASK, gamma, lam)
    np.testing.assert_allclose(advantages, expected_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(returns, expected_ret, rtol=1e-5, atol=1e-6)
    # Row 0 by hand: r = (r2, r3, r4), V = (v2, v3, v4), the episode ends after t=4.
    r, v = rewards[0, 2:5], values[0, 2:5]
    a4 = r[2] - v[2]
    a3 = r[1] + gamma * v[2] - v[1] + gamma * lam * a4
    a2 = r[0] + gamma * v[1] - v[0] + gamma * lam * a3
    np.testing.assert_allclose(advantages[0, 2:5], [a2, a3, a4], rtol=1e-5)
    assert float(advantages[1, 3]) == pytest.approx(rewards[1, 3] - values[1, 3], rel=1e-6)
    np.testing.assert_array_equal(np.asarray(advantages)[MASK == 0], 0.0)
    np.testing.assert_array_equal(np.asarray(returns)[MASK == 0], 0.0)


def test_token_rewards_put_the_score_on_the_last_completion_token_and_the_kl_on_every_one():
    scores = jnp.array([1.0, 0.5, 2.0])
    kl = jnp.full(MASK.shape, 0.1)
    rewards = np.asarray(token_rewards(scores, jnp.asarray(MASK), kl, kl_coef=0.2))
    np.testing.assert_allclose(rewards[0], [0, 0, -0.02, -0.02, 1.0 - 0.02, 0], rtol=1e-6)
    np.testing.assert_allclose(rewards[1], [0, 0, 0, 0.5 - 0.02, 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(rewards[2], 0.0)  # no completion token: nothing to reward


def test_kl_estimators():
    logp = jnp.log(jnp.array([0.5, 0.2]))
    ref = jnp.log(jnp.array([0.25, 0.4]))
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1"), [np.log(2), np.log(0.5)], rtol=1e-6)
    # k3 with r = ref / p: r - 1 - log r.
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3"), [0.5 - 1 - np.log(0.5), 2 - 1 - np.log(2)], rtol=1e-6)
    with pytest.raises(ValueError, match="KL estimator must be one of"):
        kl_penalty(logp, ref, "k2")


def test_value_loss_clipping_entropy_and_explained_variance():
    mask = jnp.array([[1.0, 1.0, 0.0]])
    old = jnp.array([[0.0, 0.0, 0.0]])
    returns = jnp.array([[1.0, 0.0, 5.0]])
    new = jnp.array([[0.5, 0.1, 9.0]])
    # Token 0: plain (0.5-1)^2 = 0.25, clipped (0.2-1)^2 = 0.64 -> 0.64; token 1: 0.01 vs 0.01.
    loss, clipped = clipped_value_loss(new, old, returns, mask, clip=0.2)
    assert float(loss) == pytest.approx(0.5 * (0.64 + 0.01) / 2, rel=1e-6)
    assert float(clipped) == pytest.approx(0.5)
    grad = jax.grad(lambda v: clipped_value_loss(v, old, returns, mask, 0.2)[0])(new)
    assert float(grad[0, 0]) == 0.0, "the clipped term wins: no gradient moves V further from the rollout's"
    assert float(grad[0, 1]) == pytest.approx(0.5 * 2 * 0.1 / 2) and float(grad[0, 2]) == 0.0
    # Entropy of uniform next-token distributions is log V; of a one-hot, 0.
    logits = jnp.stack([jnp.zeros((3, 7)), jnp.eye(3, 7) * 1e4])
    np.testing.assert_allclose(token_entropy(logits), [[np.log(7)] * 2, [0.0, 0.0]], atol=1e-5)
    assert token_entropy(logits).shape == (2, 2)
    # Explained variance: 1 for a perfect critic, 0 for a constant one, masked entries ignored.
    ret = jnp.array([[1.0, 2.0, 3.0, 100.0]])
    emask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    assert float(explained_variance(ret, ret, emask)) == pytest.approx(1.0)
    assert float(explained_variance(jnp.full_like(ret, 7.0), ret, emask)) == pytest.approx(0.0, abs=1e-6)
    assert float(explained_variance(jnp.array([[3.0, 2.0, 1.0, 0.0]]), ret, emask)) == pytest.approx(
        1 - 8 / (2 / 3) / 3, rel=1e-5
    )
    white = np.asarray(masked_whiten(ret, emask))
    np.testing.assert_allclose(white[0, :3], [-np.sqrt(1.5), 0, np.sqrt(1.5)], rtol=1e-5)
    assert white[0, 3] == 0


def test_the_value_clip_fraction_counts_values_the_clip_moved_and_nothing_else():
    """``old + (V - old)`` is not always ``V`` in float32: with every value within the clip,
    rounding made the clipped term the larger on some tokens and they counted as clipped (noise of
    ±0.05 with 0.6% of tokens truly past a clip of 0.2 was reported as 2.3%)."""
    rng = np.random.default_rng(0)
    old = rng.normal(size=(64, 32)).astype(np.float32)
    values = (old + rng.uniform(-0.05, 0.05, old.shape)).astype(np.float32)
    returns = (values + rng.normal(scale=0.01, size=old.shape)).astype(np.float32)  # a critic close to its targets
    mask = np.ones(old.shape, np.float32)
    assert np.any(old + (values - old) != values), "the premise: rounding moves some values"
    assert float(clipped_value_loss(values, old, returns, mask, clip=0.2)[1]) == 0.0

    # Row 0: 24 values moved past the clip towards returns beyond them (the clip pulls them back,
    # away: the clipped term is the larger, clipped), then 8 that overshot their returns (the
    # clip brings them closer: the plain term is the larger, not clipped). Row 63, off the mask:
    # 5 clipped ones that do not count.
    values[0, :32] = old[0, :32] + 0.5
    returns[0, :24] = old[0, :24] + 1.0
    returns[0, 24:32] = old[0, 24:32] + 0.1
    values[63, :5], returns[63, :5], mask[63] = old[63, :5] - 0.5, old[63, :5] - 1.0, 0.0
    fraction = clipped_value_loss(values, old, returns, mask, clip=0.2)[1]
    assert float(fraction) == pytest.approx(24 / (63 * 32))
