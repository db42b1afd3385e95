"""The engines of this process as one group: start-up and close, which are live, how a
generate call's rows are split over them and merged back, and where a trainer tree must live
so that every engine can use it (the group mesh: an axis over the engines). The group answers
for every engine what one engine answers (a sync's prepare and commit, a generate's future,
KV drop and rebuild, liveness), keyed by engine index, so the worker calls it once.

In a multi-process job the group mesh is global: its ``replica`` axis runs over every engine
of every process (process order), so one placement serves all engines of all hosts, and a
tree spread over hosts reaches every engine through one collective reshard (:meth:`localize`).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import threading
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer_bridge.sync import device_order, listed_shards, relabel

from . import kv, stream
from .config import WorkerConfig
from .engine import EngineError, EngineHandle, GenerateOutput
from .kv import KvReport, MemoryReport
from .pod import Pod, PodError
from .sampling import SamplingParams
from .weights import EngineWeights, PreparedSync

logger = logging.getLogger(__name__)

# (engine weights, the engine's global rows, (prompts, params, seeds) it is submitted)
Part = tuple[EngineWeights, list[int], tuple]


class EngineGroup:
    """``config.dp_size`` engines, each on its own ``tp_size`` devices, started one at a time;
    every engine's weights side (:class:`EngineWeights`) in engine order. ``pod`` is this
    process's place in the job (one process: nothing is exchanged)."""

    def __init__(self, config: WorkerConfig, device_groups: Sequence[Sequence[jax.Device]], pod: Pod):
        self.pod = pod
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
        try:
            self.mesh = self._global_mesh()
        except BaseException:
            self.close()
            raise
        self._reshard_fns: dict[tuple, object] = {}

    def _global_mesh(self) -> Mesh:
        """Axis ``replica`` over the engines of every process, then each engine's own mesh axes.
        Every process must start the same engines (same model shapes, dp_size, tp_size)."""
        first = self.engines[0]
        layout = (
            len(self.engines),
            first.mesh.devices.shape,
            [(w.path, w.shape, str(w.dtype)) for w in self.first.leaves],
        )
        fingerprint = hashlib.sha256(repr(layout).encode()).hexdigest()[:16]
        mine = [[d.id for d in engine.mesh.devices.flat] for engine in self.engines]
        payloads = self.pod.agree("RolloutWorker start-up", fingerprint, json.dumps(mine))
        by_id = {d.id: d for d in jax.devices()}
        grids = [
            np.array([by_id[i] for i in ids]).reshape(first.mesh.devices.shape)
            for p in payloads
            for ids in json.loads(p)
        ]
        return Mesh(np.stack(grids), ("replica", *first.mesh.axis_names))

    @property
    def first(self) -> EngineWeights:
        return self.weights[0]

    @property
    def devices(self) -> list[jax.Device]:
        return [d for engine in self.engines for d in engine.devices]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def live(self) -> dict[int, EngineWeights]:
        """The engines still running, by index (an engine whose thread failed stays failed);
        raises the first engine's own error when none is."""
        live = {index: w for index, w in enumerate(self.weights) if w.engine.alive}
        if not live:
            self.first.engine.check_alive()
        return live

    def dead_leaves(self) -> dict[int, list[str]]:
        """Per running engine whose weights' buffers were freed (donated by the trainer): their
        paths."""
        return {index: dead for index, w in enumerate(self.weights) if w.engine.alive and (dead := w.dead_leaves())}

    def weight_leaves(self) -> dict[int, list]:
        """Every running engine's current weight leaves (engine leaf order), by engine index."""
        return {index: engine.weight_leaves() for index, engine in enumerate(self.engines) if engine.alive}

    # ---- weight changes (the caller holds the worker's locks) ------------------------------------

    def prepare(
        self,
        trees: Sequence[Mapping[str, object]],
        *,
        allow_cast: bool,
        check_finite: bool,
        origins: Mapping[str, object] | None = None,
    ) -> dict[int, PreparedSync]:
        """Every running engine's new leaves from its tree (:meth:`localize`), by engine index.
        Changes nothing the engines serve. ``origins``: the tree :meth:`localize` was given,
        whose arrays a later sync may pass again (its views of them are new each time)."""
        return {
            index: w.prepare(trees[index], allow_cast=allow_cast, check_finite=check_finite, origins=origins)
            for index, w in self.live().items()
        }

    def commit(
        self, prepared: Mapping[int, PreparedSync], version: int, *, in_flight: bool, recompute_kv: bool
    ) -> list[int]:
        """Swap the prepared leaves in, engine by engine (:meth:`EngineWeights.commit`). The
        engines serve one version: once one has committed, an engine that fails to commit is
        failed (if its failure has not already failed it) and skipped, as a failed engine is
        by every later call, and the others go on (had they stopped there, the engines before
        it would serve a version the worker does not report). A failure before any engine
        committed is raised with nothing changed. Returns the engines that committed; raises
        the first failure if none did."""
        committed, failure = [], None
        for index, update in prepared.items():
            weights = self.weights[index]
            try:
                weights.commit(update, version, in_flight=in_flight, recompute_kv=recompute_kv)
            except Exception as exc:
                if weights.engine.alive:
                    if not committed:
                        raise
                    weights.engine.fail(exc)
                logger.error("engine %d failed to take weight version %d: %r", index, version, exc)
                failure = failure or exc
            else:
                committed.append(index)
        if not committed and failure is not None:
            raise failure
        return committed

    def replace_leaves(
        self, new_leaves: Mapping[int, Mapping[int, jax.Array]], version: int, *, in_flight: bool
    ) -> None:
        """Swap engine-owned arrays in: engine index -> leaf index -> array (every engine's
        layout checked before any swaps). Engines no longer running are skipped."""
        prepared = {
            index: weights.replacement(new_leaves[index])
            for index, weights in self.live().items()
            if index in new_leaves
        }
        self.commit(prepared, version, in_flight=in_flight, recompute_kv=False)

    def release_aliased(self) -> None:
        """Every running engine drops its references to the trainer's buffers."""
        for weights in self.live().values():
            weights.release_aliased()

    # ---- KV cache and memory -----------------------------------------------------------------

    def drop_kv(self) -> dict[int, KvReport]:
        """Free every running engine's KV buffers and prefix cache, and what a failed one still
        holds (its KV buffers and the weights it owns: the trainer shares its devices); reports
        by engine index. An engine that fails during its drop counts as failed: the others'
        drops stand, and the worker sees them dropped."""
        reports = {}
        for index, w in enumerate(self.weights):
            if w.engine.alive:
                try:
                    reports[index] = kv.drop_kv(w.engine)
                    continue
                except EngineError:
                    if w.engine.alive:
                        raise
            reports[index] = kv.free_failed_kv(w.engine)
            w.free_owned()
        self.live()  # with no engine running, its error: after freeing what the failed ones held
        return reports

    def rebuild_kv(self) -> dict[int, KvReport]:
        """Recreate every running engine's KV buffers; reports by engine index."""
        return {index: kv.rebuild_kv(w.engine) for index, w in self.live().items()}

    def memory(self) -> MemoryReport:
        """Device bytes of weights and KV per engine, and of all live arrays per device."""
        engines, all_weights = [], {}
        for weights in self.weights:
            buffers = weights.device_buffers()
            all_weights.update(buffers)
            engines.append(kv.engine_memory(weights.engine, buffers))
        devices = self.devices
        names = {d.id: str(d) for d in devices}
        per_device = dict.fromkeys(names.values(), 0)
        for (device_id, _), nbytes in kv.live_device_buffers(devices).items():
            per_device[names[device_id]] += nbytes
        kv_bytes = sum(e.kv_bytes for e in engines)
        return MemoryReport(sum(all_weights.values()), kv_bytes, per_device, tuple(engines))

    # ---- placement ---------------------------------------------------------------------------

    def across_engines(self, sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
        """The sharding that gives every engine's devices the slices that ``sharding`` gives
        the first engine's (``sharding`` itself with one engine)."""
        if self.mesh.devices.shape[0] == 1:
            return sharding
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        return NamedSharding(self.mesh, spec)

    def param_shardings(self, adapters: bool = False) -> dict[str, jax.sharding.Sharding]:
        """Flat trainer path -> where the leaf must live for every engine to use it as it is
        (``adapters``: the unmerged adapters' paths instead of the base tree's)."""
        return {path: self.across_engines(s) for path, s in self.first.param_shardings(adapters).items()}

    def checkpoint_targets(
        self, saved: Mapping[str, object], item_dir, adapters_only: bool = False
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """Restore targets for a saved tree, placed across every engine."""
        return {
            p: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=self.across_engines(t.sharding))
            for p, t in self.first.checkpoint_targets(saved, item_dir, adapters_only).items()
        }

    def localize(self, flat: Mapping[str, object], call: str) -> tuple[list[Mapping[str, object]], int]:
        """(the tree each engine syncs from, bytes the cross-process reshard wrote on this
        process's devices). One process: ``flat`` for every engine, 0. Several: leaves spread
        over processes are first resharded to :meth:`param_shardings` in one collective (every
        process runs it: the caller checked the SPMD rule), then each engine gets views of its
        own devices' buffers, so what follows is local to each engine. With unmerged adapters, a
        base leaf every engine serves from that very array stays as given: the sync keeps it
        (:meth:`EngineWeights.prepare`), so neither reshard nor views are made of it."""
        if not self.pod.multi_process:
            return [flat] * len(self.weights), 0
        adapters = {path: self.across_engines(s) for path, s in self.first.adapter_targets().items()}
        targets = {**self.param_shardings(), **adapters}
        served = frozenset()
        if adapters:
            # Every process must reshard the same leaves, so those every process serves stay: one
            # whose trainer passed a new array where the others passed the served one reshards it
            # with them (its engines still keep what they serve, by the trainer's array).
            paths = sorted(flat)
            here = frozenset.intersection(*(w.served_base(flat) for w in self.live().values()))
            payloads = self.pod.agree(
                f"{call} (served base)", payload=",".join(str(i) for i, p in enumerate(paths) if p in here)
            )
            served = frozenset(
                paths[int(i)] for i in set.intersection(*(set(filter(None, x.split(","))) for x in payloads))
            )
        moving = [
            p
            for p, x in flat.items()
            if isinstance(x, jax.Array)
            and not x.is_fully_addressable
            and p in targets
            and p not in served
            # Shards jax cannot list (listed_shards) make no views; a jitted identity takes them.
            and (not x.sharding.is_equivalent_to(targets[p], x.ndim) or listed_shards(x) is None)
        ]
        flat = dict(flat)
        gathered = 0
        if moving:
            out = self._reshard(tuple(targets[p] for p in moving), [flat[p] for p in moving], call)
            for p, x in zip(moving, out):
                flat[p] = x
                gathered += sum(s.data.nbytes for s in x.addressable_shards)
        trees = []
        for weights in self.weights:
            mesh = weights.engine.mesh
            trees.append(
                {
                    p: relabel(x, NamedSharding(mesh, x.sharding.spec))
                    if p not in served and _on_group_mesh(x, self.mesh)
                    else x
                    for p, x in flat.items()
                }
            )
        return trees, gathered

    def _reshard(self, shardings: tuple, arrays: list, call: str) -> list[jax.Array]:
        """One jitted identity whose out_shardings are ``shardings``: XLA moves the bytes with
        collectives over every process. A lost process fails the collective (its sockets close):
        PodError naming it, after the survivors compare notes (at most ``pod.timeout_s``).

        jit takes no argument whose devices are ordered otherwise than its results' (a trainer
        mesh from ``jax.make_mesh`` or ``mesh_utils`` on a TPU often is): those arrays go through
        ``jax.device_put``, which reorders their shards first, compiled at the call (so not
        before every process is ready: a compile longer than the collectives' wait fails it).
        Arrays on other devices stay in the jitted identity, whose compile refuses them on every
        process alike."""
        reordered = [
            i
            for i, (x, s) in enumerate(zip(arrays, shardings))
            if device_order(x.sharding) != device_order(s) and set(device_order(x.sharding)) == set(device_order(s))
        ]
        jitted = sorted(set(range(len(arrays))) - set(reordered))
        same_order = [arrays[i] for i in jitted]
        key = (tuple(shardings[i] for i in jitted), tuple((x.shape, x.dtype, x.sharding) for x in same_order))

        def compiled():
            if key not in self._reshard_fns and jitted:
                self._reshard_fns[key] = jax.jit(lambda *xs: xs, out_shardings=key[0]).lower(*same_order).compile()
            return self._reshard_fns.get(key)

        # Compiled everywhere first, then started together: the CPU collectives (gloo) give a
        # peer 30 s to join, less than a compile may take on a loaded host. A process whose
        # compile fails says so: the others raise at once rather than wait in the collective.
        fn = self.pod.settle(f"{call} (reshard)", compiled)
        try:
            out = dict(zip(jitted, fn(*same_order))) if jitted else {}
            out |= {i: jax.device_put(arrays[i], shardings[i]) for i in reordered}
            return jax.block_until_ready([out[i] for i in range(len(arrays))])
        except Exception as exc:  # the runtime's own error type differs between jax versions
            lost = self.pod.lost_processes(call)
            raise PodError(
                f"{call}: the cross-process reshard failed; "
                f"{f'process(es) {list(lost)} lost' if lost else 'no process lost'} "
                f"({type(exc).__name__}: {str(exc)[:300]}). Restart the job and resume from the last "
                "checkpoint (docs/pods.md).",
                lost,
            ) from exc

    # ---- generate fan-out --------------------------------------------------------------------

    def submit(self, prompts: list[list[int]], params: SamplingParams, seeds: np.ndarray) -> concurrent.futures.Future:
        """A generate call's rows on the running engines (:meth:`split`): one future of every
        row's output in global row order, done when every engine is done with its rows (so a
        caller holding off weight changes until then holds them off while any row runs); its
        error is the first failing engine's. Cancelling it cancels the engines' requests."""
        parts = self.split(prompts, params, seeds)
        return _merged([(rows, weights.engine.submit(*part)) for weights, rows, part in parts])

    def astream(
        self, prompts: list[list[int]], params: SamplingParams, seeds: np.ndarray
    ) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """A generate call's rows on the running engines, streamed: ``(global row, output so
        far)`` as tokens arrive (:func:`rollout.stream.merged`)."""
        parts = self.split(prompts, params, seeds)
        return stream.merged([(rows, weights.engine.astream(*part)) for weights, rows, part in parts])

    def split(self, prompts: list[list[int]], params: SamplingParams, seeds: np.ndarray) -> list[Part]:
        """(engine, its global rows, (prompts, params, seeds)) per live engine with work:
        whole prompts (their n samples together), balanced by tokens."""
        n = params.n
        if params.session is not None:  # one prompt: on the session's engine, where its prefix is
            return [(self.session_engine(params.session), list(range(n)), (prompts, params, seeds))]
        live = list(self.live().values())
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

    def session_engine(self, session: str) -> EngineWeights:
        """The engine that runs a session's calls: one of all the engines, by the key, so that a
        session stays where its prefix is while its engine lives (another live one after)."""
        chosen = zlib.crc32(session.encode()) % len(self.weights)
        live = self.live()
        if chosen in live:
            return live[chosen]
        others = sorted(live)
        return live[others[chosen % len(others)]]


def _on_group_mesh(x, mesh: Mesh) -> bool:
    return isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh


def _merged(parts: list[tuple[list[int], concurrent.futures.Future]]) -> concurrent.futures.Future:
    """One future of the engines' futures, their outputs merged (:func:`merge`) once all are done."""
    merged: concurrent.futures.Future = concurrent.futures.Future()
    pending = len(parts)
    lock = threading.Lock()

    def cancel_parts(_):
        if merged.cancelled():
            for _, future in parts:
                future.cancel()

    def part_done(_):
        nonlocal pending
        with lock:
            pending -= 1
            if pending:
                return
        if not merged.set_running_or_notify_cancel():  # cancelled: nobody waits for the outputs
            return
        try:
            merged.set_result(merge([(rows, future.result()) for rows, future in parts]))
        except BaseException as exc:  # whatever it is, the waiter must wake up with it
            merged.set_exception(exc)

    merged.add_done_callback(cancel_parts)
    for _, future in parts:
        future.add_done_callback(part_done)
    return merged


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
