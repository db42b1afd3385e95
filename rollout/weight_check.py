"""Weight checksums and test perturbations computed on device (the server's admin routes)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trainer_bridge import non_finite_leaves

_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_sum(x: jax.Array) -> jax.Array:
    """Sum of the leaf's bit patterns as uint32, modulo 2**32: exact, so the same on every
    device layout and in every process."""
    width = jnp.dtype(x.dtype).itemsize
    if width == 8:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, _UINT_OF_WIDTH[width]).astype(jnp.uint32)
    return jnp.sum(bits, dtype=jnp.uint32)


# One call per leaf: the leaves need not share devices.
_leaf_sum_jit = jax.jit(_leaf_sum)


def weights_checksum(paths: Sequence[str], leaves: Sequence[jax.Array]) -> str:
    """Hex digest over (path, dtype, shape, per-leaf bit sum) in the given order."""
    sums = jax.device_get([_leaf_sum_jit(leaf) for leaf in leaves])
    digest = hashlib.sha256()
    for path, leaf, total in zip(paths, leaves, sums):
        digest.update(f"{path}:{jnp.dtype(leaf.dtype).name}:{tuple(leaf.shape)}:{int(total)};".encode())
    return digest.hexdigest()[:32]


def _add_noise(x, seed, index, scale):
    noise = jax.random.normal(jax.random.fold_in(jax.random.key(seed), index), x.shape, jnp.float32)
    return (x.astype(jnp.float32) + scale * noise).astype(x.dtype)


# Seed, index and scale are traced: perturbing again (the serving load's swaps) compiles nothing.
_add_noise_jit = jax.jit(_add_noise)


def perturbed(leaf: jax.Array, seed: int, index: int, scale: float) -> jax.Array:
    """``leaf + scale * normal(fold_in(key(seed), index))`` with the leaf's dtype and sharding."""
    with np.errstate(over="ignore"):  # a scale beyond float32 is inf: the caller's finiteness check refuses it
        factor = np.float32(scale)
    out = _add_noise_jit(leaf, np.uint32(seed), np.uint32(index), factor)
    return out if out.sharding == leaf.sharding else jax.device_put(out, leaf.sharding)


def non_finite(paths: Sequence[str], leaves: Sequence[jax.Array]) -> list[str]:
    """The paths of the leaves holding a NaN or an inf."""
    return [paths[i] for i in non_finite_leaves(leaves, one_call=False)]  # perturbs vary num_leaves
