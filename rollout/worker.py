"""The rollout worker: sglang-jax engines in the trainer's process.

A facade over its parts: ``weights`` (sync plans, leaf ownership, checkpoint targets), ``kv``
(KV lifecycle, memory accounting), ``sampling`` (validated sampling parameters and prompts),
``gate`` (concurrent calls versus exclusive changes) and ``phase_log``.

Thread safety: every public method may be called from any thread. Generate calls run
concurrently and the engines batch their requests together. Weight swaps (``sync_params``,
``load_*``) and KV changes are exclusive: they wait for the calls already running, new calls
wait behind them, and each call generates with one weight version (``batch.weight_version``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import jax
import numpy as np

from models import ParamMapping
from trainer_bridge import (
    EngineLeaf,
    SyncError,
    SyncReport,
    flatten_params,
    load_hf_params,
    resolve_checkpoint,
    restore_tree,
    saved_layout,
    unflatten_params,
    wrap_like,
)

from . import kv, weight_check
from .batch import RolloutBatch, StreamChunk, pack_rollouts
from .compiles import counting_compiles
from .config import WorkerConfig, has_tokenizer_files
from .consistency import ConsistencyReport, check_consistency
from .engine import EngineHandle, GenerateOutput
from .errors import InvalidRequest, WorkerClosed, WorkerUnavailable, check_limit
from .gate import EngineGate
from .group import EngineGroup, merge
from .in_place_updates import check_in_place_updates
from .pod import Pod, tree_fingerprint
from .kv import KvReport, MemoryReport
from .phase_log import PhaseLog
from .sampling import (
    MAX_SAMPLING_SEED,
    SamplingParams,
    as_int,
    check_request_lengths,
    pad_width,
    prompt_token_ids,
    row_seeds,
)

logger = logging.getLogger(__name__)

# jax.random.key takes any int64; the admin route's seed is a non-negative one.
MAX_PERTURB_SEED = 2**32 - 1  # the perturbation's seed is a traced uint32 (one compile for all)


@dataclasses.dataclass(frozen=True)
class _Request:
    """A validated generate call, before it is split over engines."""

    prompts: list[list[int]]
    params: SamplingParams  # stop ids final (EOS added)
    seeds: np.ndarray  # [P, n]
    pad_prompts_to: int | None


class RolloutWorker:
    """Generates rollouts with in-process sglang-jax engines (``config.dp_size`` of them, each
    on its own ``tp_size`` devices) that serve the trainer's weights.

    Use it as a context manager, or call :meth:`close` (idempotent) when done.
    """

    def __init__(self, config: WorkerConfig):
        device_groups = config.validate()
        check_in_place_updates(device_groups[0][0].platform)
        self.config = config
        start = time.perf_counter()
        self._group = EngineGroup(config, device_groups, Pod.current(config.pod_timeout_s))
        try:
            self._set_up(config)
        except BaseException:
            self._group.close()
            raise
        self._phases.record("engine_ready", time.perf_counter() - start)

    def _set_up(self, config: WorkerConfig) -> None:
        # Lock order (always taken in this order, never the reverse): ``_sync_lock`` (one
        # weight change at a time, held while new weights are prepared), then the gate's
        # exclusive section (no generate call in flight), then ``_state_lock`` (the fields
        # below). Generate calls take only the gate (admitted) and, briefly, ``_state_lock``.
        self._sync_lock = threading.RLock()
        self._gate = EngineGate()
        self._state_lock = threading.RLock()
        self._rng = np.random.default_rng(config.seed)
        self._closed = False
        self.weight_version = 0
        self._kv_dropped = False
        self._stale_reason: str | None = None
        self._tokenizer = _load_tokenizer(config.model_path)
        self.pad_token_id = _pad_token_id(self._tokenizer)
        self.eos_token_ids = _eos_token_ids(self._tokenizer, self.engine.hf_config)
        self._phases = PhaseLog(config.phase_log, self.memory)

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> RolloutWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engines and free what they hold. Safe to call more than once."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            self._group.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def engines(self) -> tuple[EngineHandle, ...]:
        self._check_open()
        return self._group.engines

    @property
    def engine(self) -> EngineHandle:
        """The first (with ``dp_size=1`` the only) engine."""
        return self.engines[0]

    @property
    def tokenizer(self):
        """The model directory's HF tokenizer, or None when it has none."""
        return self._tokenizer

    # ---- read-only views ---------------------------------------------------------------------

    @property
    def leaves(self) -> tuple[EngineLeaf, ...]:
        """The engine's weight leaves: path, shape, dtype, sharding (of the first engine)."""
        return self._group.first.leaves

    @property
    def mappings(self) -> tuple[ParamMapping, ...]:
        """The model's trainer path -> engine leaf mapping table, expanded per layer."""
        return self._group.first.mappings

    @property
    def head_dim(self) -> int:
        return self._group.first.head_dim

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + new tokens one row may have (the engine's limit)."""
        return self.engine.max_request_tokens

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def kv_dropped(self) -> bool:
        return self._kv_dropped

    @property
    def active_calls(self) -> int:
        """Generate calls admitted and not yet finished."""
        return self._gate.active_calls

    @property
    def unavailable_reason(self) -> str | None:
        """None when a generate can start now; else why not (a weight swap, KV change or
        train step in progress, or weights stale after a train step)."""
        if self._closed:
            return "the worker is closed"
        return self._gate.exclusive_reason or self._stale_reason

    # ---- weights ---------------------------------------------------------------------------

    def sync_params(
        self,
        params: Mapping,
        *,
        allow_cast: bool = True,
        check_finite: bool = True,
        in_flight: bool = False,
        recompute_kv: bool = False,
    ) -> SyncReport:
        """Make the engines generate with ``params`` (MLLM-JAX layout; ``{'params': ...}`` too).

        Leaves whose shape, dtype and placement already match an engine's are used as they
        are (zero copy); the rest are cast / transposed / resharded on device in one jitted
        call per engine. The swap waits for running generate calls and holds new ones back
        until it is done. On any error nothing changes: the previous weights keep serving and
        the version stays. The engines may keep using the trainer's buffers until the next
        sync: a train step that donates them must be followed by a sync before the next
        generate. ``check_finite`` (on by default) refuses NaN/inf weights, naming the paths: it
        reads every weight once (about 1.15x one plain read; ``bench.sync_bench``), the price of
        never serving a broken policy silently; pass False where that read matters.

        ``in_flight=True`` swaps without draining: each engine stops at its next forward
        boundary (the sync waits at most one forward step, however long the running requests
        are), swaps, flushes its prefix cache and resumes the requests that were running;
        generate calls are admitted throughout. Those requests continue from the KV computed
        under the old weights, or with ``recompute_kv=True`` are prefilled again under the new
        weights before their next token. Every token records the version that sampled it
        (``batch.token_versions``) and its log-prob is that version's, so importance weights
        stay exact.
        """
        return self._sync(
            params, "sync_params", allow_cast=allow_cast, check_finite=check_finite, in_flight=in_flight, recompute_kv=recompute_kv
        )

    def _sync(
        self,
        params: Mapping,
        call: str,
        *,
        allow_cast: bool,
        check_finite: bool,
        in_flight: bool = False,
        recompute_kv: bool = False,
        reason: str = "weights are being swapped",
    ) -> SyncReport:
        start = time.perf_counter()
        self._check_open()
        _check_swap_mode(in_flight, recompute_kv)
        try:
            flat = flatten_params(params)
        except (TypeError, ValueError) as exc:
            raise SyncError(str(exc)) from None
        with self._closed_is_clear(), self._sync_lock, counting_compiles() as compiles:
            # Before any collective: every process makes this call with a tree of this structure.
            self._group.pod.agree(
                call, f"{tree_fingerprint(flat)} allow_cast={allow_cast} check_finite={check_finite} in_flight={in_flight} recompute_kv={recompute_kv}"
            )
            trees, gathered = self._group.localize(flat, call)
            live = self._group.live()
            prepared = [
                w.prepare(trees[self._group.weights.index(w)], allow_cast=allow_cast, check_finite=check_finite)
                for w in live
            ]
            with self._swapping(reason, in_flight):
                version = self.weight_version + 1
                for weights, update in zip(live, prepared):
                    weights.commit(update, version, in_flight=in_flight, recompute_kv=recompute_kv)
                self._stale_reason = None
                self.weight_version = version
        seconds = time.perf_counter() - start
        reports = [update.plan.report(version, seconds) for update in prepared]
        report = dataclasses.replace(_combine_sync_reports(reports, compiles.value), bytes_gathered=gathered)
        logger.info("sync_params: %s", report)
        self._phases.record("weights_synced", seconds, version=version, bytes_copied=report.bytes_copied)
        return report

    def sync_memory_analysis(self, params: Mapping):
        """XLA's memory analysis of the jitted copy a sync of ``params`` runs on the first
        engine (after a first sync of the same structure): output and temporary bytes."""
        return self._group.first.memory_analysis(flatten_params(params))

    def param_shardings(self) -> dict:
        """Where to place a trainer param tree so that ``sync_params`` moves no bytes.

        A nested dict in the trainer layout: each leaf the engines use as it is gets the
        engine's sharding (with several engines: that sharding within each engine's devices,
        replicated across engines); the others (transposed; k/v projections, whose heads the
        engine may repeat) are replicated, and the sync transforms them.
        """
        self._check_open()
        return unflatten_params(self._group.param_shardings())

    @contextlib.contextmanager
    def _swapping(self, reason: str, in_flight: bool) -> Iterator[None]:
        """Around a swap's commits: a drain swap excludes generate calls; an in-flight one only
        other changes of worker state."""
        with contextlib.nullcontext() if in_flight else self._gate.exclusive(reason), self._state_lock:
            yield

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The mesh of :meth:`param_shardings` with several engines: axis ``replica`` over every
        engine of every process (process order), then the engine's own axes. A trainer shards its
        batch over ``replica`` to train data-parallel over the engines' devices."""
        return self._group.mesh

    def load_hf(self, model_dir, *, check_finite: bool = True, in_flight: bool = False, recompute_kv: bool = False) -> SyncReport:
        """Serve the weights of an HF safetensors directory (single file or sharded with an
        index json), through the same plan as ``sync_params`` (NaN/inf refused unless
        ``check_finite=False``; ``in_flight``, ``recompute_kv`` as there). On error nothing
        changes."""
        self._check_open()
        _check_swap_mode(in_flight, recompute_kv)
        return self._sync(
            load_hf_params(model_dir, dtype=None), "load_hf", allow_cast=True, check_finite=check_finite,
            in_flight=in_flight, recompute_kv=recompute_kv, reason="weights are being reloaded",
        )

    def load_checkpoint(
        self, path, step: int | None = None, *, check_finite: bool = True, in_flight: bool = False, recompute_kv: bool = False
    ) -> SyncReport:
        """Serve a trainer param tree saved with orbax: a ``StandardCheckpointer`` directory,
        or a ``CheckpointManager`` root (latest step, or ``step``).

        Leaves the engines can use as they are restored straight into the engines' dtype and
        sharding and then aliased; the others are restored replicated and transformed on
        device. No host copy of the tree is made. NaN/inf weights are refused as by
        ``sync_params`` (``check_finite=False`` skips that read); ``in_flight``,
        ``recompute_kv``: as for ``sync_params``. On error nothing changes.
        """
        self._check_open()
        _check_swap_mode(in_flight, recompute_kv)
        item_dir = resolve_checkpoint(path, step)
        saved, wrapped = saved_layout(item_dir)
        targets = self._group.checkpoint_targets(saved, item_dir)
        # The restore is itself collective in a multi-process job (every process reads its shards).
        self._group.pod.agree("load_checkpoint", tree_fingerprint(targets))
        restored = restore_tree(item_dir, wrap_like(targets, wrapped))
        return self._sync(
            restored, "load_checkpoint", allow_cast=True, check_finite=check_finite, in_flight=in_flight,
            recompute_kv=recompute_kv, reason="weights are being reloaded",
        )

    def replace_engine_leaves(
        self, new_leaves: Sequence[Mapping[int, jax.Array]], reason: str, *, in_flight: bool = False
    ) -> int:
        """Swap engine-owned arrays in by leaf index, one mapping per engine (same shapes,
        dtypes and shardings as the leaves they replace); ``in_flight`` as for ``sync_params``
        (the running requests keep their KV). Returns the new weight version."""
        with self._closed_is_clear(), self._sync_lock, self._swapping(reason, in_flight):
            version = self.weight_version + 1
            for weights, leaves in zip(self._group.weights, new_leaves):
                if weights.engine.alive:
                    weights.replace_leaves(leaves, version, in_flight=in_flight)
            self.weight_version = version
            return version

    # ---- KV cache and memory -----------------------------------------------------------------

    def drop_kv(self) -> KvReport:
        """Free every engine's KV cache buffers (and prefix cache) until :meth:`rebuild_kv`.

        Waits for running generate calls. ``generate`` while dropped rebuilds first.
        Dropping twice frees nothing more.
        """
        self._check_open()
        self._group.pod.agree("drop_kv")
        return self._drop_kv()

    def _drop_kv(self) -> KvReport:
        with self._closed_is_clear(), self._gate.exclusive("the KV cache is being dropped"), self._state_lock:
            if self._kv_dropped:
                return KvReport(0, 0, 0.0)
            start = time.perf_counter()
            reports = [kv.drop_kv(w.engine) for w in self._group.live()]
            self._kv_dropped = True
        report = kv.combine(reports, time.perf_counter() - start)
        self._phases.record("kv_dropped", report.seconds, bytes=report.bytes)
        return report

    def rebuild_kv(self) -> KvReport:
        """Recreate the KV caches with their original shapes, dtype and sharding (no recompile)."""
        self._check_open()
        self._group.pod.agree("rebuild_kv")
        return self._rebuild_kv()

    def _rebuild_kv(self) -> KvReport:
        with self._closed_is_clear(), self._gate.exclusive("the KV cache is being rebuilt"), self._state_lock:
            if not self._kv_dropped:
                return KvReport(0, 0, 0.0)
            start = time.perf_counter()
            reports = [kv.rebuild_kv(w.engine) for w in self._group.live()]
            self._kv_dropped = False
        report = kv.combine(reports, time.perf_counter() - start)
        self._phases.record("kv_rebuilt", report.seconds, bytes=report.bytes)
        return report

    @contextlib.contextmanager
    def released_for_training(self) -> Iterator[KvReport]:
        """Around a train step: drops the KV caches and the engines' references to the
        trainer's buffers they were serving, so the train step may donate its params.

        Afterwards ``generate`` refuses to run until the next ``sync_params``. Yields the KV
        drop report.
        """
        self._check_open()
        self._group.pod.agree("released_for_training")
        with self._gate.exclusive("a train step is running"):
            report = self._drop_kv()
            with self._state_lock:
                self._stale_reason = "a train step ran since the last sync_params"
                for weights in self._group.live():
                    weights.release_aliased()
        yield report

    def memory(self) -> MemoryReport:
        """Device bytes of weights and KV per engine, and of all live arrays per device."""
        engines, all_weights = [], {}
        for engine, weights in zip(self.engines, self._group.weights):
            buffers = weights.device_buffers()
            all_weights.update(buffers)
            engines.append(kv.engine_memory(engine, buffers))
        devices = self._group.devices
        names = {d.id: str(d) for d in devices}
        per_device = dict.fromkeys(names.values(), 0)
        for (device_id, _), nbytes in kv.live_device_buffers(devices).items():
            per_device[names[device_id]] += nbytes
        return MemoryReport(
            sum(all_weights.values()), sum(e.kv_bytes for e in engines), per_device, tuple(engines)
        )

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
        prompt_offset: int = 0,
    ) -> RolloutBatch:
        """Sample ``n`` completions for every prompt (token-id lists, or strings).

        ``temperature=0`` is greedy decoding. Sample ``j`` of ``prompts[i]`` draws from its
        own seed, derived from ``(seed, i, j)``: the same call seed gives the same samples for
        that prompt whatever the other prompts, ``n`` or ``dp_size`` are (``seed=None``
        draws a call seed from the worker's own random stream). Calls from several threads
        run concurrently and are batched together by the engines.
        ``return_logprobs=True`` fills ``batch.logprobs`` (see :class:`RolloutBatch`).
        ``prompt_offset=k``: ``prompts[i]`` draws as global prompt ``k + i`` does, so processes
        that each generate their share of a global batch (same ``seed``) draw what one worker
        would over the whole batch.
        """
        request = self._request(prompts, locals())
        start = time.perf_counter()
        with counting_compiles() as compiles, self._closed_is_clear():
            self._admit()
            try:
                version = self.weight_version
                futures = [(w, rows, w.engine.submit(*part)) for w, rows, part in self._group.split(request.prompts, request.params, request.seeds)]
                outputs = merge([(rows, future.result()) for _, rows, future in futures])
            finally:
                self._gate.leave()
        self._phases.record("generate", time.perf_counter() - start, rows=len(outputs))
        return self._pack(request, outputs, version, compiles.value)

    async def agenerate(self, prompts, **options) -> RolloutBatch:
        """:meth:`generate` for asyncio callers: awaits the engines without blocking the loop.
        Cancelling it (``asyncio.wait_for``'s timeout, a task's ``cancel()``) aborts its rows
        in the engines: they stop within a forward and free their KV cache."""
        request = self._request(prompts, {"self": self, "prompts": prompts, **options})
        with counting_compiles() as compiles, self._closed_is_clear():
            await self._aadmit()
            try:
                version = self.weight_version
                futures = [(w, rows, w.engine.submit(*part)) for w, rows, part in self._group.split(request.prompts, request.params, request.seeds)]
                results = await asyncio.gather(*(asyncio.wrap_future(future) for _, _, future in futures))
                outputs = merge([(rows, result) for (_, rows, _), result in zip(futures, results)])
            finally:
                self._gate.leave()
        return self._pack(request, outputs, version, compiles.value)

    async def astream(self, prompts, **options) -> AsyncIterator[StreamChunk]:
        """Stream completions as tokens arrive: one :class:`StreamChunk` per row update
        (the new tokens since that row's last chunk), and a last chunk per row carrying its
        ``finish_reason``. Takes :meth:`generate`'s arguments except ``pad_prompts_to``.
        Leaving the loop early (``break``, ``aclose()``, cancellation) aborts the rows still
        generating."""
        if "pad_prompts_to" in options:
            raise TypeError("astream() got an unexpected keyword argument 'pad_prompts_to': streamed rows are not padded")
        request = self._request(prompts, {"self": self, "prompts": prompts, **options})
        await self._aadmit()
        try:
            version = self.weight_version
            updates: asyncio.Queue = asyncio.Queue()

            async def pump(weights, rows, part):
                async for row, output in weights.engine.astream(*part):
                    await updates.put((rows[row], output))

            parts = self._group.split(request.prompts, request.params, request.seeds)
            tasks = [asyncio.ensure_future(pump(w, rows, part)) for w, rows, part in parts]
            pending = set(tasks)

            def ended(task):
                pending.discard(task)
                if not pending or (not task.cancelled() and task.exception() is not None):
                    updates.put_nowait(None)

            for task in tasks:
                task.add_done_callback(ended)
            sent = [0] * (len(request.prompts) * request.params.n)
            try:
                with self._closed_is_clear():
                    while (update := await updates.get()) is not None:
                        row, output = update
                        new = output.output_ids[sent[row] :]
                        end = len(output.output_ids)
                        logprobs = None if output.logprobs is None else output.logprobs[sent[row] : end]
                        versions = None if output.token_versions is None else output.token_versions[sent[row] : end]
                        sent[row] = end
                        if new or output.finish_reason:
                            n = request.params.n
                            yield StreamChunk(row, row // n, row % n, new, output.finish_reason or None, version, logprobs, versions)
                    for task in tasks:
                        if task.done() and not task.cancelled() and task.exception() is not None:
                            raise task.exception()
            finally:
                for task in tasks:
                    task.cancel()
                # Every pump's outcome is collected (no "exception was never retrieved").
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._gate.leave()

    @contextlib.contextmanager
    def _closed_is_clear(self) -> Iterator[None]:
        """A call that the worker's close() ended fails with WorkerClosed, not with whatever the
        engines' shutdown left it to trip on (their error, or state already torn down)."""
        try:
            yield
        except WorkerClosed:
            raise
        except Exception as exc:
            if self._closed:
                raise WorkerClosed("the RolloutWorker was closed during the call") from exc
            raise

    def _request(self, prompts, arguments: dict) -> _Request:
        """Validate a generate call's arguments (``generate``'s own names)."""
        self._check_open()
        options = {k: v for k, v in arguments.items() if k not in ("self", "prompts", "pad_prompts_to", "prompt_offset")}
        unknown = set(options) - {f.name for f in dataclasses.fields(SamplingParams)}
        if unknown:
            raise TypeError(f"generate() got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        params = SamplingParams(**options)
        prompt_ids = prompt_token_ids(
            prompts, vocab_size=self.vocab_size, tokenizer=self._tokenizer, model_path=self.config.model_path
        )
        config = self.config
        rows = len(prompt_ids) * params.n
        check_limit("n", "rows (prompts x n)", rows, "WorkerConfig.max_rows_per_call", config.max_rows_per_call)
        tokens = params.n * sum(len(p) + params.max_new_tokens for p in prompt_ids)
        check_limit("prompts", "tokens (prompt + max_new_tokens, over every row)", tokens, "WorkerConfig.max_tokens_per_call", config.max_tokens_per_call)
        for j, stop in enumerate(params.stop_token_ids):
            if stop >= self.vocab_size:
                raise InvalidRequest(f"stop_token_ids[{j}]", f"stop_token_ids[{j}] = {stop} is outside [0, {self.vocab_size})")
        engine = self.engine
        check_request_lengths(
            prompt_ids,
            params.max_new_tokens,
            context_length=engine.context_length,
            max_request_tokens=engine.max_request_tokens,
            max_prompt_tokens=engine.max_prompt_tokens,
            kv_pool_tokens=engine.kv_pool_tokens,
        )
        pad_to = pad_width(arguments.get("pad_prompts_to"), prompt_ids)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        call_seed = params.seed
        if call_seed is None:
            with self._state_lock:
                call_seed = int(self._rng.integers(MAX_SAMPLING_SEED))
        params = dataclasses.replace(params, stop_token_ids=tuple(sorted(stop)), seed=call_seed)
        offset = arguments.get("prompt_offset", 0)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"prompt_offset must be a non-negative int, got {offset!r}")
        seeds = row_seeds(call_seed, len(prompt_ids), params.n, first_prompt=offset)
        return _Request(prompt_ids, params, seeds, pad_to)

    def _admit(self) -> None:
        """Enter the gate as a generate call, rebuilding the KV caches first if dropped."""
        while True:
            if self._kv_dropped:
                self._rebuild_kv()
            self._gate.enter()
            if self._admitted():
                return

    async def _aadmit(self) -> None:
        while True:
            if self._kv_dropped:
                await asyncio.to_thread(self._rebuild_kv)
            await self._gate.aenter()
            if self._admitted():
                return

    def _admitted(self) -> bool:
        """Right after entering the gate: False (gate left) when the KV caches were dropped
        meanwhile; raises (gate left) when the weights cannot serve."""
        if self._kv_dropped:
            self._gate.leave()
            return False
        try:
            self._check_weights_alive()
        except BaseException:
            self._gate.leave()
            raise
        return True

    def _check_weights_alive(self) -> None:
        self._check_open()
        if self._stale_reason is not None:
            raise WorkerUnavailable(self._stale_reason, f"{self._stale_reason}: call worker.sync_params(params) before generate")
        for index, weights in enumerate(self._group.weights):
            dead = weights.dead_leaves()
            if dead:
                raise WorkerUnavailable(
                    f"the weights of engine {index} were freed",
                    f"the weights of engine {index} were freed ({len(dead)} leaves, e.g. '{dead[0]}'): "
                    "the trainer donated buffers the engine was using. Call worker.sync_params(params) "
                    "before generate."
                )

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerClosed()

    def _pack(self, request: _Request, outputs: list[GenerateOutput], version: int, compiles: int) -> RolloutBatch:
        params = request.params
        completions = [list(o.output_ids[: params.max_new_tokens]) for o in outputs]
        texts = None
        if self._tokenizer is not None:
            texts = [self._tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        return pack_rollouts(
            request.prompts,
            completions,
            n=params.n,
            completion_width=params.max_new_tokens,
            pad_token_id=self.pad_token_id,
            finish_reasons=[o.finish_reason for o in outputs],
            weight_version=version,
            seeds=request.seeds.reshape(-1),
            compiles=compiles,
            completion_texts=texts,
            prompt_width=request.pad_prompts_to,
            logprobs=[o.logprobs[: len(c)] for o, c in zip(outputs, completions)] if params.return_logprobs else None,
            kept_counts=[o.kept_counts[: len(c)] for o, c in zip(outputs, completions)] if params.return_logprobs else None,
            token_versions=(
                None if any(o.token_versions is None for o in outputs)
                else [o.token_versions[: len(c)] for o, c in zip(outputs, completions)]
            ),
        )

    # ---- weight checks (the server's admin routes) -------------------------------------------

    def weights_checksum(self) -> dict:
        """A checksum of the weights being served, computed on device: the same weights give
        the same value in any process and any sharding. Returns ``checksum`` (hex, of the
        first engine), ``weight_version``, ``leaves`` and, with several engines, ``per_engine``."""
        weights = [leaf for leaf in self.leaves if not leaf.rng_state]
        with self._sync_lock:  # no swap frees the leaves being read
            self._check_weights_alive()
            version = self.weight_version
            checksums = []
            for engine in (e for e in self.engines if e.alive):
                arrays = engine.weight_leaves()
                checksums.append(weight_check.weights_checksum([w.path for w in weights], [arrays[w.index] for w in weights]))
        report = {"checksum": checksums[0], "weight_version": version, "leaves": len(weights)}
        if len(checksums) > 1:
            report["per_engine"] = checksums
        return report

    def perturb_weights(
        self, seed: int, scale: float, num_leaves: int, *, check_finite: bool = True, in_flight: bool = False
    ) -> dict:
        """Add ``scale * normal(key(seed, i))`` to the first ``num_leaves`` weight leaves (engine
        order), on every engine: a deterministic weight update for testing the update path
        (``in_flight`` as for ``sync_params``). Perturbed weights that are not finite are
        refused as by ``sync_params`` (the previous weights keep serving). Returns the perturbed
        leaf paths and the new weight version."""
        weights = [leaf for leaf in self.leaves if not leaf.rng_state]
        seed = as_int("seed", seed, minimum=0)
        if seed > MAX_PERTURB_SEED:
            raise InvalidRequest("seed", f"seed must be in [0, {MAX_PERTURB_SEED}], got {seed}")
        if isinstance(num_leaves, bool) or not isinstance(num_leaves, int) or not 1 <= num_leaves <= len(weights):
            raise InvalidRequest("num_leaves", f"num_leaves must be an int in [1, {len(weights)}], got {num_leaves!r}")
        if not math.isfinite(scale):
            raise InvalidRequest("scale", f"scale must be a finite number, got {scale!r}")
        self._check_weights_alive()
        # Held from reading the leaves to the swap, so no sync lands in between and is undone.
        with self._sync_lock:
            new_leaves = []
            for engine in self.engines:
                arrays = engine.weight_leaves() if engine.alive else None
                new_leaves.append(
                    {}
                    if arrays is None
                    else {w.index: weight_check.perturbed(arrays[w.index], seed, i, float(scale)) for i, w in enumerate(weights[:num_leaves])}
                )
            if check_finite:
                perturbed = new_leaves[0]
                bad = weight_check.non_finite([w.path for w in weights[:num_leaves]], [perturbed[w.index] for w in weights[:num_leaves]])
                if bad:
                    raise InvalidRequest("scale", f"the perturbation makes weights non-finite (nan/inf) in: {', '.join(bad[:8])}")
            version = self.replace_engine_leaves(new_leaves, "weights are being perturbed", in_flight=in_flight)
        return {"leaves": [w.path for w in weights[:num_leaves]], "weight_version": version}

    def serve(self, host: str = "127.0.0.1", port: int = 0, **options):
        """Serve this worker over HTTP (OpenAI-compatible and admin routes) from this process;
        ``options`` are :class:`rollout.server.ServerConfig` fields. Returns the started
        :class:`rollout.server.Server` (``url``, ``close()``)."""
        self._check_open()
        # Imported here so that FastAPI loads only when serving.
        from .server import ServerConfig, start_server

        return start_server(self, ServerConfig(host=host, port=port, **options))

    def check_consistency(self, params: Mapping, prompts, **kwargs) -> ConsistencyReport:
        """Engine log-probs against the Flax model's on ``params``: see :func:`rollout.check_consistency`."""
        return check_consistency(self, params, prompts, **kwargs)


def _check_swap_mode(in_flight: bool, recompute_kv: bool) -> None:
    if recompute_kv and not in_flight:
        raise InvalidRequest("recompute_kv", "recompute_kv=True needs in_flight=True: a drain swap has no running request to recompute")


def _combine_sync_reports(reports: list[SyncReport], compiles: int) -> SyncReport:
    if len(reports) == 1:
        return dataclasses.replace(reports[0], compiles=compiles)
    fields = ("leaves_aliased", "leaves_relabeled", "leaves_copied", "leaves_resharded", "bytes_aliased", "bytes_copied")
    totals = {name: sum(getattr(r, name) for r in reports) for name in fields}
    return dataclasses.replace(reports[0], **totals, compiles=compiles, per_engine=tuple(reports))


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

