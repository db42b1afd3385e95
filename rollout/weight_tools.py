"""The admin weight tools over an engine group: a checksum of the weights served and a
deterministic perturbation of them (the server's admin routes, tests of the update path), and
the checks of a weight change's arguments that the worker and the admin routes share."""

from __future__ import annotations

import dataclasses
import math

import jax

from trainer_bridge import EngineLeaf

from . import weight_check
from .errors import InvalidRequest
from .group import EngineGroup
from .sampling import as_int

# The perturbation's seed is a traced uint32 (one compile for all seeds).
MAX_PERTURB_SEED = 2**32 - 1


def check_swap_mode(in_flight: bool, recompute_kv: bool) -> None:
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
    sums = [
        weight_check.weights_checksum(paths, [arrays[w.index] for w in weights])
        for arrays in group.weight_leaves().values()
    ]
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
        ``RolloutWorker.replace_engine_leaves`` takes them (none for an engine no longer
        running). Non-finite results are refused as a sync refuses them (judged on one engine's:
        every engine holds the same weights)."""
        current = group.weight_leaves()
        new = [self._applied(current[e]) if e in current else {} for e in range(len(group.engines))]
        if check_finite and current:
            perturbed = new[next(iter(current))]
            bad = weight_check.non_finite(self.paths, [perturbed[w.index] for w in self.leaves])
            if bad:
                message = f"the perturbation makes weights non-finite (nan/inf) in: {', '.join(bad[:8])}"
                raise InvalidRequest("scale", message)
        return new

    def _applied(self, arrays: list) -> dict[int, jax.Array]:
        """One engine's perturbed leaves from its current ones, by leaf index."""
        seed, scale = self.seed, self.scale
        return {w.index: weight_check.perturbed(arrays[w.index], seed, i, scale) for i, w in enumerate(self.leaves)}
