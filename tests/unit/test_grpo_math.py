"""examples/grpo_math.py: group advantages and the clipped policy-gradient loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.grpo_math import frac_reward_zero_std, group_advantages, ppo_clip_loss, token_logprobs


def test_group_advantages():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    adv = group_advantages(rewards, 4)
    np.testing.assert_allclose(adv[:4], [1, -1, -1, 1], atol=1e-5)
    np.testing.assert_array_equal(adv[4:], 0.0)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        group_advantages(rewards, 3)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("group_size", [3, 12, 24])
def test_a_group_of_one_repeated_reward_gets_exactly_zero_advantage(scale, group_size):
    """Shaped rewards such as 0.45 or 0.895: float32's mean of a group of them is not the
    reward, and the group's std (as small) divided the remainder into advantages up to 0.15."""
    for reward in (0.45, 0.895, 0.3, 1.0):
        rewards = np.concatenate([np.full(group_size, reward), np.arange(group_size) / group_size])
        advantages = group_advantages(rewards.astype(np.float32), group_size, scale)
        assert (advantages[:group_size] == 0).all(), (reward, advantages[:3])
        assert (advantages[group_size:] != 0).any()


def test_group_advantages_scaled_by_the_group_the_batch_or_nothing():
    # A group a shaped reward pays 0.45 / 0.40 and a group with a right answer (1.0).
    rewards = np.array([0.45, 0.40, 0.45, 0.40, 1.0, 0.0, 0.0, 0.0], np.float32)
    centered = np.array([0.025, -0.025, 0.025, -0.025, 0.75, -0.25, -0.25, -0.25])
    np.testing.assert_allclose(group_advantages(rewards, 4, "none"), centered, atol=1e-6)
    np.testing.assert_allclose(group_advantages(rewards, 4, "batch"), centered / rewards.std(), rtol=1e-4)
    # Divided by its own std, the first group's 0.05 differences count as much as a right answer.
    grouped = group_advantages(rewards, 4, "group")
    np.testing.assert_allclose(grouped[:4], [1, -1, 1, -1], rtol=1e-3)
    np.testing.assert_allclose(grouped[4], np.sqrt(3), rtol=1e-4)
    # A process holding half the step's groups divides by the whole step's std, as one process would.
    share = group_advantages(rewards[:4], 4, "batch", step_std=float(rewards.std()))
    np.testing.assert_allclose(share, group_advantages(rewards, 4, "batch")[:4], rtol=1e-6)
    with pytest.raises(ValueError, match="scale must be one of"):
        group_advantages(rewards, 4, "std")


def test_frac_reward_zero_std_counts_the_groups_that_teach_nothing():
    # Groups of 4: mixed, all 0.5, all 0 (also with -0.0), mixed by a hair.
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, -0.0, 0.0, 0.0, 0.45, 0.45, 0.45, 0.4500001]
    assert float(frac_reward_zero_std(rewards, 4)) == 0.5
    assert float(frac_reward_zero_std(rewards, 16)) == 0.0
    assert float(frac_reward_zero_std(rewards[4:12], 4)) == 1.0
    # Where it is 1 every advantage is 0: the update has no signal.
    np.testing.assert_array_equal(group_advantages(rewards[4:12], 4), 0.0)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        frac_reward_zero_std(rewards, 3)


def test_token_logprobs_gather_the_next_token():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
    tokens = jnp.array([[1, 2, 3, 4, 5], [6, 0, 1, 2, 3]])
    got = token_logprobs(logits, tokens)
    expected = np.array([[jax.nn.log_softmax(logits[b, t - 1])[tokens[b, t]] for t in range(1, 5)] for b in range(2)])
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_approx_kl_estimates_kl_of_the_old_policy_to_the_new():
    """Over tokens drawn from the old policy (here in exact proportion) the k3 estimate's mean
    is KL(old || new) itself, however far the update moved."""
    old_p, new_p = np.array([0.5, 0.5]), np.array([0.9, 0.1])
    old, new = jnp.log(jnp.array([old_p], jnp.float32)), jnp.log(jnp.array([new_p], jnp.float32))
    _, stats = ppo_clip_loss(new, old, jnp.array([1.0]), jnp.ones((1, 2)))
    kl = float(np.sum(old_p * np.log(old_p / new_p)))  # 0.511 (the old estimate gave 1.267)
    assert float(stats["approx_kl"]) == pytest.approx(kl, rel=1e-5)


def test_ppo_clip_loss():
    old = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))
    mask = jnp.array([[1.0, 1.0, 0.0]])
    adv = jnp.array([2.0])
    loss, stats = ppo_clip_loss(old, old, adv, mask)
    assert float(loss) == pytest.approx(-2.0)
    assert float(stats["clip_fraction"]) == 0 and float(stats["approx_kl"]) == pytest.approx(0, abs=1e-7)
    # Ratio 1.5 with a positive advantage is clipped at 1.2: no gradient pushes it further.
    new = old + jnp.log(1.5)
    loss, stats = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2)
    assert float(loss) == pytest.approx(-1.2 * 2.0)
    assert float(stats["clip_fraction"]) == 1.0
    grad = jax.grad(lambda n: ppo_clip_loss(n, old, adv, mask, clip_eps=0.2)[0])(new)
    np.testing.assert_array_equal(grad, 0.0)
    # With a negative advantage the unclipped term is the minimum: the gradient stays.
    grad = jax.grad(lambda n: ppo_clip_loss(n, old, -adv, mask, clip_eps=0.2)[0])(new)
    assert float(grad[0, 0]) > 0 and float(grad[0, 2]) == 0  # masked token: no gradient
    # KL to a reference policy adds beta * k3 per token.
    ref = old
    loss_kl, stats = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2, ref_logprobs=ref, kl_beta=0.1)
    k3 = np.exp(np.log(1 / 1.5)) - np.log(1 / 1.5) - 1
    assert float(loss_kl - loss) == pytest.approx(0.1 * k3, rel=1e-5)
    assert float(stats["ref_kl"]) == pytest.approx(k3, rel=1e-5)


def test_truncated_importance_sampling_weights_the_policy_gradient():
    old = jnp.log(jnp.array([[0.5, 0.5, 0.2]]))
    behaviour = jnp.log(jnp.array([[0.25, 0.5, 0.5]]))  # weights 2 (capped at 1.5), 1, 0.4
    mask = jnp.array([[1.0, 1.0, 1.0]])
    adv = jnp.array([1.0])
    plain = jax.grad(lambda n: ppo_clip_loss(n, old, adv, mask)[0])(old)
    loss, stats = ppo_clip_loss(old, old, adv, mask, behaviour_logprobs=behaviour, tis_cap=1.5)
    grad = jax.grad(lambda n: ppo_clip_loss(n, old, adv, mask, behaviour_logprobs=behaviour, tis_cap=1.5)[0])(old)
    np.testing.assert_allclose(grad, plain * jnp.array([[1.5, 1.0, 0.4]]), rtol=1e-5)
    assert float(loss) == pytest.approx(-(1.5 + 1.0 + 0.4) / 3, rel=1e-5)
    assert float(stats["tis_capped"]) == pytest.approx(1 / 3) and float(stats["tis_weight"]) == pytest.approx(
        2.9 / 3, rel=1e-5
    )


def test_clipped_surrogate_with_per_token_advantages():
    old = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))
    new = old + jnp.log(jnp.array([[1.5, 0.5, 1.0]]))
    adv = jnp.array([[1.0, 1.0, -2.0]])
    mask = jnp.array([[1.0, 1.0, 1.0]])
    # min(r A, clip(r) A): 1.2 (clipped), 0.5 (the unclipped is smaller), -2 (ratio 1).
    loss, stats = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2)
    assert float(loss) == pytest.approx(-(1.2 + 0.5 - 2.0) / 3, rel=1e-6)
    assert float(stats["clip_fraction"]) == pytest.approx(2 / 3)
