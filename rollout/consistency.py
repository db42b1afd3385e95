"""Train-inference consistency: the engine's log-probs against the trainer's, on the same tokens.

A sync whose mapping is wrong but shape-compatible (a square projection transposed, K and V
swapped) serves a different policy without any error. Sampling from the engine with log-probs
and recomputing them with the trainer's Flax model on the trainer's params catches it: with a
correct mapping the two agree to float rounding (fp32: ~1e-6; bf16 engine: ~1e-2).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models import completion_log_probs, flax_model_for
from trainer_bridge import flatten_params, non_finite_leaves, unflatten_params
from trainer_bridge.lora import is_factor_path
from trainer_bridge.sync import held_slices, sharding_slices

from .errors import InvalidRequest, RolloutError
from .sampling import as_int


class ConsistencyError(RolloutError, RuntimeError):
    """Engine and trainer log-probs disagree beyond a threshold; ``report`` has the figures."""

    def __init__(self, message: str, report: ConsistencyReport):
        super().__init__(message)
        self.report = report


@dataclasses.dataclass(frozen=True)
class TokenMismatch:
    row: int
    column: int  # in the batch's [B, T] layout
    token: int
    engine: float
    trainer: float


@dataclasses.dataclass(frozen=True)
class ConsistencyReport:
    mean_abs_diff: float  # mean |engine - trainer| log-prob over the compared tokens
    max_abs_diff: float
    kl: float  # k3 estimate of KL(engine || trainer) per token, from the engine's samples
    tokens: int  # completion tokens compared
    worst: list[TokenMismatch]  # largest differences first
    seconds: float  # generate + trainer forward


def _held_whole(flat: Mapping[str, object]) -> dict[str, object]:
    """``flat`` with each leaf spread over several processes' devices replaced by the copy this
    process holds (on its first device; a leaf placed by ``param_shardings()`` with tp > 1 is
    split over this process's devices, whole on them): the Flax forward runs on this process's
    rows alone, and over global arrays it would be a computation of every process, each with a
    batch of its own (with FSDP leaves a collective that aborted a process). A leaf of which
    this process holds only part is refused."""
    held = {}
    for path, leaf in flat.items():
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            whole = _this_process_copy(leaf)
            if whole is None:
                raise InvalidRequest(
                    "params",
                    f"'{path}' is sharded over several processes' devices ({leaf.sharding}): check_consistency "
                    "recomputes this process's rows with the Flax model alone, so pass params this process "
                    "holds whole (in a pod, compare your SPMD train step's log-probs with mismatch_stats)",
                )
            leaf = jax.device_put(whole, jax.local_devices()[0])
        held[path] = leaf
    return held


def _this_process_copy(leaf: jax.Array) -> np.ndarray | None:
    """``leaf`` assembled from this process's shards, or None where they do not hold every slice
    the sharding has (or cannot be listed)."""
    held = held_slices(leaf)
    if held is None or set(held.values()) != set(sharding_slices(leaf.sharding, leaf.shape).values()):
        return None
    out = np.empty(leaf.shape, leaf.dtype)
    for shard in leaf.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def mismatch_stats(engine_logprobs, trainer_logprobs, mask) -> dict[str, float]:
    """Mean and max |Δ log p|, the k3 KL estimate and the token count over ``mask`` ([B, T])."""
    mask = np.asarray(mask, dtype=bool)
    delta = (np.asarray(trainer_logprobs, np.float64) - np.asarray(engine_logprobs, np.float64))[mask]
    if delta.size == 0:
        return {"mean_abs_diff": 0.0, "max_abs_diff": 0.0, "kl": 0.0, "tokens": 0}
    return {
        "mean_abs_diff": float(np.abs(delta).mean()),
        "max_abs_diff": float(np.abs(delta).max()),
        "kl": float(np.mean(np.expm1(delta) - delta)),
        "tokens": int(delta.size),
    }


def check_consistency(
    worker,
    params: Mapping,
    prompts: Sequence,
    *,
    n: int = 1,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    seed: int = 0,
    pad_prompts_to: int | None = None,
    atol: float = 1e-3,
    mean_atol: float | None = None,
    max_kl: float | None = None,
    worst: int = 5,
    routing_replay: bool = False,
) -> ConsistencyReport:
    """Sample from ``worker`` with log-probs and recompute them with the Flax model on ``params``.

    ``params`` is the trainer's tree the engine should be serving (synced by the caller).
    Raises :class:`ConsistencyError` naming the statistic and its threshold when the max
    |Δ log p| exceeds ``atol``, the mean exceeds ``mean_atol`` or the KL estimate exceeds
    ``max_kl`` (the last two only when given). ``routing_replay`` (MoE models, a worker with
    ``record_routing``): the trainer routes every token to the experts the engine chose.
    """
    worst = as_int("worst", worst, minimum=0)
    for name, limit in (("atol", atol), ("mean_atol", mean_atol), ("max_kl", max_kl)):
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Real) or not limit >= 0):
            raise InvalidRequest(name, f"{name} must be a number >= 0 or None, got {limit!r}")
    if not isinstance(routing_replay, bool):
        raise InvalidRequest("routing_replay", f"routing_replay must be a bool, got {routing_replay!r:.80}")
    if routing_replay:
        try:  # the routing it replays is generate's return_routing: refused here under this name
            worker.check_sampling(return_routing=True)
        except InvalidRequest as error:
            raise InvalidRequest("routing_replay", f"routing_replay replays the engine's routing: {error}") from None
    worker.check_params(params)  # named by path, as a sync names them (the Flax model would not)
    flat = flatten_params(params)
    factor = next(filter(is_factor_path, flat), None)
    if factor is not None:  # the Flax model would ignore them, and blame the engine that applies them
        raise InvalidRequest(
            "params",
            f"params holds LoRA factors ('{factor}'), which the Flax recompute does not apply: pass the tree with "
            "them merged (trainer_bridge.apply_adapters)",
        )
    tree = unflatten_params(_held_whole(flat))  # nested, flat (dotted paths) or {"params": ...}
    start = time.perf_counter()
    batch = worker.generate(
        prompts,
        n=n,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        pad_prompts_to=pad_prompts_to,
        return_logprobs=True,
        return_routing=routing_replay,
    )
    config_file = Path(worker.config.model_path) / "config.json"
    trainer_fn = _trainer_log_probs(
        config_file.read_text(), _float_dtype(tree), float(temperature), int(top_k), float(top_p), float(min_p)
    )
    trainer = np.asarray(
        trainer_fn(
            tree,
            batch.tokens,
            batch.attention_mask,
            batch.positions,
            batch.completion_mask,
            batch.kept_counts,
            batch.routed_experts,
        )
    )
    stats = mismatch_stats(batch.logprobs, trainer, batch.completion_mask)
    diff = np.where(batch.completion_mask, np.abs(trainer - batch.logprobs), -1.0)
    order = np.argsort(diff, axis=None)[::-1][: min(worst, stats["tokens"])]
    report = ConsistencyReport(
        **stats,
        worst=[
            TokenMismatch(int(r), int(c), int(batch.tokens[r, c]), float(batch.logprobs[r, c]), float(trainer[r, c]))
            for r, c in zip(*np.unravel_index(order, diff.shape))
        ],
        seconds=time.perf_counter() - start,
    )
    _check_trainer_finite(report, trainer, batch.completion_mask, tree, _float_dtype(tree))
    for name, value, limit in (
        ("max |Δ log p|", report.max_abs_diff, atol),
        ("mean |Δ log p|", report.mean_abs_diff, mean_atol),
        ("KL estimate", report.kl, max_kl),
    ):
        if limit is not None and not value <= limit:
            where = ""
            if report.worst:
                w = report.worst[0]
                where = (
                    f" (worst: row {w.row}, column {w.column}, token {w.token}: engine {w.engine:.4f}, "
                    f"trainer {w.trainer:.4f})"
                )
            raise ConsistencyError(
                f"train-inference mismatch: {name} = {value:.3g} exceeds {limit:.3g} over {report.tokens} "
                f"tokens{where}; the engine is not serving the trainer's policy (check the weight mapping and dtypes)",
                report,
            )
    return report


def _check_trainer_finite(
    report: ConsistencyReport, trainer: np.ndarray, mask: np.ndarray, params: Mapping, dtype: str
) -> None:
    """Trainer log-probs that are NaN, or -inf from a tree holding NaN or inf, are no mismatch
    the engine could cause (it serves finite weights only: a sync refuses others): a
    ConsistencyError naming the cause. A -inf from finite params is a mismatch (the trainer
    gives a sampled token no probability: its filter kept other tokens), left to the caller."""
    bad = ~np.isfinite(trainer) & mask
    if not bad.any():
        return
    flat = flatten_params(params)
    paths = list(flat)
    non_finite = [paths[i] for i in non_finite_leaves(list(flat.values()), one_call=False)]
    if non_finite:
        cause = f"params hold NaN or inf at {', '.join(non_finite[:8])}" + (" ..." if len(non_finite) > 8 else "")
    elif np.isnan(trainer[mask]).any():
        cause = f"params are finite: the Flax forward overflows in {dtype}"
        bad = np.isnan(trainer) & mask
    else:
        return
    row, column = (int(i) for i in np.argwhere(bad)[0])
    raise ConsistencyError(
        f"the trainer's recomputed log-probs are not finite at {int(bad.sum())} of {int(mask.sum())} completion "
        f"tokens (first: row {row}, column {column}): {cause}. The engine cannot be serving these params: "
        "sync_params refuses non-finite values",
        report,
    )


def _float_dtype(tree) -> str:
    for leaf in jax.tree_util.tree_leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return jnp.dtype(leaf.dtype).name
    raise ValueError("params has no floating-point leaves")


@functools.lru_cache(maxsize=16)
def _trainer_log_probs(config_json: str, dtype: str, temperature: float, top_k: int, top_p: float, min_p: float):
    # Keyed by the config's text: the family's Flax model (models.FAMILIES) for that config.
    model = flax_model_for(json.loads(config_json), dtype)

    @jax.jit
    def log_probs(params, tokens, attention_mask, positions, completion_mask, kept_counts, routed_experts):
        logits = model.apply({"params": params}, tokens, attention_mask, positions, routed_experts=routed_experts)
        return completion_log_probs(
            logits,
            tokens,
            completion_mask,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            kept_counts=kept_counts,
        )

    return log_probs
