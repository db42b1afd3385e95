"""The rollout worker: an sglang-jax engine in the trainer's process."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from models import EngineTransform, mappings_for
from trainer_bridge import (
    EngineLeaf,
    SyncError,
    SyncPlan,
    SyncReport,
    build_plan,
    flatten_params,
    load_hf_params,
    plan_key,
    resolve_checkpoint,
    restore_tree,
    saved_layout,
    unflatten_params,
    wrap_like,
)

from .batch import RolloutBatch, pack_rollouts
from .config import WorkerConfig, has_tokenizer_files
from .consistency import ConsistencyReport, check_consistency
from .engine import MAX_SAMPLING_SEED, EngineHandle, device_buffers, device_nbytes

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KvReport:
    """What a KV cache drop freed or a rebuild allocated."""

    bytes: int  # device bytes of the pool's own buffers, summed over devices and layers
    buffers: int
    seconds: float
    # Live device bytes released beyond the pool's buffers: on backends without buffer
    # donation (CPU) the previous step's KV arrays can still be alive until the drop.
    transient_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    # Device bytes summed over devices.
    weight_bytes: int  # the engine's weight leaves (aliased trainer buffers included)
    kv_bytes: int  # the KV cache buffers (0 while dropped)
    live_bytes_per_device: dict[str, int]  # every live JAX array, by device


class RolloutWorker:
    """Generates rollouts with an in-process sglang-jax engine.

    Use it as a context manager, or call :meth:`close` (idempotent) when done.
    """

    def __init__(self, config: WorkerConfig):
        _check_model_path(config.model_path)
        self.config = config
        start = time.perf_counter()
        self._engine = EngineHandle(config.engine_options())
        try:
            self._set_up(config)
        except BaseException:
            self._engine.close()
            raise
        self._log_phase("engine_ready", time.perf_counter() - start)

    def _set_up(self, config: WorkerConfig) -> None:
        self._lock = threading.RLock()
        self._rng = np.random.default_rng(config.seed)
        self.weight_version = 0
        self._plans: dict[tuple, SyncPlan] = {}
        self._engine_leaves = [
            EngineLeaf(i, spec.path, spec.shape, spec.dtype, spec.sharding)
            for i, spec in enumerate(self._engine.leaf_specs())
        ]
        self._mappings = mappings_for(self._engine.hf_config)
        # Per trainer path: the engine leaf it is used as unchanged, or None when the sync
        # transforms it (transpose; k/v projections, whose heads the engine may repeat).
        by_path = {leaf.path: leaf for leaf in self._engine_leaves}
        self._used_as_is = {
            m.trainer: by_path[m.engine] if m.engine_transform is EngineTransform.IDENTITY else None
            for m in self._mappings
        }
        # Leaf indices whose current array belongs to the engine (boot weights, sync copies),
        # as opposed to trainer buffers it aliases: those are freed as soon as they are replaced.
        self._owned_leaves = set(range(len(self._engine_leaves)))
        self._kv_dropped = False
        self._stale_reason: str | None = None
        self._tokenizer = _load_tokenizer(config.model_path)
        self.pad_token_id = _pad_token_id(self._tokenizer)
        self.eos_token_ids = _eos_token_ids(self._tokenizer, self._engine.hf_config)

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> RolloutWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine and free what it holds. Safe to call more than once."""
        with self._lock:
            if self._engine is not None:
                self._engine.close()
                self._engine = None

    @property
    def closed(self) -> bool:
        return self._engine is None

    @property
    def engine(self) -> EngineHandle:
        if self._engine is None:
            raise RuntimeError("the RolloutWorker is closed")
        return self._engine

    @property
    def tokenizer(self):
        """The model directory's HF tokenizer, or None when it has none."""
        return self._tokenizer

    # ---- weights ---------------------------------------------------------------------------

    def sync_params(
        self, params: Mapping, *, allow_cast: bool = True, check_finite: bool = False
    ) -> SyncReport:
        """Make the engine generate with ``params`` (MLLM-JAX layout; ``{'params': ...}`` too).

        Leaves whose shape, dtype and placement already match the engine's are used as they
        are (zero copy); the rest are cast / transposed / resharded on device in one jitted
        call. On any error nothing changes: the previous weights keep serving and the version
        stays. The engine may keep using the trainer's buffers until the next sync: a train
        step that donates them must be followed by a sync before the next generate.
        """
        start = time.perf_counter()
        engine = self.engine
        try:
            flat = flatten_params(params)
        except (TypeError, ValueError) as exc:
            raise SyncError(str(exc)) from None
        key = (plan_key(flat), allow_cast)
        plan = self._plans.get(key)
        if plan is None:
            leaves = build_plan(flat, self._engine_leaves, self._mappings, head_dim=self._head_dim, allow_cast=allow_cast)
            plan = self._plans[key] = SyncPlan(leaves, self._head_dim)
        plan.check_inputs(flat, check_finite)
        updates = plan.execute(flat)
        new_leaves = engine.weight_leaves()
        for index, array in updates.items():
            new_leaves[index] = array
        self._check_engine_layout(new_leaves)
        jax.block_until_ready(list(updates.values()))

        copied = {p.engine.index for p in plan.copies}

        def swap():
            old_leaves = engine.weight_leaves()
            engine.replace_weight_leaves(new_leaves)
            engine.flush_prefix_cache()
            # Free replaced engine-owned arrays now rather than whenever the last reference
            # goes: peak memory of a sync stays at the bytes it writes.
            for index in self._owned_leaves:
                if old_leaves[index] is not new_leaves[index] and index in updates:
                    old_leaves[index].delete()

        with self._lock:
            engine.call(swap)
            self._owned_leaves = copied | (self._owned_leaves - set(updates))
            self._stale_reason = None
            self.weight_version += 1
            version = self.weight_version
        report = plan.report(version, time.perf_counter() - start)
        logger.info("sync_params: %s", report)
        self._log_phase("weights_synced", report.seconds, version=version, bytes_copied=report.bytes_copied)
        return report

    def sync_memory_analysis(self, params: Mapping):
        """XLA's memory analysis of the jitted copy a sync of ``params`` runs (after a first
        sync of the same structure): output and temporary bytes it allocates on device."""
        flat = flatten_params(params)
        plan = next((p for (key, _), p in self._plans.items() if key == plan_key(flat)), None)
        if plan is None:
            raise ValueError("sync these params once before asking for the memory analysis")
        return plan.memory_analysis(flat)

    def param_shardings(self) -> dict:
        """Where to place a trainer param tree so that ``sync_params`` moves no bytes.

        A nested dict in the trainer layout: each leaf the engine uses as it is gets the
        engine's sharding; the others (transposed; k/v projections, whose heads the engine may
        repeat) are replicated on the engine's mesh, from which the sync transforms them.
        """
        replicated = NamedSharding(self.engine.mesh, PartitionSpec())
        return unflatten_params(
            {path: leaf.sharding if leaf is not None else replicated for path, leaf in self._used_as_is.items()}
        )

    def load_hf(self, model_dir) -> SyncReport:
        """Serve the weights of an HF safetensors directory (single file or sharded with an
        index json), through the same plan as ``sync_params``. On error nothing changes."""
        return self.sync_params(load_hf_params(model_dir, dtype=None))

    def load_checkpoint(self, path, step: int | None = None) -> SyncReport:
        """Serve a trainer param tree saved with orbax: a ``StandardCheckpointer`` directory,
        or a ``CheckpointManager`` root (latest step, or ``step``).

        Leaves the engine can use as they are restored straight into the engine's dtype and
        sharding and then aliased; the others are restored replicated on the engine's mesh and
        transformed on device. No host copy of the tree is made. On error nothing changes.
        """
        item_dir = resolve_checkpoint(path, step)
        saved, wrapped = saved_layout(item_dir)
        missing = sorted(set(self._used_as_is) - set(saved))
        extra = sorted(set(saved) - set(self._used_as_is))
        if missing or extra:
            raise SyncError(
                f"checkpoint {item_dir} does not match the model: missing {len(missing)} expected "
                f"path(s) {missing[:8]}; {len(extra)} unexpected path(s) {extra[:8]}"
            )
        replicated = NamedSharding(self.engine.mesh, PartitionSpec())
        targets = {}
        for path_, meta in saved.items():
            engine_leaf, shape = self._used_as_is[path_], tuple(meta.shape)
            if engine_leaf is not None and shape == engine_leaf.shape:
                targets[path_] = jax.ShapeDtypeStruct(shape, engine_leaf.dtype, sharding=engine_leaf.sharding)
            else:
                targets[path_] = jax.ShapeDtypeStruct(shape, meta.dtype, sharding=replicated)
        restored = restore_tree(item_dir, wrap_like(targets, wrapped))
        return self.sync_params(restored)

    @property
    def _head_dim(self) -> int:
        config = self.engine.hf_config
        return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    def _check_engine_layout(self, leaves: list) -> None:
        for leaf, expected in zip(leaves, self._engine_leaves):
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

    def _check_weights_alive(self) -> None:
        if self._stale_reason is not None:
            raise RuntimeError(f"{self._stale_reason}: call worker.sync_params(params) before generate")
        dead = [spec.path for spec, leaf in zip(self._engine_leaves, self.engine.weight_leaves()) if leaf.is_deleted()]
        if dead:
            raise RuntimeError(
                f"the engine's weights were freed ({len(dead)} leaves, e.g. '{dead[0]}'): the trainer "
                "donated buffers the engine was using. Call worker.sync_params(params) before generate."
            )

    # ---- KV cache and memory -----------------------------------------------------------------

    def drop_kv(self) -> KvReport:
        """Free the KV cache buffers (and the prefix cache) until :meth:`rebuild_kv`.

        ``generate`` while dropped rebuilds first. Dropping twice frees nothing more.
        """
        engine = self.engine
        with self._lock:
            if self._kv_dropped:
                return KvReport(0, 0, 0.0)
            start = time.perf_counter()
            live_before = live_device_bytes()
            count, freed = engine.call(engine.drop_kv_buffers)
            self._kv_dropped = True
            transient = max(0, live_before - live_device_bytes() - freed)
        report = KvReport(freed, count, time.perf_counter() - start, transient)
        self._log_phase("kv_dropped", report.seconds, bytes=report.bytes)
        return report

    def rebuild_kv(self) -> KvReport:
        """Recreate the KV cache with its original shapes, dtype and sharding (no recompile)."""
        engine = self.engine
        with self._lock:
            if not self._kv_dropped:
                return KvReport(0, 0, 0.0)
            start = time.perf_counter()
            engine.call(engine.rebuild_kv_buffers)
            buffers = engine.kv_buffers()
            jax.block_until_ready(buffers)
            self._kv_dropped = False
        report = KvReport(sum(device_nbytes(b) for b in buffers), len(buffers), time.perf_counter() - start)
        self._log_phase("kv_rebuilt", report.seconds, bytes=report.bytes)
        return report

    def _log_phase(self, phase: str, seconds: float, **details) -> None:
        if self.config.phase_log is None:
            return
        memory = self.memory()
        record = {
            "phase": phase,
            "seconds": round(seconds, 6),
            "time": time.time(),
            **details,
            "weight_bytes": memory.weight_bytes,
            "kv_bytes": memory.kv_bytes,
            "live_bytes": sum(memory.live_bytes_per_device.values()),
            "live_bytes_per_device": memory.live_bytes_per_device,
        }
        with open(self.config.phase_log, "a", encoding="utf-8") as log:
            log.write(json.dumps(record) + "\n")

    @property
    def kv_dropped(self) -> bool:
        return self._kv_dropped

    @contextlib.contextmanager
    def released_for_training(self) -> Iterator[KvReport]:
        """Around a train step: drops the KV cache and the engine's references to the
        trainer's buffers it was serving, so the train step may donate its params.

        Afterwards ``generate`` refuses to run until the next ``sync_params``. Yields the KV
        drop report.
        """
        engine = self.engine
        report = self.drop_kv()
        with self._lock:
            self._stale_reason = "a train step ran since the last sync_params"
            mapped = {leaf.index for leaf in self._engine_leaves if not leaf.path.startswith("rng.")}
            aliased = sorted(mapped - self._owned_leaves)
            engine.call(lambda: engine.release_weight_leaves(aliased))
        yield report

    def memory(self) -> MemoryReport:
        engine = self.engine
        weights: dict[tuple[int, int], int] = {}
        for leaf in engine.weight_leaves():
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                weights.update(device_buffers(leaf))
        kv = sum(device_nbytes(b) for b in engine.kv_buffers())
        per_device: dict[str, int] = {}
        devices = {d.id: str(d) for d in jax.devices()}
        for (device_id, _), nbytes in live_device_buffers().items():
            per_device[devices[device_id]] = per_device.get(devices[device_id], 0) + nbytes
        return MemoryReport(sum(weights.values()), kv, per_device)

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        max_new_tokens: int = 128,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        seed: int | None = None,
        pad_prompts_to: int | None = None,
        return_logprobs: bool = False,
    ) -> RolloutBatch:
        """Sample ``n`` completions for every prompt (token-id lists, or strings).

        ``temperature=0`` is greedy decoding. Each row gets its own sampling seed, derived from
        ``seed`` (or from the worker's own random stream when ``seed`` is None), so the same
        seed gives the same completions and no two rows share a random stream.
        ``return_logprobs=True`` fills ``batch.logprobs`` (see :class:`RolloutBatch`).
        """
        engine = self.engine
        prompt_ids = self._prompt_ids(prompts)
        _check_sampling(n, temperature, top_p, top_k, min_p, max_new_tokens, seed)
        self._check_lengths(prompt_ids, max_new_tokens)
        if pad_prompts_to is not None and max(map(len, prompt_ids)) > pad_prompts_to:
            raise ValueError(
                f"a prompt has {max(map(len, prompt_ids))} tokens, more than pad_prompts_to={pad_prompts_to}"
            )
        stop_ids = self._stop_token_ids(stop_token_ids)
        start = time.perf_counter()
        self._check_weights_alive()
        if self._kv_dropped:
            self.rebuild_kv()

        with self._lock:
            base_seed = int(self._rng.integers(MAX_SAMPLING_SEED)) if seed is None else int(seed)
            seeds = _row_seeds(base_seed, len(prompt_ids) * n)
            params = []
            for row_seed in seeds:
                p = {
                    "max_new_tokens": max_new_tokens,
                    "temperature": float(temperature),
                    "top_p": float(top_p),
                    "top_k": int(top_k),
                    "min_p": float(min_p),
                    "ignore_eos": bool(ignore_eos),
                    "sampling_seed": int(row_seed),
                    "no_stop_trim": True,
                }
                if stop_ids or not ignore_eos:
                    p["stop_token_ids"] = sorted(set(stop_ids) | (set() if ignore_eos else self.eos_token_ids))
                params.append(p)
            # 0.0.2 ignores n for a single prompt: every sample is its own request.
            rows = [ids for ids in prompt_ids for _ in range(n)]
            outputs = engine.generate(rows, params, return_logprobs=return_logprobs)
            version = self.weight_version

        completions = [_completion_ids(i, out)[:max_new_tokens] for i, out in enumerate(outputs)]
        self._log_phase("generate", time.perf_counter() - start, rows=len(outputs))
        texts = None
        if self._tokenizer is not None:
            texts = [self._tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        return pack_rollouts(
            prompt_ids,
            completions,
            n=n,
            completion_width=max_new_tokens,
            pad_token_id=self.pad_token_id,
            finish_reasons=[o.finish_reason for o in outputs],
            weight_version=version,
            seeds=seeds,
            cache_miss_count=max(o.cache_miss_count for o in outputs),
            completion_texts=texts,
            prompt_width=pad_prompts_to,
            logprobs=[o.logprobs[: len(c)] for o, c in zip(outputs, completions)] if return_logprobs else None,
        )

    def _prompt_ids(self, prompts) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(
                f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}"
            )
        if len(prompts) == 0:
            raise ValueError("prompts is empty")
        vocab = self.engine.vocab_size
        ids = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                tokenizer = self._tokenizer
                if tokenizer is None:
                    raise ValueError(
                        f"prompts[{i}] is a string but the model directory {self.config.model_path} has no "
                        "tokenizer: pass token ids"
                    )
                prompt = tokenizer.encode(prompt, add_special_tokens=False)
            tokens = [int(t) for t in np.asarray(prompt).reshape(-1)]
            if not tokens:
                raise ValueError(f"prompts[{i}] is empty")
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab}): {bad[:5]}")
            ids.append(tokens)
        return ids

    def _check_lengths(self, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
        context = self.engine.context_length
        limit = self.engine.max_request_input_len
        for i, tokens in enumerate(prompt_ids):
            if len(tokens) >= limit:
                raise ValueError(
                    f"prompts[{i}] has {len(tokens)} tokens; the engine accepts prompts of at most "
                    f"{limit - 1} tokens (context length {context})"
                )
            if len(tokens) + max_new_tokens > context:
                raise ValueError(
                    f"prompts[{i}] has {len(tokens)} tokens and max_new_tokens={max_new_tokens}: "
                    f"{len(tokens) + max_new_tokens} exceeds the context length {context}"
                )

    def _stop_token_ids(self, stop_token_ids) -> list[int]:
        if stop_token_ids is None:
            return []
        vocab = self.engine.vocab_size
        ids = [int(t) for t in stop_token_ids]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids has ids outside [0, {vocab}): {bad}")
        return ids

    def check_consistency(self, params: Mapping, prompts, **kwargs) -> ConsistencyReport:
        """Engine log-probs against the Flax model's on ``params``: see :func:`rollout.check_consistency`."""
        return check_consistency(self, params, prompts, **kwargs)


def _completion_ids(row: int, out) -> list[int]:
    """The sampled tokens, stop token included (a trainer must learn to emit it)."""
    if len(out.output_ids) != out.completion_tokens:
        logger.warning(
            "row %d: engine returned %d output ids but counted %d completion tokens",
            row, len(out.output_ids), out.completion_tokens,
        )
    return list(out.output_ids[: out.completion_tokens])


def _check_sampling(n, temperature, top_p, top_k, min_p, max_new_tokens, seed) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise ValueError(f"top_k must be -1 (all tokens) or an int >= 1, got {top_k!r}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    if seed is not None and (not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SAMPLING_SEED):
        raise ValueError(f"seed must be an int in [0, {MAX_SAMPLING_SEED}], got {seed!r}")


def _row_seeds(base_seed: int, rows: int) -> np.ndarray:
    """Independent per-row sampling seeds derived from one base seed."""
    state = np.random.SeedSequence(base_seed).generate_state(rows, dtype=np.uint32)
    return (state & np.uint32(MAX_SAMPLING_SEED)).astype(np.int64)


def _check_model_path(model_path) -> None:
    """A local model path must be a directory with config.json (else it is taken as a hub id)."""
    path = Path(model_path)
    looks_local = path.is_absolute() or str(model_path).startswith(".") or path.exists()
    if looks_local and not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} does not exist or has no config.json")


def _load_tokenizer(model_path: str):
    if not has_tokenizer_files(model_path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _eos_token_ids(tokenizer, hf_config) -> set[int]:
    """EOS ids from the tokenizer and the model config (the engine runs without a tokenizer)."""
    ids = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(hf_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _pad_token_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0


def live_device_buffers() -> dict[tuple[int, int], int]:
    """Device buffers of all live JAX arrays: (device id, address) -> bytes.

    Counted from the arrays because ``device.memory_stats()`` is unavailable on CPU. Each
    buffer counts once although several arrays may view it (an array and the single-device
    arrays of its shards, an aliased trainer leaf and the engine's relabel of it).
    """
    buffers: dict[tuple[int, int], int] = {}
    for array in jax.live_arrays():
        if not array.is_deleted():
            buffers.update(device_buffers(array))
    return buffers


def live_device_bytes() -> int:
    return sum(live_device_buffers().values())
