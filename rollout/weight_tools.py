"""The admin weight tools over an engine group: a checksum of the weights served and a
deterministic perturbation of them (the server's admin routes, tests of the update path), and
the checks of a weight change's arguments that the worker and the admin routes share."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trainer_bridge import non_finite_leaves
from trainer_bridge.sync import EngineLeaf

from .errors import InvalidRequest
from .group import EngineGroup
from .sampling import as_int

# The perturbation's seed is a traced uint32 (one compile for all seeds).
MAX_PERTURB_SEED = 2**32 - 1


def check_flags(**flags) -> None:
    """Each of a weight call's flags is a bool (numpy's too): any other value is an InvalidRequest
    naming it. Taken by its truth value, ``check_finite=None`` served NaN weights unchecked and
    ``in_flight="no"`` swapped in flight."""
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise InvalidRequest(name, f"{name} must be a bool, got {value!r:.80} ({type(value).__name__})")


def check_swap_mode(in_flight: bool, recompute_kv: bool, **flags) -> None:
    """A weight change's swap mode, and its other ``flags`` (``check_finite``, ...), checked."""
    check_flags(in_flight=in_flight, recompute_kv=recompute_kv, **flags)
    if recompute_kv and not in_flight:
        raise InvalidRequest(
            "recompute_kv", "recompute_kv=True needs in_flight=True: a drain swap has no running request to recompute"
        )


def perturb_seed(seed) -> int:
    """A perturbation's seed, checked (InvalidRequest naming ``seed``)."""
    seed = as_int("seed", seed, minimum=0)
    if seed > MAX_PERTURB_SEED:
        raise InvalidRequest("seed", f"seed must be in [0, {MAX_PERTURB_SEED}], got {seed}")
    return seed


def _weight_leaves(group: EngineGroup) -> list[EngineLeaf]:
    """The leaves the tools read and change: the weights, not the engine's RNG state."""
    return [leaf for leaf in group.first.leaves if not leaf.engine_state]


def checksum_report(group: EngineGroup, version: int) -> dict:
    """``checksum`` (hex, of the first live engine), ``weight_version``, ``leaves`` and, with
    several engines, ``per_engine``. The caller holds off swaps (they free the leaves read)."""
    weights = _weight_leaves(group)
    paths = [w.path for w in weights]
    sums = [weights_checksum(paths, [arrays[w.index] for w in weights]) for arrays in group.weight_leaves().values()]
    report = {"checksum": sums[0], "weight_version": version, "leaves": len(weights)}
    if len(sums) > 1:
        report["per_engine"] = sums
    return report


@dataclasses.dataclass(frozen=True)
class Perturbation:
    """``scale * normal(key(seed, i))`` added to the first ``num_leaves`` weight leaves."""

    seed: int
    scale: float
    leaves: tuple[EngineLeaf, ...]

    @classmethod
    def checked(cls, group: EngineGroup, seed, scale, num_leaves) -> Perturbation:
        weights = _weight_leaves(group)
        seed = perturb_seed(seed)
        if isinstance(num_leaves, bool) or not isinstance(num_leaves, int) or not 1 <= num_leaves <= len(weights):
            raise InvalidRequest("num_leaves", f"num_leaves must be an int in [1, {len(weights)}], got {num_leaves!r}")
        if not math.isfinite(scale):
            raise InvalidRequest("scale", f"scale must be a finite number, got {scale!r}")
        return cls(seed, float(scale), tuple(weights[:num_leaves]))

    @property
    def paths(self) -> list[str]:
        return [w.path for w in self.leaves]

    def new_leaves(self, group: EngineGroup, *, check_finite: bool) -> list[dict[int, jax.Array]]:
        """The perturbed leaves (leaf index -> array) of every engine, as
        ``RolloutWorker._replace_engine_leaves`` takes them (none for an engine no longer
        running). Non-finite results are refused as a sync refuses them (judged on one engine's:
        every engine holds the same weights)."""
        current = group.weight_leaves()
        new = [self._applied(current[e]) if e in current else {} for e in range(len(group.engines))]
        if check_finite and current:
            perturbed = new[next(iter(current))]
            bad = non_finite(self.paths, [perturbed[w.index] for w in self.leaves])
            if bad:
                message = f"the perturbation makes weights non-finite (nan/inf) in: {', '.join(bad[:8])}"
                raise InvalidRequest("scale", message)
        return new

    def _applied(self, arrays: list) -> dict[int, jax.Array]:
        """One engine's perturbed leaves from its current ones, by leaf index."""
        seed, scale = self.seed, self.scale
        return {w.index: perturbed(arrays[w.index], seed, i, scale) for i, w in enumerate(self.leaves)}


# ---- on the device: one leaf's bit sum, its noise ------------------------------------------

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
