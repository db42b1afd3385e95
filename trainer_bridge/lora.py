"""LoRA adapters beside a frozen base tree, merged on device into the weights an engine serves.

An adapted kernel ``<module>.kernel`` [in, out] has two factors beside it: A [in, r] and B
[r, out]; the served weight is ``kernel + (alpha / r) * A @ B``. The factors' leaf names are
data (:data:`FACTOR_NAMES`): this project's (``<module>.lora_a`` / ``<module>.lora_b``) and
qwix's, which Tunix's LoRA uses (``<module>.kernel_lora_a`` / ``<module>.kernel_lora_b``: qwix
names them after the weight they adapt).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import EngineTransform, ParamMapping

from .sync import SyncError, call_placement, check_byte_order, replicate, replicated_beside
from .tree import flatten_params, unflatten_params

# Every linear projection of the dense families (attention and MLP).
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# factor -> the leaf names it goes by, one per accepted layout (ours, qwix's).
FACTOR_NAMES: dict[str, tuple[str, ...]] = {
    "a": ("lora_a", "kernel_lora_a"),
    "b": ("lora_b", "kernel_lora_b"),
}
_FACTOR_OF_NAME = {name: factor for factor, names in FACTOR_NAMES.items() for name in names}


def _partner(name: str) -> str:
    """The other factor's leaf name in ``name``'s layout (``lora_a`` -> ``lora_b``)."""
    factor = _FACTOR_OF_NAME[name]
    other = "b" if factor == "a" else "a"
    return FACTOR_NAMES[other][FACTOR_NAMES[factor].index(name)]


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """``rank`` r and ``alpha`` (the update is scaled by alpha / r, as PEFT and qwix scale it);
    ``target_modules``: the projections (last module name: ``q_proj``, ...) that carry adapters,
    every layer's."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES

    def __post_init__(self):
        if isinstance(self.rank, (bool, np.bool_)) or not isinstance(self.rank, numbers.Integral) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be a positive int, got {self.rank!r}")
        alpha = self.alpha
        if isinstance(alpha, np.ndarray | jax.Array) and alpha.ndim == 0:  # read from a checkpoint
            alpha = alpha.item()
        if isinstance(alpha, (bool, np.bool_)) or not isinstance(alpha, numbers.Real) or not 0 < alpha < math.inf:
            raise ValueError(f"LoraConfig.alpha must be a finite number > 0, got {alpha!r}")
        if alpha / self.rank == 0:  # a denormal alpha: every update would be scaled to 0
            raise ValueError(f"LoraConfig.alpha / rank must be > 0 in float64, got {alpha!r} / {self.rank}")
        targets = self.target_modules
        if isinstance(targets, str) or not isinstance(targets, Iterable):
            raise ValueError(f"LoraConfig.target_modules must be a non-empty sequence of names, got {targets!r}")
        targets = tuple(targets)  # read once: a generator checked and then stored would be stored empty
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"LoraConfig.target_modules must be a non-empty sequence of names, got {targets!r}")
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "alpha", float(alpha))
        # A set of modules: configs that list the same ones in another order are equal.
        object.__setattr__(self, "target_modules", tuple(sorted(set(targets))))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class Adapter:
    kernel: str  # the base tree path it adapts: "model.layers_0.self_attn.q_proj.kernel"
    a: jax.Array
    b: jax.Array


def collect_adapters(
    adapters: Mapping[str, object], base: Mapping[str, object], kernels: Sequence[str], config: LoraConfig
) -> list[Adapter]:
    """The adapters of a flat adapter tree, checked against the flat ``base`` tree and the
    ``kernels`` (trainer paths) the family's table has: every error is a SyncError naming the
    path."""
    modules = {path.rsplit(".", 2)[-2] for path in kernels}
    for name in config.target_modules:
        if name not in modules:
            raise SyncError(
                f"LoraConfig.target_modules: '{name}' is not a projection this model has as a kernel "
                f"(its kernels' modules: {sorted(modules)})"
            )
    factors: dict[str, dict[str, tuple[str, object]]] = {}
    for path, leaf in adapters.items():
        module, _, name = path.rpartition(".")
        if name not in _FACTOR_OF_NAME:
            raise SyncError(f"adapters: '{path}' is not a LoRA factor (leaf names: {sorted(_FACTOR_OF_NAME)})")
        _check_factor(path, leaf)
        pair, factor = factors.setdefault(module, {}), _FACTOR_OF_NAME[name]
        if factor in pair:
            raise SyncError(f"adapters: '{path}' and '{pair[factor][0]}' are both the {factor.upper()} of '{module}'")
        pair[factor] = (path, leaf)
    found = []
    for module, pair in sorted(factors.items()):
        for factor, other in (("a", "b"), ("b", "a")):
            if factor in pair and other not in pair:
                raise SyncError(
                    f"adapters: '{pair[factor][0]}' has no {_partner(pair[factor][0].rpartition('.')[2])} beside it"
                )
        a_name, b_name = (pair[f][0].rpartition(".")[2] for f in ("a", "b"))
        if _partner(a_name) != b_name:
            raise SyncError(f"adapters: '{pair['a'][0]}' and '{pair['b'][0]}' are named in two layouts")
        kernel = f"{module}.kernel"
        if kernel not in base and module in base:  # an MoE's experts, stacked: no kernel of their own
            raise SyncError(
                f"adapters: '{pair['a'][0]}' adapts '{module}', an array of shape {tuple(base[module].shape)} in the "
                f"base tree, not a '<module>.kernel' projection: an MoE's stacked experts take no adapters"
            )
        if kernel not in base:
            raise SyncError(f"adapters: '{pair['a'][0]}' adapts '{kernel}', which the base tree does not have")
        if module.rpartition(".")[2] not in config.target_modules:
            raise SyncError(
                f"adapters: '{pair['a'][0]}' adapts '{module}', which is not in LoraConfig.target_modules "
                f"{list(config.target_modules)}"
            )
        if len(jnp.shape(base[kernel])) != 2:
            raise SyncError(f"adapters: '{pair['a'][0]}' adapts '{kernel}' of shape {jnp.shape(base[kernel])}, not 2-D")
        (in_dim, out_dim), (a_path, a), (b_path, b) = jnp.shape(base[kernel]), pair["a"], pair["b"]
        for path, leaf, expected in ((a_path, a, (in_dim, config.rank)), (b_path, b, (config.rank, out_dim))):
            if tuple(jnp.shape(leaf)) != expected:
                raise SyncError(
                    f"adapters: '{path}' has shape {tuple(jnp.shape(leaf))}; the kernel '{kernel}' "
                    f"{(in_dim, out_dim)} at rank {config.rank} needs {expected}"
                )
        found.append(Adapter(kernel, a, b))
    adapted = {adapter.kernel for adapter in found}
    for kernel in kernels:
        if kernel.rsplit(".", 2)[-2] in config.target_modules and kernel not in adapted:
            raise SyncError(f"adapters: no adapter for '{kernel}' (its module is in LoraConfig.target_modules)")
    return found


def _check_factor(path: str, leaf) -> None:
    """A factor is a live array of a floating dtype (as a base leaf must be), else SyncError."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not hasattr(leaf, "shape"):
        raise SyncError(f"adapters: '{path}' is a {type(leaf).__name__}, expected an array")
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise SyncError(f"adapters: '{path}' has been deleted (donated to a train step?); pass live adapters")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise SyncError(f"adapters: '{path}' has dtype {dtype}, expected a floating dtype")
    check_byte_order(f"adapters: '{path}'", dtype)


def is_factor_path(path: str) -> bool:
    """Whether a flat tree's ``path`` names a LoRA factor, in either accepted layout."""
    return path.rpartition(".")[2] in _FACTOR_OF_NAME


def is_adapter_tree(flat: Mapping[str, object]) -> bool:
    """Whether every leaf of a non-empty flat tree is a LoRA factor (an adapter checkpoint)."""
    return bool(flat) and all(map(is_factor_path, flat))


def canonical_adapters(adapters: Mapping[str, object]) -> dict:
    """A flat adapter tree with its factors under this project's names (``lora_a``/``lora_b``,
    the names :func:`adapter_mappings` gives them), whatever accepted layout it came in."""
    canonical, origin = {}, {}
    for path, leaf in adapters.items():
        module, _, name = path.rpartition(".")
        factor = _FACTOR_OF_NAME[name]
        renamed = f"{module}.{FACTOR_NAMES[factor][0]}"
        if renamed in canonical:
            raise SyncError(f"adapters: '{path}' and '{origin[renamed]}' are both the {factor.upper()} of '{module}'")
        canonical[renamed], origin[renamed] = leaf, path
    return canonical


def _adaptable(m: ParamMapping) -> bool:
    """A projection kernel the engine keeps, untransposed, as a linear layer's ``weight``."""
    return (
        m.trainer.endswith(".kernel")
        and m.engine.endswith(".weight")
        and m.engine_transform is not EngineTransform.TRANSPOSE
    )


def check_unmerged_targets(mappings: Sequence[ParamMapping], config: LoraConfig) -> None:
    """ValueError unless every target module names projections the engine can adapt unmerged."""
    adaptable = {m.trainer.rsplit(".", 2)[-2] for m in mappings if _adaptable(m)}
    unknown = [name for name in config.target_modules if name not in adaptable]
    if unknown:
        raise ValueError(
            f"unmerged_lora.target_modules: {unknown} name no projection of this model that the engine "
            f"computes with a linear layer (those it has: {sorted(adaptable)})"
        )


def adapter_mappings(mappings: Sequence[ParamMapping], config: LoraConfig) -> list[ParamMapping]:
    """The mapping entries of adapters served unmerged: for each projection kernel of the table
    (a 2-D ``<module>.kernel`` the engine keeps as ``<engine module>.weight``, not transposed)
    whose module is targeted, ``<module>.lora_a`` -> ``<engine module>.lora_a`` and ``lora_b``
    likewise, B's heads repeated as the kernel's are (k/v projections at tp_size > KV heads).
    Adapters have no HF tensor here (``hf`` is empty)."""
    entries = []
    for m in mappings:
        if not _adaptable(m) or m.trainer.rsplit(".", 2)[-2] not in config.target_modules:
            continue
        module, engine_module = m.trainer.removesuffix(".kernel"), m.engine.removesuffix(".weight")
        entries.append(ParamMapping(f"{module}.lora_a", f"{engine_module}.lora_a", "", condition=m.condition))
        entries.append(
            ParamMapping(f"{module}.lora_b", f"{engine_module}.lora_b", "", m.engine_transform, condition=m.condition)
        )
    return entries


def merge_adapters(base: Mapping[str, object], adapters: Sequence[Adapter], config: LoraConfig) -> dict:
    """``base`` (flat) with each adapted kernel replaced by ``kernel + scale * A @ B``: one jitted
    program for the kernels on each set of devices (a jitted call takes its inputs on one set,
    and a trainer may keep its kernels on several), in float32, each result in its kernel's
    dtype and sharding. The base arrays are read, not changed; the results are new buffers."""
    merged = dict(base)
    groups: dict[tuple, list[Adapter]] = {}
    for adapter in adapters:
        groups.setdefault(call_placement(base[adapter.kernel]), []).append(adapter)
    for group in groups.values():
        merged.update(_merged_on_one_set(base, group, config))
    return merged


def _merged_on_one_set(base: Mapping[str, object], adapters: Sequence[Adapter], config: LoraConfig) -> dict:
    kernels = [base[adapter.kernel] for adapter in adapters]
    shardings = tuple(getattr(k, "sharding", None) for k in kernels)
    placed = all(isinstance(s, jax.sharding.Sharding) for s in shardings)
    a_factors = [_beside(adapter.a, kernel) for adapter, kernel in zip(adapters, kernels)]
    b_factors = [_beside(adapter.b, kernel) for adapter, kernel in zip(adapters, kernels)]
    program = _merge_program(config.scale, shardings if placed else None)
    try:
        results = program(kernels, a_factors, b_factors)
    except (ValueError, TypeError) as exc:
        paths = [adapter.kernel for adapter in adapters]
        raise SyncError(f"adapters of {paths[:4]}: merging them into their kernels failed: {exc}") from exc
    return {adapter.kernel: result for adapter, result in zip(adapters, results)}


def _beside(factor, kernel):
    """The factor replicated on its kernel's devices: the trainer may keep adapters elsewhere
    than the base (they are small)."""
    sharding = replicated_beside(getattr(kernel, "sharding", None))
    return factor if sharding is None else replicate(factor, sharding)


def _merged_kernel(kernel, a, b, scale: float):
    """``kernel + scale * A @ B`` computed in float32 whatever the dtypes, in the kernel's: the
    sync's merge and the trainer's alike (bfloat16 factors multiplied in bfloat16 on one side
    only moved kernels by 1e-3 and log-probs by 0.016)."""
    # HIGHEST: TPUs would otherwise multiply float32 in one bfloat16 pass.
    delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)


@functools.lru_cache(maxsize=16)
def _merge_program(scale: float, shardings):
    def merge(kernels, a_factors, b_factors):
        return [_merged_kernel(w, a, b, scale) for w, a, b in zip(kernels, a_factors, b_factors)]

    return jax.jit(merge, out_shardings=list(shardings) if shardings is not None else None)


def apply_adapters(base: Mapping, adapters: Mapping, config: LoraConfig) -> dict:
    """The trainer's side of :func:`merge_adapters`: the nested ``base`` tree with each adapted
    kernel replaced by ``kernel + scale * A @ B``, in jnp (differentiable with respect to the
    adapters, for a train step that updates only them; no checks: :func:`collect_adapters`
    checks a tree once at sync)."""
    flat, factors = flatten_params(base), flatten_params(adapters)
    for path, a in factors.items():
        module, _, name = path.rpartition(".")
        if _FACTOR_OF_NAME.get(name) != "a":
            continue
        kernel = flat[f"{module}.kernel"]
        flat[f"{module}.kernel"] = _merged_kernel(kernel, a, factors[f"{module}.{_partner(name)}"], config.scale)
    return unflatten_params(flat)


def init_adapters(base: Mapping, config: LoraConfig, key: jax.Array) -> dict:
    """Fresh float32 adapters for every kernel of ``base`` whose module is targeted: A random
    (normal, variance 1 / in) and B zero, so that the adapted policy starts as the base (PEFT and
    qwix also start B at zero; they draw A from a uniform). Each factor is placed replicated on
    its kernel's mesh."""
    adapters = {}
    for i, (path, kernel) in enumerate(sorted(flatten_params(base).items())):
        module = path.removesuffix(".kernel")
        if not path.endswith(".kernel") or module.rpartition(".")[2] not in config.target_modules:
            continue
        in_dim, out_dim = kernel.shape
        a = jax.random.normal(jax.random.fold_in(key, i), (in_dim, config.rank), jnp.float32) / in_dim**0.5
        b = jnp.zeros((config.rank, out_dim), jnp.float32)
        adapters[f"{module}.lora_a"], adapters[f"{module}.lora_b"] = _beside(a, kernel), _beside(b, kernel)
    return unflatten_params(adapters)
