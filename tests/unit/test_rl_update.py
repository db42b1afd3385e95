"""examples/rl_update.py: the optimizer's warmup and decay."""

import jax.numpy as jnp
import numpy as np

from examples.rl_update import make_optimizer


def test_warmup_ramps_adams_steps_from_zero():
    """Adam's first step moves each parameter by about the learning rate whatever its gradient;
    with warmup_updates, step k (counted from 0) is scaled by k / warmup_updates, then by 1."""
    params, grad = jnp.zeros(3), jnp.array([1e-3, 0.1, -0.2])  # global norm < 1: no clipping

    def steps(optimizer, count):
        state, moved = optimizer.init(params), []
        for _ in range(count):
            updates, state = optimizer.update(grad, state, params)
            moved.append(float(jnp.abs(updates).max()))
        return np.array(moved)

    plain, warm = steps(make_optimizer(1e-2), 6), steps(make_optimizer(1e-2, warmup_updates=4), 6)
    np.testing.assert_allclose(plain, 1e-2, rtol=1e-3)
    np.testing.assert_allclose(warm, 1e-2 * np.array([0, 0.25, 0.5, 0.75, 1, 1]), rtol=1e-3, atol=1e-9)
    # Decayed over 4 more steps after a warm-up of 2: a cosine from the peak down to 0.
    decayed = steps(make_optimizer(1e-2, warmup_updates=2, decay_updates=4), 7)
    cosine = 0.5 * (1 + np.cos(np.pi * np.arange(5) / 4))
    np.testing.assert_allclose(decayed, 1e-2 * np.concatenate([[0, 0.5], cosine]), rtol=1e-3, atol=1e-9)
