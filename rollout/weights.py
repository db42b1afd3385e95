"""One engine's weights: its leaf table, the mapping from trainer paths, sync plans, and which
leaves the engine owns (as opposed to trainer buffers it aliases)."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from models import EngineTransform, ParamMapping, mappings_for
from trainer_bridge import SyncError
from trainer_bridge.lora import adapter_mappings
from trainer_bridge.sync import EngineLeaf, SyncPlan, build_plan, plan_key
from trainer_bridge.tree import path_mismatch

from .engine import EngineHandle, device_buffers, in_slot

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreparedSync:
    """New engine leaves computed for a sync, not yet swapped in."""

    plan: SyncPlan
    leaves: list  # the whole new leaf list, engine order
    updated: frozenset[int]  # indices replaced
    copied: frozenset[int]  # of which new arrays the engine owns
    # Of the updated: the trainer arrays they came from, checked for NaN/inf (jax arrays only:
    # immutable, so the same object passed again holds the same values).
    sources: Mapping[int, weakref.ref] = dataclasses.field(default_factory=dict)
    relabeled: int = 0  # of the updated, trainer arrays wrapped in the engine's sharding object


class EngineWeights:
    """The weight side of one engine. Reading the tables is free; changing weights goes
    through :meth:`prepare` (no engine state touched) and :meth:`commit` (the swap)."""

    def __init__(self, engine: EngineHandle):
        self.engine = engine
        self.leaves: tuple[EngineLeaf, ...] = tuple(engine.leaf_specs())
        self.mappings: tuple[ParamMapping, ...] = tuple(mappings_for(engine.hf_config))
        # Adapters the engine computes unmerged (EngineOptions.unmerged_lora), else none: the
        # default slot's (``<module>.lora_a``), and each other slot's under its suffixed names
        # (``<module>.lora_a_1``: engine.in_slot), which the worker gives their trees.
        lora = engine.options.unmerged_lora
        self.adapter_mappings: tuple[ParamMapping, ...] = tuple(adapter_mappings(self.mappings, lora) if lora else ())
        self._slot_mappings = [self.adapter_mappings] + [
            tuple(
                dataclasses.replace(m, trainer=in_slot(m.trainer, slot), engine=in_slot(m.engine, slot))
                for m in self.adapter_mappings
            )
            for slot in range(1, engine.options.max_loras)
        ]
        self._slot_paths = [frozenset(m.trainer for m in slot) for slot in self._slot_mappings]
        # Each adapted module's (A, B) trainer paths, in every slot.
        self._factor_pairs = [
            (in_slot(m.trainer, slot), in_slot(m.trainer.removesuffix(".lora_a") + ".lora_b", slot))
            for slot in range(engine.options.max_loras)
            for m in self.adapter_mappings
            if m.trainer.endswith(".lora_a")
        ]
        self._adapter_paths = frozenset().union(*self._slot_paths)
        config = engine.hf_config
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self._by_path = {leaf.path: leaf for leaf in self.leaves}
        # A k/v projection's width in the trainer's layout: the model's KV heads, which the
        # engine repeats when tp_size exceeds them.
        self._kv_width = engine.num_key_value_heads * self.head_dim
        # Per trainer path: the engine leaf it is used as unchanged, or None when the sync
        # transforms it (transpose; k/v projections whose heads the engine repeats).
        self.used_as_is: dict[str, EngineLeaf | None] = {
            m.trainer: self._by_path[m.engine] if self._as_is(m) else None
            for m in self.mappings + self.adapter_mappings
        }
        self._plans: dict[tuple, SyncPlan] = {}
        self._checked_plans: set[SyncPlan] = set()
        # Leaf indices whose current array belongs to the engine (boot weights, sync copies):
        # those are freed as soon as they are replaced.
        self._owned = set(range(len(self.leaves)))
        # Leaf index -> the trainer array its current leaf was synced from, checked for NaN/inf
        # (weakly: the engine must not keep a trainer's released or copied arrays alive).
        self._sources: dict[int, weakref.ref] = {}

    # ---- sync --------------------------------------------------------------------------------

    def adapters_only(self, flat: Mapping[str, object]) -> bool:
        """Whether ``flat`` holds unmerged adapters alone (synced onto the served base)."""
        return bool(self._adapter_paths) and bool(flat) and all(path in self._adapter_paths for path in flat)

    def plan_for(self, flat: Mapping[str, object], allow_cast: bool, partial: bool = False) -> SyncPlan:
        """The plan of ``flat``: the whole tree (base, plus the adapters of an unmerged engine),
        the adapters alone, or (``partial``, already validated whole) the leaves it has."""
        key = (plan_key(flat), allow_cast, partial)  # a partial plan checks no missing paths
        plan = self._plans.get(key)
        if plan is None:
            adapters_only = self.adapters_only(flat)
            if adapters_only:
                mappings = self._slot_of(flat)
            else:
                mappings = self.mappings + self.adapter_mappings
            if partial:
                mappings = tuple(m for m in mappings if m.trainer in flat)
            leaves = build_plan(
                flat,
                self.leaves,
                mappings,
                kv_width=self._kv_width,
                allow_cast=allow_cast,
                # The other slots' adapters (several slots) keep what they serve.
                partial=partial or adapters_only or len(self._slot_mappings) > 1,
            )
            plan = self._plans[key] = SyncPlan(leaves, self.head_dim)
        return plan

    def _slot_of(self, flat: Mapping[str, object]) -> tuple[ParamMapping, ...]:
        """The adapter mappings of the slot a tree of adapters alone fills: its first path's."""
        return next(m for m, paths in zip(self._slot_mappings, self._slot_paths) if next(iter(flat)) in paths)

    def with_adapters(self, flat: Mapping[str, object]) -> Mapping[str, object]:
        """``flat`` as a sync serves it: a base tree without adapters on an engine that computes
        them unmerged is served with zero adapters (the base alone). An empty tree stays empty
        (it is no base: its plan names every path missing), where zero adapters alone would
        have been synced as the served base's new adapters."""
        if not flat or not self._adapter_paths or any(path in self._adapter_paths for path in flat):
            return flat  # adapters of its own (or a tree of adapters alone)
        zeros = {
            m.trainer: np.zeros(self._trainer_shape(m), self._by_path[m.engine].dtype) for m in self.adapter_mappings
        }
        return {**flat, **zeros}

    def kernel_paths(self) -> list[str]:
        """The trainer paths of the model's kernels: what LoRA adapters may adapt."""
        return [m.trainer for m in self._kernel_mappings()]

    def kernel_shapes(self) -> dict[str, np.ndarray]:
        """Trainer kernel path -> a stand-in of the trainer's kernel (its shape, no memory):
        what adapters are checked against when the trainer passes them without their base."""
        return {m.trainer: np.broadcast_to(np.float32(0), self._trainer_shape(m)) for m in self._kernel_mappings()}

    def _kernel_mappings(self) -> list[ParamMapping]:
        return [m for m in self.mappings if m.trainer.endswith(".kernel")]

    def _as_is(self, m: ParamMapping) -> bool:
        """Whether the engine uses ``m``'s trainer leaf unchanged: not transposed, and no KV
        heads repeated (which the engine does only when tp_size exceeds them)."""
        engine_shape = self._by_path[m.engine].shape
        return m.engine_transform is not EngineTransform.TRANSPOSE and self._trainer_shape(m) == engine_shape

    def _trainer_shape(self, m: ParamMapping) -> tuple[int, ...]:
        """The shape of ``m``'s leaf in the trainer's layout, from its engine leaf's."""
        shape = self._by_path[m.engine].shape
        if m.engine_transform is EngineTransform.TRANSPOSE:
            return tuple(reversed(shape))
        if m.engine_transform is EngineTransform.REPEAT_KV_HEADS:
            return (*shape[:-1], self._kv_width)
        return shape

    def prepare(
        self,
        flat: Mapping[str, object],
        *,
        allow_cast: bool,
        check_finite: bool,
        origins: Mapping[str, object] | None = None,
    ) -> PreparedSync:
        """Validate ``flat`` and compute the engine's new leaves (device copies where needed).
        Changes nothing the engine serves.

        A leaf passed again as the very jax array a checked sync took it from is not read for
        NaN again. With unmerged adapters, such a base leaf whose engine leaf is still served is
        also kept as it is: a sync of the same base moves the adapters alone (and after a train
        step's release, the released leaves besides). ``origins``: the trainer's arrays by path
        where ``flat`` holds new views of them (a pod's, :meth:`EngineGroup.localize`), which
        "the very jax array" is judged by."""
        flat = self.with_adapters(flat)
        origin = {**flat, **{path: x for path, x in (origins or {}).items() if path in flat}}
        plan = self.plan_for(flat, allow_cast)
        leaves = self.engine.weight_leaves()
        if self.adapters_only(flat):
            self._check_served_beside(self._slot_of(flat), leaves)
        elif kept := self.served_base(origin, leaves):
            flat = {path: leaf for path, leaf in flat.items() if path not in kept}
            plan = self.plan_for(flat, allow_cast, partial=True)
        known = frozenset(p.engine.index for p in plan.leaves if self._source(p.engine.index) is origin[p.trainer_path])
        updates = plan.execute(flat)
        if check_finite:  # what the engine would serve: a cast's overflow too
            self._check_values(plan, flat, updates, known)
        for index, array in updates.items():
            leaves[index] = array
        if plan not in self._checked_plans:
            # A plan yields the same layout every time: checked on its first run only.
            self._check_layout(leaves, updates)
            self._checked_plans.add(plan)
        jax.block_until_ready(list(updates.values()))
        copied = frozenset(p.engine.index for p in plan.copies)
        sources = {
            p.engine.index: weakref.ref(origin[p.trainer_path])
            for p in plan.leaves
            if isinstance(origin[p.trainer_path], jax.Array) and (check_finite or p.engine.index in known)
        }
        return PreparedSync(plan, leaves, frozenset(updates), copied, sources, plan.relabeled(flat, updates))

    def _check_values(self, plan: SyncPlan, flat: Mapping[str, object], updates: dict, known: frozenset) -> None:
        """NaN/inf in what the engine would serve (``plan.check_finite``), and unmerged adapters
        each finite whose product's entries may not be in the engine's dtype, to which the scaled
        term is cast: the engine would serve inf/NaN. Each entry of scale * A @ B is bounded from
        the factors' largest |value|, taken in the same read: scale * rank * max|A| * max|B| (a
        real adapter is many orders of magnitude below it). Not a bound on ``x @ A`` for large
        activations. A pair served and passed again is not read again; a factor served beside a
        new partner is."""
        index = {p.trainer_path: p.engine.index for p in plan.leaves}
        pairs = [
            (a, b) for a, b in self._factor_pairs if a in index and b in index and not {index[a], index[b]} <= known
        ]
        factors = {path for pair in pairs for path in pair}
        maxima = plan.check_finite(flat, updates, known - {index[path] for path in factors}, factors)
        lora = self.engine.options.unmerged_lora
        dtype = self.engine.options.dtype
        limit = float(jnp.finfo(dtype).max)
        bounds = {(a, b): lora.scale * lora.rank * maxima[a] * maxima[b] for a, b in pairs}
        overflowing = [pair for pair, bound in bounds.items() if bound > limit]
        if overflowing:
            raise SyncError(
                f"LoRA factors too large for the engine's {dtype}: scale * rank * max|A| * max|B| = "
                f"{bounds[overflowing[0]]:.3g} "
                f"(scale alpha / rank = {lora.scale:g}, rank {lora.rank}), past {limit:.6g}: each factor is finite, "
                "their product may not be (the engine would serve NaN), in: "
                + ", ".join(f"{a} and {b}" for a, b in overflowing[:8])
            )

    def served_base(self, flat: Mapping[str, object], leaves: list | None = None) -> frozenset[str]:
        """The base paths of ``flat`` (the trainer's arrays) that a sync with unmerged adapters
        keeps as served (:meth:`prepare`): each one's engine leaf (of ``leaves``, None: the
        engine's now) was synced from that very array and is still live."""
        if not self._adapter_paths or self.adapters_only(flat):
            return frozenset()
        leaves = self.engine.weight_leaves() if leaves is None else leaves
        indices = {m.trainer: self._by_path[m.engine].index for m in self.mappings if m.trainer in flat}
        return frozenset(path for path, i in indices.items() if self._source(i) is flat[path] and _live(leaves[i]))

    def _source(self, index: int):
        """The trainer array leaf ``index`` was last synced from (checked), if still alive."""
        ref = self._sources.get(index)
        return None if ref is None else ref()

    def _check_served_beside(self, slot: tuple[ParamMapping, ...], leaves: list) -> None:
        """Adapters alone (one slot's) need the rest served: the base and the other slots'
        adapters not released for a train step. (The sync would have left them released and
        the worker taken for synced: every call refused, blaming a donation.)"""
        own = {m.engine for m in slot}
        adapters = {m.engine for other in self._slot_mappings for m in other}
        released = [
            spec.path
            for spec, leaf in zip(self.leaves, leaves)
            if not spec.engine_state and spec.path not in own and not _live(leaf)
        ]
        base = [path for path in released if path not in adapters]
        if base:
            raise SyncError(
                f"adapters alone: the engine's base was released for a train step ({len(base)} leaves, "
                f"e.g. '{base[0]}'); sync the base with them: sync_params(base, adapters=..., lora=...)"
            )
        if released:
            raise SyncError(
                f"adapters alone: adapters the engine serves in another slot were released for a train step "
                f"or deleted ({len(released)} leaves, e.g. '{released[0]}'); sync them first (the default "
                "adapters: sync_params(base, adapters=..., lora=...) or sync_adapters(adapters))"
            )

    def commit(self, prepared: PreparedSync, version: int, *, in_flight: bool = False, recompute_kv: bool = False):
        """Swap the prepared leaves in (on the scheduler thread, between forwards: idle, or
        ``in_flight`` at the next forward boundary), flush the prefix cache, label later tokens
        with ``version``, and free the engine-owned arrays that were replaced. Returns the
        engine's :class:`~rollout.engine.SwapRecord`."""

        def served():  # recorded as the swap lands: a later failure (the engine's) must not lose it
            self._owned = set(prepared.copied) | (self._owned - prepared.updated)
            self._sources = {i: a for i, a in self._sources.items() if i not in prepared.updated} | dict(
                prepared.sources
            )

        return self.engine.replace_weight_leaves(
            prepared.leaves,
            free=self._owned & prepared.updated,
            version=version,
            in_flight=in_flight,
            recompute_kv=recompute_kv,
            on_swapped=served,
        )

    def replacement(self, new_leaves: Mapping[int, jax.Array]) -> PreparedSync:
        """A commit of engine-owned arrays at the given indices (same layout as the old ones)."""
        leaves = self.engine.weight_leaves()
        for index, array in new_leaves.items():
            leaves[index] = array
        self._check_layout(leaves, new_leaves)
        updated = frozenset(new_leaves)
        return PreparedSync(None, leaves, updated, updated)

    def _check_layout(self, leaves: list, indices) -> None:
        for index in indices:
            leaf, expected = leaves[index], self.leaves[index]
            if (
                tuple(leaf.shape) != expected.shape
                or leaf.dtype != expected.dtype
                or leaf.sharding != expected.sharding
            ):
                raise SyncError(
                    f"internal: engine leaf '{expected.path}' would change from "
                    f"{expected.shape} {expected.dtype} {expected.sharding} to "
                    f"{tuple(leaf.shape)} {leaf.dtype} {leaf.sharding}"
                )

    def memory_analysis(self, flat: Mapping[str, object]):
        flat = self.with_adapters(flat)
        plan = next((p for (key, _, partial), p in self._plans.items() if key == plan_key(flat) and not partial), None)
        if plan is None:
            raise ValueError("sync these params once before asking for the memory analysis")
        return plan.memory_analysis(flat)

    # ---- placement and checkpoints -----------------------------------------------------------

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.engine.mesh, PartitionSpec())

    def param_shardings(self, adapters: bool = False) -> dict[str, jax.sharding.Sharding]:
        """Flat trainer path -> where the leaf must live for a zero-copy sync: the base tree's
        leaves, or (``adapters``) the unmerged adapters'."""
        replicated = self.replicated()
        return {
            path: leaf.sharding if leaf is not None else replicated
            for path, leaf in self.used_as_is.items()
            if (path in self._adapter_paths) == adapters
        }

    def adapter_targets(self) -> dict[str, jax.sharding.Sharding]:
        """Every slot's adapter paths (slot 0's names, then the others' suffixed ones) -> where
        each leaf must live for a zero-copy sync (for the cross-process reshard)."""
        slot0 = self.param_shardings(adapters=True)
        return {
            m.trainer: slot0[base.trainer]
            for slot in self._slot_mappings
            for m, base in zip(slot, self.adapter_mappings)
        }

    def checkpoint_targets(
        self, saved: Mapping[str, object], item_dir, adapters_only: bool = False
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """Restore targets for a saved tree (``adapters_only``: of unmerged adapters alone; else
        a base, with the adapters if it has any): leaves the engine uses as they are come back
        in the engine's dtype and sharding; the others replicated on the engine's mesh."""
        with_adapters = adapters_only or any(path in self._adapter_paths for path in saved)
        expected = {
            p: leaf
            for p, leaf in self.used_as_is.items()
            if (with_adapters if p in self._adapter_paths else not adapters_only)
        }
        missing = sorted(set(expected) - set(saved))
        extra = sorted(set(saved) - set(expected))
        if missing or extra:
            raise SyncError(f"checkpoint {item_dir} does not match the model: {path_mismatch(missing, extra)}")
        replicated = self.replicated()
        targets = {}
        for path, meta in saved.items():
            if not jnp.issubdtype(meta.dtype, jnp.floating):  # a restore would cast it silently
                raise SyncError(f"checkpoint {item_dir}: '{path}' has dtype {meta.dtype}, expected a floating dtype")
            engine_leaf, shape = expected[path], tuple(meta.shape)
            if engine_leaf is not None and shape == engine_leaf.shape:
                targets[path] = jax.ShapeDtypeStruct(shape, engine_leaf.dtype, sharding=engine_leaf.sharding)
            else:
                targets[path] = jax.ShapeDtypeStruct(shape, meta.dtype, sharding=replicated)
        return targets

    # ---- train-step hand-off -------------------------------------------------------------------

    def release_aliased(self) -> None:
        """Drop the engine's references to trainer buffers it serves, so a train step may
        donate them. The engine must not run a forward until the next commit. Named adapters
        (slots past the default one) are copied instead: the base sync after the step puts back
        the base and the default slot alone, and the named ones serve on (they are small)."""
        mapped = {leaf.index for leaf in self.leaves if not leaf.engine_state}
        aliased = mapped - self._owned
        named = aliased & {self._by_path[m.engine].index for slot in self._slot_mappings[1:] for m in slot}
        if named:
            self.engine.copy_weight_leaves(sorted(named))
            self._owned |= named
        self.engine.release_weight_leaves(sorted(aliased - named))

    def free_owned(self) -> None:
        """Delete the weight arrays a failed engine owns (its thread is gone: nothing reads them
        again); the trainer's arrays it aliased are left to the trainer."""
        leaves = self.engine.weight_leaves()
        for index in self._owned:
            if _live(leaves[index]):
                leaves[index].delete()

    def dead_leaves(self) -> list[str]:
        """Paths of leaves whose buffers were freed (donated by the trainer), or released for a
        train step and not synced since."""
        return [spec.path for spec, leaf in zip(self.leaves, self.engine.weight_leaves()) if not _live(leaf)]

    def device_buffers(self) -> dict[tuple[int, int], int]:
        buffers: dict[tuple[int, int], int] = {}
        for leaf in self.engine.weight_leaves():
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                buffers.update(device_buffers(leaf))
        return buffers


def _live(leaf) -> bool:
    """A served weight array (not a released placeholder, not deleted)."""
    return isinstance(leaf, jax.Array) and not leaf.is_deleted()
