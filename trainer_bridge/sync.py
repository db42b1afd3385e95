"""Sync plans: a trainer param tree -> the engine's weight leaves, zero-copy wherever possible.

A plan is compiled once per (tree structure, leaf shapes, dtypes and placements, engine), a
placement being where each slice of a leaf lives, however its sharding spells it: a jitted train
step returns ``P()`` where ``param_shardings()`` gave ``P(None, None)``, or ``P(None, 'tensor')`` on
a mesh whose ``tensor`` axis has size 1: the same placement. Per engine leaf it chooses:

- ``alias``: the trainer's array is used as it is (same shape, dtype and sharding; one whose
  sharding spells the same placement otherwise is wrapped in the engine's, as for ``relabel``);
- ``relabel``: same buffers, wrapped in the engine's sharding object after checking that every
  device holds the same slice under both (zero bytes moved; the engine's jit cache needs its
  own sharding object to hit);
- ``copy``: cast / transpose / KV-head repeat / reshard, all such leaves in one jitted function
  whose out_shardings are the engine's shardings.

Validation happens before anything changes; errors name the trainer path, what was found and
what was expected.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Collection, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import EngineTransform, ParamMapping

from .tree import path_mismatch


class SyncError(ValueError):
    """The param tree cannot be synced; nothing was changed. ``non_finite``: the trainer paths
    found holding NaN/inf, where that is why; ``path``: the one trainer path whose shape or dtype
    is why, where that is."""

    # Class defaults too: a subclass that initializes another base (rollout.pod.PeerSyncError) has them.
    non_finite: tuple[str, ...] = ()
    path: str | None = None

    def __init__(self, message: str, non_finite: Sequence[str] = (), path: str | None = None):
        super().__init__(message)
        self.non_finite = tuple(non_finite)
        self.path = path


class LeafAction(enum.Enum):
    ALIAS = "alias"
    RELABEL = "relabel"
    COPY = "copy"


@dataclasses.dataclass(frozen=True)
class EngineLeaf:
    """One weight leaf of the engine (``EngineHandle.leaf_specs``): its position, its path in
    the model state and what the engine expects there."""

    index: int
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype  # or a JAX PRNG key dtype for the engine's rng leaves
    sharding: jax.sharding.Sharding
    # The engine's own state, not a weight (its RNG, which safetensors loading adds; the LoRA
    # slot of each token): no trainer path maps to it.
    engine_state: bool = False


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    trainer_path: str
    engine: EngineLeaf
    transform: EngineTransform
    kv_repeat: int
    cast: bool
    action: LeafAction
    nbytes: int  # bytes of the engine leaf

    @property
    def reshard_only(self) -> bool:
        """A copy made only because the trainer's placement differs from the engine's."""
        return self.transform is not EngineTransform.TRANSPOSE and self.kv_repeat == 1 and not self.cast


@dataclasses.dataclass(frozen=True)
class SyncReport:
    version: int
    leaves_aliased: int  # alias + relabel: the engine uses the trainer's buffers
    leaves_relabeled: int  # of which wrapped in the engine's sharding object
    leaves_copied: int
    leaves_resharded: int  # of the copied, those copied only because placement differed
    bytes_aliased: int
    bytes_copied: int
    seconds: float
    compiles: int = 0  # XLA compilations during the sync (JAX compile events)
    # Multi-process: bytes the one cross-process reshard wrote on this process's devices (a
    # tree spread over hosts); bytes moved on this process = bytes_gathered + bytes_copied.
    bytes_gathered: int = 0
    # LoRA merged at sync: the merged kernels' bytes the merge wrote (new buffers, which the
    # sync then aliases: counted in bytes_aliased too).
    bytes_merged: int = 0
    # With several engines: each engine's own report by engine index (the fields above are
    # their sums), None for an engine that failed.
    per_engine: tuple[SyncReport | None, ...] = ()


@functools.lru_cache(maxsize=4096)  # runs for every leaf of every sync; shardings are few
def _placement(sharding: jax.sharding.Sharding):
    """``sharding`` as a key equal for the spellings of one placement (what jit's outputs
    carry): a NamedSharding's spec without its mesh axes of size 1 (which split nothing: at
    tp=1 ``param_shardings()``' ``P(None, 'tensor')`` comes back as ``P()``), without trailing
    Nones, and with 1-tuples as their name. A sharding that also permutes the mesh's devices or
    holds partial sums (``unreduced``, ``reduced``) is its own key."""
    spec = getattr(sharding, "spec", None)
    if (
        not isinstance(sharding, NamedSharding)
        or getattr(sharding, "_logical_device_ids", None) is not None
        or getattr(spec, "unreduced", None)
        or getattr(spec, "reduced", None)
    ):
        return sharding
    sizes = sharding.mesh.shape

    def splitting(entry):
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        names = tuple(name for name in names if sizes[name] != 1)
        return None if not names else names[0] if len(names) == 1 else names

    spec = [splitting(entry) for entry in spec]
    while spec and spec[-1] is None:
        spec.pop()
    return (sharding.mesh, tuple(spec), sharding.memory_kind)


def _leaf_signature(path: str, leaf) -> tuple:
    # Runs for every leaf of every sync: dtype objects, not their (slow) string forms.
    if isinstance(leaf, jax.Array):
        return (leaf.shape, leaf.dtype, _placement(leaf.sharding), leaf.weak_type)
    if isinstance(leaf, np.ndarray):
        return (np.ndarray, leaf.shape, leaf.dtype)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        raise SyncError(
            f"'{path}' is a jax.ShapeDtypeStruct {leaf.shape} {leaf.dtype}: a shape without values "
            "(an abstract tree, e.g. from jax.eval_shape or a restore target); pass the arrays"
        )
    raise SyncError(f"'{path}' is {type(leaf).__name__} {leaf!r:.60}; expected an array (jax.Array or numpy.ndarray)")


def plan_key(flat: Mapping[str, object]) -> tuple:
    """What a compiled plan depends on; SyncError for a leaf that is not an array."""
    return tuple((path, _leaf_signature(path, leaf)) for path, leaf in flat.items())


def _wrapper_hint(flat: Mapping[str, object], expected: set[str]) -> str:
    """When the tree's top level is not the model's (a train state, params wrapped twice), which
    top-level keys were found and which one holds the params."""
    top = sorted({p.split(".", 1)[0] for p in flat})
    model_top = sorted({p.split(".", 1)[0] for p in expected})
    if set(top) & set(model_top):
        return ""
    holders = [k for k in top if any(p.split(".", 1)[-1] in expected for p in flat if p.startswith(k + "."))]
    hint = f"its top-level keys are {top}, the model's are {model_top}"
    if holders:
        hint += f"; the params are under {holders[0]!r}: pass tree[{holders[0]!r}] (the param dict alone)"
    return hint + ". "


def _normalized_index(index: tuple, shape: tuple[int, ...]) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def listed_shards(array: jax.Array) -> list | None:
    """``array.addressable_shards``, or None where jax cannot list them: jax 0.12 cannot for an
    array ``jax.device_put`` made of a one-device array across processes of one device each
    (:func:`replicate` builds such arrays instead)."""
    try:
        return array.addressable_shards
    except ValueError:
        return None


def held_slices(array: jax.Array) -> dict | None:
    """Device -> the slice of ``array`` it holds, of this process's devices (None: the shards
    cannot be listed, :func:`listed_shards`)."""
    shards = listed_shards(array)
    if shards is None:
        return None
    return {s.device: _normalized_index(s.index, tuple(array.shape)) for s in shards}


def sharding_slices(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict:
    """Device -> the slice of an array of ``shape`` that ``sharding`` gives it, every process's."""
    return {d: _normalized_index(i, tuple(shape)) for d, i in sharding.devices_indices_map(tuple(shape)).items()}


def same_slices(array: jax.Array, sharding: jax.sharding.Sharding) -> bool:
    """True when every device of ``sharding`` holds, in ``array``, exactly its slice. False for an
    array whose shards jax cannot list: it is copied, not relabeled."""
    expected = sharding_slices(sharding, array.shape)
    held = held_slices(array)
    return held is not None and all(held.get(device) == index for device, index in expected.items())


def relabel(array: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """The same device buffers as ``array``, as an array carrying ``sharding`` (no copy)."""
    by_device = {s.device: s.data for s in array.addressable_shards}
    devices = sharding.addressable_devices_indices_map(tuple(array.shape))
    return jax.make_array_from_single_device_arrays(tuple(array.shape), sharding, [by_device[d] for d in devices])


def replicated_beside(sharding: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    """A sharding that replicates over ``sharding``'s devices in its mesh's order: where a small
    array used beside ``sharding``'s goes (an adapter beside its kernel, an optimizer's step
    count beside the params). A jitted call wants its inputs' devices in one order, and a TPU
    mesh orders them along the chips' ring, not by id. None for a sharding without a mesh."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None


def replicate(value, sharding: jax.sharding.Sharding) -> jax.Array:
    """``value`` as an array replicated by ``sharding``. Where ``sharding``'s devices span
    processes, a value of this process's own (numpy, or an array on its devices), which every
    process holds the same, is built from each process's host copy: ``jax.device_put`` made of
    a one-device array put across processes, at jax 0.12, an array whose shards jax cannot list
    (``addressable_shards`` raises), which a sync then could not read. Not for values traced
    under ``jax.jit`` on that path: it reads the host copy."""
    if sharding.is_fully_addressable or (isinstance(value, jax.Array) and not value.is_fully_addressable):
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def device_order(sharding: jax.sharding.Sharding) -> tuple:
    """The devices of ``sharding`` in the order a jitted call lays them out (a mesh's order):
    a call's inputs and outputs must all have the same (jax 0.8-0.12's ``_device_assignment``)."""
    return tuple(sharding._device_assignment)


def call_placement(x) -> tuple:
    """The devices a jitted call takes ``x`` on, in order: leaves with the same can be inputs of
    one call. () for uncommitted arrays and numpy, which go wherever the call's others are."""
    return device_order(x.sharding) if isinstance(x, jax.Array) and x.committed else ()


def _on_engine_devices(x, engine_sharding: jax.sharding.Sharding):
    """``x`` as an input the engine's jitted copy accepts: a jitted call needs its inputs on
    the devices of its outputs, in their order. An array elsewhere (a trainer mesh spanning
    several engines, or the engine's devices in another order) is taken whole onto the
    engine's devices: relabeled where each of them already holds all of it, gathered
    otherwise."""
    if not isinstance(x, jax.Array):
        return x
    if x.sharding.memory_kind != engine_sharding.memory_kind:  # host-offloaded params, say
        x = jax.device_put(x, x.sharding.with_memory_kind(engine_sharding.memory_kind))
    if device_order(x.sharding) == device_order(engine_sharding):
        return x
    if isinstance(engine_sharding, NamedSharding):
        whole = NamedSharding(engine_sharding.mesh, PartitionSpec())
    else:
        whole = NamedSharding(Mesh(np.array(device_order(engine_sharding)), ("devices",)), PartitionSpec())
    if same_slices(x, whole):
        return relabel(x, whole)
    return jax.device_put(x, whole)


def _expected_trainer_shape(
    transform: EngineTransform, engine_shape: tuple[int, ...], kv_width: int
) -> tuple[tuple[int, ...], int]:
    """(trainer shape the engine leaf implies, KV repeat factor). A k/v projection's last axis
    is the model's KV heads (``kv_width``) in the trainer, repeated in the engine when tp_size
    exceeds them: the engine's width alone would also take a tree of more KV heads than the
    model has, and serve it."""
    if transform is EngineTransform.TRANSPOSE:
        return tuple(reversed(engine_shape)), 1
    if transform is EngineTransform.REPEAT_KV_HEADS and engine_shape:
        return (*engine_shape[:-1], kv_width), engine_shape[-1] // kv_width
    return tuple(engine_shape), 1


def build_plan(
    flat: Mapping[str, object],
    engine_leaves: Sequence[EngineLeaf],
    mappings: Sequence[ParamMapping],
    *,
    kv_width: int,
    allow_cast: bool = True,
    partial: bool = False,
) -> list[LeafPlan]:
    """Check a flat trainer tree against the mapping and the engine; decide each leaf's action.
    ``kv_width``: the model's KV heads x head_dim, a k/v projection's width in the trainer.

    ``partial``: ``mappings`` cover part of the engine's leaves (the adapters alone); the
    others keep what they serve."""
    by_engine_path = {leaf.path: leaf for leaf in engine_leaves}
    expected_paths = [m.trainer for m in mappings]
    seen_trainer, seen_engine = set(), set()
    for m in mappings:
        if m.trainer in seen_trainer:
            raise SyncError(f"mapping table lists trainer path '{m.trainer}' twice")
        if m.engine in seen_engine:
            raise SyncError(f"mapping table maps two trainer paths to engine leaf '{m.engine}'")
        seen_trainer.add(m.trainer)
        seen_engine.add(m.engine)
        if m.engine not in by_engine_path:
            raise SyncError(f"mapping table names engine leaf '{m.engine}', which the engine does not have")
    missing = [p for p in expected_paths if p not in flat]
    extra = [p for p in flat if p not in seen_trainer]
    if missing or extra:
        hint = _wrapper_hint(flat, seen_trainer)
        raise SyncError("param tree does not match the model: " + hint + path_mismatch(missing, extra))
    unmapped = [] if partial else [p.path for p in engine_leaves if p.path not in seen_engine and not p.engine_state]
    if unmapped:
        raise SyncError(f"engine leaves with no mapping entry: {', '.join(unmapped[:8])}")

    plans = []
    for m in mappings:
        leaf, engine = flat[m.trainer], by_engine_path[m.engine]
        found_shape = tuple(np.shape(leaf))
        dtype = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else None
        expected_shape, repeat = _expected_trainer_shape(m.engine_transform, engine.shape, kv_width)
        if found_shape != expected_shape:
            raise SyncError(
                f"'{m.trainer}' has shape {found_shape}, expected {expected_shape} "
                f"(engine leaf '{m.engine}' is {engine.shape})",
                path=m.trainer,
            )
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise SyncError(
                f"'{m.trainer}' has dtype {dtype}, expected a floating dtype ({engine.dtype})", path=m.trainer
            )
        check_byte_order(f"'{m.trainer}'", dtype)
        cast = dtype != engine.dtype
        if cast and not allow_cast:
            raise SyncError(
                f"'{m.trainer}' has dtype {dtype}, expected {engine.dtype} (casting is disabled)", path=m.trainer
            )
        as_is = m.engine_transform is not EngineTransform.TRANSPOSE and repeat == 1 and not cast
        # In the engine's memory (device, not host): its buffers can be served as they are.
        held = as_is and isinstance(leaf, jax.Array) and leaf.sharding.memory_kind == engine.sharding.memory_kind
        if held and leaf.sharding == engine.sharding and not leaf.weak_type:
            action = LeafAction.ALIAS
        elif held and same_slices(leaf, engine.sharding):
            # Also a weakly typed leaf's buffers: the relabeled array is not weak, where the
            # leaf itself would have made the engine's forward compile again for it.
            action = LeafAction.RELABEL
        else:
            action = LeafAction.COPY
        nbytes = int(np.prod(engine.shape, dtype=np.int64)) * np.dtype(engine.dtype).itemsize
        plans.append(LeafPlan(m.trainer, engine, m.engine_transform, repeat, cast, action, nbytes))
    return plans


def check_live(flat: Mapping[str, object]) -> None:
    """Deleted arrays (donated to a train step, say) are a SyncError naming their paths; read
    first, one failed deep in the sync as a bare RuntimeError."""
    deleted = [path for path, leaf in flat.items() if isinstance(leaf, jax.Array) and leaf.is_deleted()]
    if deleted:
        raise SyncError(
            f"{', '.join(repr(path) for path in deleted[:8])} {'has' if len(deleted) == 1 else 'have'} been "
            "deleted (donated to a train step?); pass live params"
        )


def _transform(x, plan: LeafPlan, head_dim: int):
    if plan.transform is EngineTransform.TRANSPOSE:
        x = x.T
    elif plan.kv_repeat > 1:
        heads = x.shape[-1] // head_dim
        x = x.reshape(*x.shape[:-1], heads, head_dim)
        x = jnp.repeat(x, plan.kv_repeat, axis=-2).reshape(*x.shape[:-2], heads * plan.kv_repeat * head_dim)
    return x.astype(plan.engine.dtype)


# A float32 sum per leaf reads it once at memory speed, where XLA CPU's all(isfinite) reduction
# runs 5x slower at jax 0.12 (bench/sync_bench.py). A NaN or an inf makes the sum non-finite; so
# can an overflow of finite values, which the exact check on that leaf alone then tells apart.
def _float32_sum(x):
    return jnp.sum(x, dtype=jnp.float32)


def _sums_and_maxima(*xs, maxima: tuple[int, ...]):
    """Every leaf's float32 sum, and the largest |value| of the leaves at ``maxima``."""
    sums = jnp.stack([_float32_sum(x) for x in xs])
    tops = [jnp.max(jnp.abs(xs[i]), initial=0).astype(jnp.float32) for i in maxima]
    return sums, jnp.stack(tops) if tops else jnp.zeros(0, jnp.float32)


_leaf_sum = jax.jit(_float32_sum)
_leaf_sums = jax.jit(_sums_and_maxima, static_argnames="maxima")
_all_finite = jax.jit(lambda x: jnp.all(jnp.isfinite(x)))


def check_byte_order(what: str, dtype: np.dtype) -> None:
    """SyncError for an array of ``dtype`` in the other byte order than this machine's (a numpy
    array read from a big-endian file), which JAX does not take."""
    dtype = np.dtype(dtype)
    if not dtype.isnative:
        raise SyncError(
            f"{what} has dtype {dtype.str}, in the other byte order than this machine's, which JAX does "
            f"not take: pass leaf.astype('{dtype.newbyteorder('=').str}')"
        )


def non_finite_leaves(leaves: Sequence[jax.Array], *, one_call: bool = True) -> list[int]:
    """The indices of the real-valued leaves holding a NaN or an inf (one read of every leaf;
    a numpy float64 leaf is read in float32, where values past its range are inf:
    :func:`finite_as_given` tells those apart).

    ``one_call``: the leaves on each set of devices in one compiled call (a jitted call takes
    its inputs on one set), the fewest dispatches, compiled once per tree signature (a sync's
    fixed tree); else one call per leaf, compiled once per leaf shape and dtype (for sets of
    leaves that vary)."""
    if one_call:
        return read_leaves(leaves)[0]
    # numpy warns of the overflow as a float64 leaf is cast: the very thing reported here.
    with np.errstate(over="ignore"):
        return _confirmed(leaves, jax.device_get([_leaf_sum(x) for x in leaves]))


def read_leaves(leaves: Sequence[jax.Array], max_abs: Sequence[int] = ()) -> tuple[list[int], dict[int, float]]:
    """:func:`non_finite_leaves` (one compiled call per set of devices), and from the same calls
    the largest |value| (in float32) of each leaf whose index is in ``max_abs``."""
    wanted = set(max_abs)
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(call_placement(x), []).append(i)
    sums = np.empty(len(leaves), np.float32)
    maxima: dict[int, float] = {}
    with np.errstate(over="ignore"):  # as in non_finite_leaves
        for members in groups.values():
            tops = tuple(k for k, i in enumerate(members) if i in wanted)
            group_sums, group_maxima = _leaf_sums(*(leaves[i] for i in members), maxima=tops)
            sums[members] = np.asarray(group_sums)
            maxima.update(zip((members[k] for k in tops), np.asarray(group_maxima).tolist()))
        return _confirmed(leaves, sums), maxima


def _confirmed(leaves: Sequence[jax.Array], sums) -> list[int]:
    """The leaves whose sum is not finite and that do hold a NaN or an inf (not an overflowing sum)."""
    suspects = np.flatnonzero(~np.isfinite(np.asarray(sums))).tolist()
    return [i for i in suspects if not bool(_all_finite(leaves[i]))]


def finite_as_given(leaf) -> bool:
    """Whether every value of ``leaf`` is finite in its own dtype (a numpy float64 is read in
    float64: jax would read it in float32, where 1e300 is inf)."""
    if isinstance(leaf, np.ndarray):
        return bool(np.isfinite(leaf).all())
    return bool(_all_finite(leaf))


def beyond_range(dtype) -> str:
    """How a finite value a cast to ``dtype`` made infinite is named."""
    return f"values beyond {np.dtype(dtype)}'s range (|x| > {float(jnp.finfo(dtype).max):g})"


def _paths(plans: Sequence[LeafPlan]) -> str:
    return ", ".join(p.trainer_path for p in plans[:8])


class SyncPlan:
    """A compiled plan: executes a sync for trees with the plan's exact structure."""

    def __init__(self, plans: list[LeafPlan], head_dim: int):
        self.leaves = plans
        self.copies = [p for p in plans if p.action is LeafAction.COPY]
        copies = self.copies

        def transform_all(*arrays):
            return tuple(_transform(x, p, head_dim) for x, p in zip(arrays, copies))

        self._copy_fn = jax.jit(transform_all, out_shardings=tuple(p.engine.sharding for p in copies))

    def execute(self, flat: Mapping[str, object]) -> dict[int, jax.Array]:
        """New engine leaves by engine index. Trainer arrays are never modified."""
        out: dict[int, jax.Array] = {}
        for p in self.leaves:
            leaf = flat[p.trainer_path]
            if p.action is LeafAction.ALIAS and leaf.sharding == p.engine.sharding:
                out[p.engine.index] = leaf
            elif p.action is not LeafAction.COPY:  # the plan's placement: same slices (plan_key)
                out[p.engine.index] = relabel(leaf, p.engine.sharding)
        if self.copies:
            with np.errstate(over="ignore"):  # a cast's overflow is check_finite's to report
                arrays = self._copy_fn(*self._copy_inputs(flat))
            for p, array in zip(self.copies, arrays):
                out[p.engine.index] = array
        return out

    def check_finite(
        self,
        flat: Mapping[str, object],
        out: Mapping[int, jax.Array],
        known_finite=frozenset(),
        max_abs: Collection[str] = (),
    ) -> dict[str, float]:
        """NaN/inf in the leaves :meth:`execute` gave as ``out`` for ``flat`` (what the engine
        would serve) are a SyncError naming the trainer paths: the tree's own, and those of
        finite values a copy's cast to the engine's dtype overflowed (float32 weights past
        float16's 65504), which a check of the tree alone would pass. ``known_finite``: engine
        indices whose served array, if the tree passes it again (an alias of the same object:
        a frozen base), was checked already and is not read again. Returns the largest |value|
        of each leaf of the trainer paths ``max_abs`` that is read, from the same read."""
        checked = [p for p in self.leaves if p.engine.index not in known_finite]
        wanted = [i for i, p in enumerate(checked) if p.trainer_path in max_abs]
        found, maxima = read_leaves([out[p.engine.index] for p in checked], wanted)
        bad = [checked[i] for i in found]
        overflowed = [p for p in bad if p.action is LeafAction.COPY and finite_as_given(flat[p.trainer_path])]
        problems = []
        if len(overflowed) < len(bad):
            problems.append(f"non-finite values (nan/inf) in: {_paths([p for p in bad if p not in overflowed])}")
        for dtype in sorted({p.engine.dtype for p in overflowed}, key=str):
            paths = _paths([p for p in overflowed if p.engine.dtype == dtype])
            problems.append(f"{beyond_range(dtype)}, finite in the tree, infinite in the engine's {dtype}, in: {paths}")
        if problems:
            raise SyncError("; ".join(problems), non_finite=[p.trainer_path for p in bad])
        return {checked[i].trainer_path: value for i, value in maxima.items()}

    def relabeled(self, flat: Mapping[str, object], out: Mapping[int, jax.Array]) -> int:
        """Of the leaves :meth:`execute` gave as ``out`` for ``flat``, those not the trainer's own
        array (wrapped in the engine's sharding object)."""
        return sum(
            p.action is not LeafAction.COPY and out[p.engine.index] is not flat[p.trainer_path] for p in self.leaves
        )

    def _copy_inputs(self, flat: Mapping[str, object]) -> list:
        return [_on_engine_devices(flat[p.trainer_path], p.engine.sharding) for p in self.copies]

    def memory_analysis(self, flat: Mapping[str, object]):
        """XLA's compiled memory analysis of the copy function (output and temp bytes)."""
        return self._copy_fn.lower(*self._copy_inputs(flat)).compile().memory_analysis()

    def report(self, version: int, seconds: float, relabeled: int) -> SyncReport:
        """The sync's figures; ``relabeled``: of the leaves it aliased, those the sync wrapped
        in the engine's sharding object (:meth:`relabeled`)."""
        aliased = [p for p in self.leaves if p.action is not LeafAction.COPY]
        return SyncReport(
            version=version,
            leaves_aliased=len(aliased),
            leaves_relabeled=relabeled,
            leaves_copied=len(self.copies),
            leaves_resharded=sum(p.reshard_only for p in self.copies),
            bytes_aliased=sum(p.nbytes for p in aliased),
            bytes_copied=sum(p.nbytes for p in self.copies),
            seconds=seconds,
        )
