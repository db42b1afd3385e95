"""The update both algorithms run on a rollout: ``ppo_epochs`` passes of ``minibatches``
jitted train steps, stopped early once the policy's approx KL to the rollout's passes
``target_kl``."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainer_bridge import replicate, replicated_beside


def make_optimizer(
    learning_rate: float, warmup_updates: int = 0, decay_updates: int = 0
) -> optax.GradientTransformation:
    """Adam after clipping the global gradient norm at 1, its learning rate ramped linearly from
    0 over the first ``warmup_updates`` train steps: Adam's first steps move every parameter by
    about the full learning rate whatever its gradient's size, which on a small model jumps the
    policy far from the one that sampled the rollout (approx KL > 1 on the first step). With
    ``decay_updates``, it then falls along a cosine to 0 over that many more steps, so a
    policy that has found its answers stops being pushed around by the noise of its groups."""
    if decay_updates:
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, warmup_updates, warmup_updates + decay_updates
        )
    elif warmup_updates:
        schedule = optax.linear_schedule(0.0, learning_rate, warmup_updates)
    else:
        schedule = learning_rate
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))


# loss_fn(trained, minibatch) -> (loss, stats); stats has "approx_kl", measured on the params
# the step starts from (before its own update).
LossFn = Callable[[dict[str, Any], dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


def make_train_step(
    loss_fn: LossFn, optimizers: dict[str, tuple[str, optax.GradientTransformation]], target_kl: float | None = None
):
    """``train_step(trees, minibatch, frozen=None) -> (trees, stats)``, jitted.

    ``optimizers`` maps each trained tree's key in ``trees`` to (the key of its optimizer state,
    the optimizer). ``trees`` is donated: the step overwrites it in place. ``frozen`` (a LoRA
    run's base params), when given, reaches ``loss_fn`` as ``frozen=``: not donated, and no
    gradient is taken with respect to it. With ``target_kl``,
    a step whose starting policy is already further than ``target_kl`` from the rollout's
    applies nothing (``stats["kl_stop"]`` is 1): the caller then stops.

    The returned trees are placed as the given ones (one program per placement), so later steps
    run the first step's program; fresh leaves are placed first (:func:`place_fresh_leaves`).
    """

    def step(trees, minibatch, frozen=None):
        trained = {name: trees[name] for name in optimizers}
        loss = loss_fn if frozen is None else partial(loss_fn, frozen=frozen)
        (_, stats), grads = jax.value_and_grad(loss, has_aux=True)(trained, minibatch)
        new = dict(trees)
        for name, (state_key, optimizer) in optimizers.items():
            updates, new[state_key] = optimizer.update(grads[name], trees[state_key], trees[name])
            new[name] = optax.apply_updates(trees[name], updates)
            stats["grad_norm" if name == "params" else f"{name}_grad_norm"] = optax.global_norm(grads[name])
        if target_kl is not None:
            stop = stats["approx_kl"] > target_kl
            new = jax.tree_util.tree_map(lambda n, o: jnp.where(stop, o, n), new, trees)
            stats["kl_stop"] = stop.astype(jnp.float32)
        return new, stats

    # Without out_shardings XLA picks the outputs' shardings (for params placed on the engine's
    # mesh, a mesh of its own), and the next step, given those, compiles the whole step again.
    programs = {}

    def train_step(trees, minibatch, frozen=None):
        trees = place_fresh_leaves(trees)
        leaves, treedef = jax.tree_util.tree_flatten(trees)
        if all(_is_placed(leaf) for leaf in leaves):
            shardings = tuple(leaf.sharding for leaf in leaves)
            placement, out_shardings = (treedef, shardings), (treedef.unflatten(shardings), None)
        else:  # not all placed (plain arrays): the outputs go where the step puts them
            placement, out_shardings = None, None
        if placement not in programs:
            programs[placement] = jax.jit(step, donate_argnums=0, out_shardings=out_shardings)
        return programs[placement](trees, minibatch, frozen)

    return train_step


def _is_placed(leaf) -> bool:
    return isinstance(leaf, jax.Array) and leaf.committed


def place_fresh_leaves(trees):
    """``trees`` with each array made without a device (Adam's fresh step count) replicated
    beside the first placed leaf (:func:`trainer_bridge.replicated_beside`); as given where
    every leaf or none is placed, or the placed leaf's sharding has no mesh."""
    leaves = jax.tree_util.tree_leaves(trees)
    placed = [leaf for leaf in leaves if _is_placed(leaf)]
    if not placed or len(placed) == len(leaves):
        return trees
    replicated = replicated_beside(placed[0].sharding)
    if replicated is None:
        return trees

    def place(leaf):
        if not isinstance(leaf, jax.Array) or leaf.committed:
            return leaf
        return replicate(leaf, replicated)

    return jax.tree_util.tree_map(place, trees)


def run_updates(
    train_step, trees: dict, data: dict[str, jax.Array], *, epochs: int, minibatches: int, seed: int, step: int
) -> tuple[dict, dict, dict]:
    """``epochs`` shuffled passes over the rows of ``data`` in ``minibatches`` parts.

    Returns the trees, the statistics of the last train step (for a step made with
    ``target_kl``, its ``kl_stop`` is 1 when the KL stopped the passes early) plus ``updates`` (the train steps
    that applied their update), and the statistics of the first train step (measured before
    any update). The shuffle depends on (seed, step) only: a resumed run repeats it.
    """
    rows = next(iter(data.values())).shape[0]
    if not 1 <= minibatches <= rows:
        raise ValueError(f"minibatches must be in [1, {rows}] (the rollout's rows), got {minibatches}")
    rng = np.random.default_rng([seed, step])
    updates, first = 0, None
    for _ in range(epochs):
        parts = np.array_split(rng.permutation(rows), minibatches) if minibatches > 1 else [None]
        for part in parts:
            minibatch = data if part is None else {k: v[jnp.asarray(part)] for k, v in data.items()}
            trees, stats = train_step(trees, minibatch)
            first = stats if first is None else first
            if "kl_stop" in stats and float(stats["kl_stop"]):
                return trees, {**stats, "updates": updates}, first
            updates += 1
    return trees, {**stats, "updates": updates}, first
