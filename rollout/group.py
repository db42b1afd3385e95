"""The engines of this process as one group: start-up and close, which are live, how a
generate call's rows are split over them and merged back, and where a trainer tree must live
so that every engine can use it (the group mesh: an axis over the engines)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .config import WorkerConfig
from .engine import EngineError, EngineHandle, GenerateOutput
from .sampling import SamplingParams
from .weights import EngineWeights

logger = logging.getLogger(__name__)

# (engine weights, the engine's global rows, (prompts, params, seeds) it is submitted)
Part = tuple[EngineWeights, list[int], tuple]


class EngineGroup:
    """``config.dp_size`` engines, each on its own ``tp_size`` devices, started one at a time;
    every engine's weights side (:class:`EngineWeights`) in engine order."""

    def __init__(self, config: WorkerConfig, device_groups: Sequence[Sequence[jax.Device]]):
        engines: list[EngineHandle] = []
        try:
            # One at a time: engine start-up touches process-global state (config caches,
            # jax flags) that is not safe to share between concurrent start-ups.
            for index, devices in enumerate(device_groups):
                engines.append(EngineHandle(config.engine_options(devices, index)))
            self.weights = [EngineWeights(engine) for engine in engines]
        except BaseException:
            for engine in engines:
                engine.close()
            raise
        self.engines = tuple(engines)
        # Axis "replica" over the engines, then each engine's own mesh axes.
        self.mesh = Mesh(
            np.stack([engine.mesh.devices for engine in engines]), ("replica", *engines[0].mesh.axis_names)
        )

    @property
    def first(self) -> EngineWeights:
        return self.weights[0]

    @property
    def devices(self) -> list[jax.Device]:
        return [d for engine in self.engines for d in engine.devices]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def live(self) -> list[EngineWeights]:
        """The engines still running (an engine whose thread failed stays failed); raises the
        first engine's own error when none is."""
        live = [w for w in self.weights if w.engine.alive]
        if not live:
            self.first.engine.check_alive()
        return live

    # ---- placement ---------------------------------------------------------------------------

    def across_engines(self, sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
        """The sharding that gives every engine's devices the slices that ``sharding`` gives
        the first engine's (``sharding`` itself with one engine)."""
        if len(self.engines) == 1:
            return sharding
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        return NamedSharding(self.mesh, spec)

    def param_shardings(self) -> dict[str, jax.sharding.Sharding]:
        """Flat trainer path -> where the leaf must live for every engine to use it as it is."""
        return {path: self.across_engines(s) for path, s in self.first.param_shardings().items()}

    def checkpoint_targets(self, saved: Mapping[str, object], item_dir) -> dict[str, jax.ShapeDtypeStruct]:
        """Restore targets for a saved tree, placed across every engine."""
        return {
            p: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=self.across_engines(t.sharding))
            for p, t in self.first.checkpoint_targets(saved, item_dir).items()
        }

    # ---- generate fan-out --------------------------------------------------------------------

    def split(self, prompts: list[list[int]], params: SamplingParams, seeds: np.ndarray) -> list[Part]:
        """(engine, its global rows, (prompts, params, seeds)) per live engine with work:
        whole prompts (their n samples together), balanced by tokens."""
        n = params.n
        live = self.live()
        load = [0] * len(live)
        assigned: list[list[int]] = [[] for _ in live]
        cost = [len(p) + params.max_new_tokens for p in prompts]
        for i in sorted(range(len(prompts)), key=lambda i: -cost[i]):
            target = load.index(min(load))
            assigned[target].append(i)
            load[target] += cost[i]
        parts = []
        for weights, indices in zip(live, assigned):
            if indices:
                indices.sort()
                rows = [i * n + j for i in indices for j in range(n)]
                parts.append((weights, rows, ([prompts[i] for i in indices], params, seeds[indices])))
        return parts


def merge(parts: list[tuple[list[int], list[GenerateOutput]]]) -> list[GenerateOutput]:
    """Per-engine outputs back into global row order."""
    total = sum(len(rows) for rows, _ in parts)
    merged: list[GenerateOutput | None] = [None] * total
    for rows, outputs in parts:
        if len(outputs) != len(rows):
            raise EngineError(f"an engine returned {len(outputs)} outputs for {len(rows)} requests")
        for row, output in zip(rows, outputs):
            merged[row] = output
    return merged
