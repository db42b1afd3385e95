"""examples/rl_update.py: the optimizer's warmup and decay, the train step's placement (also
through a resume)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from examples.rl_update import make_optimizer, make_train_step
from examples.run_dir import TrainState, checkpoint_manager, restore_or_init, save_train_state
from rollout.compiles import counting_compiles


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
    # Decayed over 4 more steps after a warm-up of 2: a cosine from the peak down to 0, reached
    # at a 7th step, past the 6 of the run (RLConfig.decay_updates): its last step still moves.
    decayed = steps(make_optimizer(1e-2, warmup_updates=2, decay_updates=4), 7)
    cosine = 0.5 * (1 + np.cos(np.pi * np.arange(5) / 4))
    np.testing.assert_allclose(decayed, 1e-2 * np.concatenate([[0, 0.5], cosine]), rtol=1e-3, atol=1e-9)


def _placed_trees():
    """Params on a 2-device mesh whose devices are not in id order (a TPU mesh follows the chips'
    ring), the kernel split over them, and Adam's fresh state (its step count made without a
    device)."""
    mesh = Mesh(np.array(jax.devices()[1::-1]).reshape(1, 2), ("data", "tensor"))
    params = {
        "kernel": jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, PartitionSpec(None, "tensor"))),
        "bias": jax.device_put(jnp.zeros(8), NamedSharding(mesh, PartitionSpec())),
    }
    optimizer = make_optimizer(1e-2)
    return {"params": params, "opt_state": optimizer.init(params)}, optimizer


def _loss_fn(trained, batch):
    out = batch["x"] @ trained["params"]["kernel"] + trained["params"]["bias"]
    return jnp.mean(out**2), {"approx_kl": jnp.float32(0)}


def test_the_train_step_compiles_once_and_keeps_the_trees_placement():
    """Every step's outputs keep the inputs' shardings, so the second and later steps run the
    first one's program; Adam's count is placed beside the params in their mesh's device order.
    Left to XLA, the outputs came back on other shardings and the second step compiled the
    whole step again."""
    trees, optimizer = _placed_trees()
    placement = jax.tree_util.tree_map(lambda leaf: leaf.sharding, trees["params"])
    step = make_train_step(_loss_fn, {"params": ("opt_state", optimizer)})
    batch = {"x": jnp.ones((3, 4))}
    trees, _ = step(trees, batch)
    with counting_compiles() as compiles:
        for _ in range(3):
            trees, stats = step(trees, batch)
    assert int(compiles) == 0
    assert jax.tree_util.tree_map(lambda leaf: leaf.sharding, trees["params"]) == placement
    assert float(stats["grad_norm"]) > 0


def test_a_resume_restores_the_step_count_beside_the_params(tmp_path):
    """A checkpoint of a step's trees, restored onto fresh ones as a resume does: the step runs
    on them (a count restored to the one device it was made on would not sit with params on two)."""
    trees, optimizer = _placed_trees()
    step = make_train_step(_loss_fn, {"params": ("opt_state", optimizer)})
    batch = {"x": jnp.ones((3, 4))}
    trained, _ = step(trees, batch)
    manager = checkpoint_manager(tmp_path)
    save_train_state(manager, TrainState(trained, 1))
    manager.wait_until_finished()
    fresh, _ = _placed_trees()
    resumed = restore_or_init(manager, fresh)
    assert resumed.step == 1
    np.testing.assert_array_equal(resumed.trees["params"]["kernel"], trained["params"]["kernel"])
    after, stats = step(resumed.trees, batch)
    assert int(after["opt_state"][1][0].count) == 2 and np.isfinite(float(stats["grad_norm"]))
