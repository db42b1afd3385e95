"""The rollout worker: sglang-jax engines in the trainer's process.

A facade over its parts, which it is handed rather than inheriting from: ``group`` (the
engines: a sync's prepare and commit, generate fan-out, KV, liveness), ``weights`` (sync plans,
leaf ownership, checkpoint targets), ``kv`` (KV lifecycle, memory accounting), ``sampling``
(validated generate calls), ``stream`` (streamed calls), ``weight_tools`` (the admin weight
tools), ``gate`` (concurrent calls versus exclusive changes) and ``phase_log``. What the facade
itself owns is the order of things: locks, the gate, the weight version.

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
import numbers
import re
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping, Sequence

import jax
import numpy as np

from models import ParamMapping
from trainer_bridge import (
    LoraConfig,
    SyncError,
    SyncReport,
    flatten_params,
    load_hf_params,
    non_finite_leaves,
    unflatten_params,
)
from trainer_bridge.checkpoint import resolve_checkpoint, restore_saved, saved_layout
from trainer_bridge.hf import hf_model_dir, hf_source
from trainer_bridge.lora import (
    canonical_adapters,
    collect_adapters,
    is_adapter_tree,
    is_factor_path,
    merge_adapters,
)
from trainer_bridge.sync import EngineLeaf, beyond_range, check_live, finite_as_given

from . import episodes, kv, stream, weight_tools
from .batch import RolloutBatch, StreamChunk, pack_rollouts
from .chat import completion_text
from .compiles import counting_compiles
from .config import WorkerConfig, check_same_forward, has_tokenizer_files
from .consistency import ConsistencyReport, check_consistency
from .engine import EngineHandle, GenerateOutput, SessionStats, in_slot, interrupts_deferred
from .episodes import EpisodeBatch, EpisodeLimits, run_until_returned
from .errors import InvalidRequest, WorkerClosed, WorkerUnavailable
from .gate import EngineGate, GateClosed
from .group import EngineGroup
from .in_place_updates import check_in_place_updates
from .kv import KvReport, MemoryReport
from .phase_log import PhaseLog
from .pod import PeerSyncError, Pod, tree_fingerprint
from .sampling import GenerateRequest, RequestValidator, SamplingParams
from .weight_tools import check_swap_mode

logger = logging.getLogger(__name__)


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
            self._phases.record("engine_ready", time.perf_counter() - start)
        except BaseException:
            self._group.close()
            raise

    def _set_up(self, config: WorkerConfig) -> None:
        # Lock order (always taken in this order, never the reverse): ``_sync_lock`` (one
        # weight change at a time, held while new weights are prepared), then the gate's
        # exclusive section (no generate call in flight), then ``_state_lock`` (the fields
        # below). Generate calls take the gate (admitted) and, briefly, ``_state_lock``; one that
        # finds the KV dropped rebuilds it first, as an exclusive change, before it is admitted.
        self._sync_lock = threading.RLock()
        self._gate = EngineGate()
        self._state_lock = threading.RLock()
        self._closed = False
        self.weight_version = 0
        self._kv_dropped = False
        # Why generate calls are refused while the KV cache stays dropped (drop_kv(hold=reason)).
        self._kv_hold_reason: str | None = None
        self._stale_reason: str | None = None
        self._tokenizer = _load_tokenizer(config.model_path)
        self.pad_token_id = _pad_token_id(self._tokenizer)
        self.eos_token_ids = _eos_token_ids(self._tokenizer, self.engine.eos_token_ids)
        self._requests = RequestValidator(config, self.engine, self._tokenizer, self.eos_token_ids)
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
    def max_prompt_tokens(self) -> int:
        """Most prompt tokens one row may have (the engine's limit)."""
        return self.engine.max_prompt_tokens

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
        train step in progress, weights stale after a train step, or a KV cache held dropped)."""
        if self._closed:
            return "the worker is closed"
        return self._gate.exclusive_reason or self._stale_reason or self._kv_hold_reason

    # ---- weights ---------------------------------------------------------------------------

    def sync_params(
        self,
        params: Mapping,
        *,
        adapters: Mapping | None = None,
        lora: LoraConfig | None = None,
        allow_cast: bool = True,
        check_finite: bool = True,
        in_flight: bool = False,
        recompute_kv: bool = False,
        version: int | None = None,
    ) -> SyncReport:
        """Make the engines generate with ``params`` (MLLM-JAX layout; ``{'params': ...}`` too).

        With ``adapters`` (a LoRA tree in the same layout: ``<module>.lora_a`` [in, r] and
        ``<module>.lora_b`` [r, out] beside each adapted ``<module>.kernel``, or qwix's
        ``kernel_lora_a`` / ``kernel_lora_b``) and ``lora`` (:class:`LoraConfig`), ``params`` is
        the frozen base: each adapted kernel is served as ``kernel + (alpha / r) * A @ B``,
        merged on device in one jitted program into new buffers the engines then own, and every
        other leaf is synced as below (zero copy where it can be). On a worker started with
        ``WorkerConfig.unmerged_lora`` the engines compute the adapters beside the base instead:
        the factors are synced like leaves, and base leaves passed again as the same arrays are
        kept as served (docs/worker.md). Missing, extra or misshapen adapters, and target
        modules the model lacks, are a SyncError naming the path.

        Leaves whose shape, dtype and placement already match an engine's are used as they
        are (zero copy); the rest are cast / transposed / resharded on device in one jitted
        call per engine. The swap waits for running generate calls and holds new ones back
        until it is done. On any error nothing changes: the previous weights keep serving and
        the version stays. The engines may keep using the trainer's buffers until the next
        sync: a train step that donates them must be followed by a sync before the next
        generate. ``check_finite`` (on by default) refuses NaN/inf weights, naming the paths, and
        finite ones the cast to the engine's dtype would make infinite: it reads every weight
        once (1.5-2.6x one plain read on XLA:CPU; ``bench.sync_bench``), the price of never serving a
        broken policy silently; pass False where that read matters.

        ``in_flight=True`` swaps without draining: each engine stops at its next forward
        boundary (the sync waits at most one forward step, however long the running requests
        are), swaps, flushes its prefix cache and resumes the requests that were running;
        generate calls are admitted throughout. Those requests continue from the KV computed
        under the old weights, or with ``recompute_kv=True`` are prefilled again under the new
        weights before their next token. Every token records the version that sampled it
        (``batch.token_versions``) and its log-prob is that version's, so importance weights
        stay exact.

        ``version``: the version the new weights are labelled with (``weight_version``,
        ``batch.weight_version``, ``token_versions``), an int above the one served, such as the
        trainer's step, so versions read as steps across a resume (None: one more than served).
        """
        if (adapters is None) != (lora is None):
            missing = "lora" if lora is None else "adapters"
            raise InvalidRequest(
                missing,
                f"sync_params: adapters and lora (a LoraConfig) go together; {missing} is missing",
            )
        merge, given = None, {}  # given: the unmerged factors' paths in the caller's tree
        if adapters is not None and self.config.unmerged_lora is not None:
            try:
                flat = flatten_params(params)
            except (TypeError, ValueError) as exc:
                raise SyncError(str(exc)) from None
            adapter_flat, given = self._unmerged_adapters(adapters, lora, flat)
            own = next(filter(is_factor_path, flat), None)
            if own is not None:  # one set would silently replace the other
                raise SyncError(
                    f"params holds LoRA factors ('{own}') and adapters= gives them too: pass the adapters "
                    "once, in params or as adapters="
                )
            params = {**flat, **adapter_flat}
        elif adapters is not None:
            merge = (adapters, lora)
        else:
            params, given = self._factors_renamed(params)
        with _naming_factors_as_given(given):
            return self._sync(
                params,
                "sync_params",
                lora=merge,
                allow_cast=allow_cast,
                check_finite=check_finite,
                in_flight=in_flight,
                recompute_kv=recompute_kv,
                version=version,
            )

    def sync_adapters(
        self,
        adapters: Mapping,
        lora: LoraConfig | None = None,
        *,
        name: str | None = None,
        check_finite: bool = True,
        in_flight: bool = False,
        recompute_kv: bool = False,
    ) -> SyncReport:
        """Serve new LoRA ``adapters`` on the base the engines serve now, moving the adapters'
        bytes alone: for workers started with ``WorkerConfig.unmerged_lora`` (whose rank, alpha
        and targets ``lora``, if given, must equal). The adapter tree as for ``sync_params``;
        NaN/inf refused, and factors whose product would overflow float32 (docs/worker.md);
        ``in_flight``, ``recompute_kv`` and errors as there.

        ``name``: load them beside the default adapters, into a slot of their own
        (``WorkerConfig.max_loras`` > 1; the name's slot if it has one), for the calls that
        ask for them (``generate(..., lora=name)``); :meth:`unload_adapters` frees the slot."""
        self._check_open()
        flat, given = self._unmerged_adapters(adapters, lora, None)
        # Syncs take turns: the slot chosen is still free when it is filled.
        with self._gate.holding(self._sync_lock, "sync_adapters()"):
            slot = self._adapter_slot(name)
            flat = {in_slot(path, slot): leaf for path, leaf in flat.items()}
            swap = dict(check_finite=check_finite, in_flight=in_flight, recompute_kv=recompute_kv)
            with _naming_factors_as_given({in_slot(path, slot): path_given for path, path_given in given.items()}):
                report = self._sync(flat, "sync_adapters", allow_cast=True, **swap)
            if name is not None:
                with self._state_lock:
                    for weights in self._group.weights:
                        weights.engine.name_adapters(name, slot)
        return report

    def _adapter_slot(self, name: str | None) -> int:
        """The slot adapters named ``name`` go to: 0 (the default) for None, the name's own,
        or the first free one."""
        if name is None:
            return 0
        if not isinstance(name, str) or not name.strip():
            raise SyncError(f"name must be a non-empty string or None, got {name!r:.80}")
        if self.config.max_loras < 2:
            raise SyncError(
                f"adapters named {name!r}: this worker serves the default adapters alone (WorkerConfig.max_loras="
                f"{self.config.max_loras}); start it with max_loras > 1 to load named ones beside them"
            )
        # A slot is free once no name maps to it and no request still runs on it (an unloaded
        # name's calls finish on their adapters, even across an in-flight sync). The names are
        # read first, with unloads held off: a call registers on its slot only while its name
        # maps to it, so a slot named then is either taken below or seen running.
        with self._state_lock:
            names = dict(self._group.first.engine.lora_names)
            running = {slot for weights in self._group.weights for slot in weights.engine.lora_slots_in_use()}
        if name in names:
            return names[name]
        free = sorted(set(range(1, self.config.max_loras)) - set(names.values()) - running)
        if not free:
            raise SyncError(
                f"adapters named {name!r}: WorkerConfig.max_loras={self.config.max_loras} holds the default "
                f"adapters and {self.config.max_loras - 1} named ones ({sorted(names)}, and slots still used by "
                "running calls of unloaded ones); unload_adapters(name) one first, or start the worker with more"
            )
        return free[0]

    def adapter_names(self) -> list[str]:
        """The names of the adapters loaded beside the default ones (``sync_adapters(name=)``)."""
        return sorted(self._group.first.engine.lora_names)

    def unload_adapters(self, name: str) -> bool:
        """Forget the adapters loaded under ``name``: calls asking for it are refused from now
        on, those running finish with them, and its slot is free for others once they have.
        False if none was loaded."""
        self._check_open()
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequest("name", f"unload_adapters: name must be a non-empty string, got {name!r:.80}")
        with self._state_lock:  # from every engine (any() would stop at the first that had it)
            unloaded = [weights.engine.unload_adapters(name) for weights in self._group.weights]
        return any(unloaded)

    def _factors_renamed(self, params: Mapping) -> tuple[dict, dict[str, str]]:
        """``params`` flat, with the LoRA factors it holds beside its base (on a worker that
        computes adapters unmerged) under this project's names, whichever accepted layout they
        came in (qwix's ``kernel_lora_a``: a Tunix model's state); and each renamed factor's
        path in ``params``."""
        try:
            flat = flatten_params(params)
        except (TypeError, ValueError) as exc:
            raise SyncError(str(exc)) from None
        factors = {path: leaf for path, leaf in flat.items() if is_factor_path(path)}
        if self.config.unmerged_lora is None or not factors:
            return flat, {}
        base = {path: leaf for path, leaf in flat.items() if path not in factors}
        return {**base, **canonical_adapters(factors)}, canonical_adapters({path: path for path in factors})

    def _unmerged_adapters(
        self, adapters: Mapping, lora: LoraConfig | None, base: Mapping | None
    ) -> tuple[dict, dict[str, str]]:
        """The adapter tree, checked (against the flat ``base``, or the served kernels' shapes)
        and under the engine's factor names, and each such name's path in ``adapters``; SyncError
        when the worker serves no unmerged adapters or ``lora`` is not the configuration they
        were started with."""
        served = self.config.unmerged_lora
        if served is None:
            raise SyncError(
                "adapters alone: this worker merges adapters into the weights at sync, so it no longer "
                "has the base to put new ones on; start it with WorkerConfig(unmerged_lora=LoraConfig(...)), "
                "or call sync_params(base, adapters=..., lora=...)"
            )
        if lora is not None and lora != served:
            raise SyncError(
                f"lora: {lora} is not the engines' WorkerConfig.unmerged_lora {served}; unmerged adapters "
                "have the rank, alpha and target modules the engines were started with"
            )
        if not isinstance(adapters, Mapping):
            raise SyncError(
                f"adapters must be a tree of LoRA factors (a mapping, such as the trainer's adapter params), "
                f"got {type(adapters).__name__}"
            )
        try:
            flat = flatten_params(adapters)
        except (TypeError, ValueError) as exc:
            raise SyncError(f"adapters: {exc}") from None
        weights = self._group.first
        collect_adapters(flat, weights.kernel_shapes() if base is None else base, weights.kernel_paths(), served)
        return canonical_adapters(flat), canonical_adapters({path: path for path in flat})

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
        lora: tuple[Mapping, LoraConfig] | None = None,
        version: int | None = None,
    ) -> SyncReport:
        """``lora``: (adapters, LoraConfig), merged into ``params`` first; ``version`` as
        ``sync_params`` takes it."""
        start = time.perf_counter()
        self._check_open()
        check_swap_mode(in_flight, recompute_kv, allow_cast=allow_cast, check_finite=check_finite)
        if not in_flight:  # before any other process hears of the call: it would wait for ever
            self._gate.check_no_own_calls(f"{call}()")
        try:
            flat = flatten_params(params)
            adapter_flat = flatten_params(lora[0]) if lora else {}
        except (TypeError, ValueError) as exc:
            raise SyncError(str(exc)) from None
        with self._closed_is_clear(), self._gate.holding(self._sync_lock, f"{call}()"), counting_compiles() as compiles:
            # Under the lock: another sync may have moved the version on.
            version = self._next_version(version)
            # Before any collective: every process makes this call with a tree of this structure.
            self._group.pod.agree(
                call,
                f"{tree_fingerprint(flat)} allow_cast={allow_cast} check_finite={check_finite} "
                f"in_flight={in_flight} recompute_kv={recompute_kv} version={version} "
                f"lora={lora and (tree_fingerprint(adapter_flat), lora[1])}",
            )

            def prepare():
                # Before anything reads them (adapter factors: collect_adapters); in a pod, a leaf
                # deleted on one process only is its part failing, which the others hear of at once.
                check_live(flat)
                merged, merged_bytes = flat, 0
                if lora:
                    adapters = collect_adapters(adapter_flat, flat, self._group.first.kernel_paths(), lora[1])
                    if check_finite:  # named here: a merged kernel's NaN would name the kernel
                        paths, factors = list(adapter_flat), list(adapter_flat.values())
                        bad = non_finite_leaves(factors)
                        # Finite as given (float64) but not in the float32 the merge computes in.
                        wide = [paths[i] for i in bad if finite_as_given(factors[i])]
                        nan = [paths[i] for i in bad if paths[i] not in wide]
                        problems = [f"non-finite values (nan/inf) in: {', '.join(nan[:8])}"] if nan else []
                        if wide:
                            problems.append(
                                f"{beyond_range(np.float32)}, finite in the adapters, infinite in the float32 "
                                f"merge, in: {', '.join(wide[:8])}"
                            )
                        if problems:
                            raise SyncError("; ".join(problems))
                    merged = merge_adapters(self._placed_for_merge(flat, adapters), adapters, lora[1])
                    merged_bytes = sum(merged[adapter.kernel].nbytes for adapter in adapters)
                trees, gathered = self._group.localize(merged, call)
                try:
                    prepared = self._group.prepare(
                        trees, allow_cast=allow_cast, check_finite=check_finite, origins=merged
                    )
                except SyncError as error:
                    raise _merge_overflow(error, flat, adapters) if lora else error from None
                return prepared, gathered, merged_bytes

            # In a pod every process reaches its commit or none does: one whose shards fail a
            # check (a NaN in its part of the tree) would otherwise stay a version behind for good.
            prepared, gathered, merged_bytes = self._group.pod.settle(f"{call} (prepared)", prepare)
            # A Ctrl-C while the engines swap: the version they now serve is recorded first.
            with self._swapping(reason, in_flight), interrupts_deferred():
                committed = self._group.commit(prepared, version, in_flight=in_flight, recompute_kv=recompute_kv)
                self._stale_reason = None
                self.weight_version = version
        seconds = time.perf_counter() - start
        reports = {i: prepared[i].plan.report(version, seconds, prepared[i].relabeled) for i in committed}
        report = dataclasses.replace(
            _combine_sync_reports(reports, len(self.engines), compiles.value),
            bytes_gathered=gathered,
            bytes_merged=merged_bytes,
        )
        logger.info("sync_params: %s", report)
        self._phases.record("weights_synced", seconds, version=version, bytes_copied=report.bytes_copied)
        return report

    def check_params(self, params: Mapping) -> None:
        """Check a trainer tree as :meth:`sync_params` checks it (paths, shapes, dtypes against
        the mapping table and the engine), without syncing: a :class:`SyncError` naming the
        path. Casts are allowed, values not read."""
        self._check_open()
        flat, given = self._factors_renamed(params)
        weights = self._group.first
        with _naming_factors_as_given(given):
            check_live(flat)
            weights.plan_for(weights.with_adapters(flat), allow_cast=True)

    def sync_memory_analysis(self, params: Mapping):
        """XLA's memory analysis of the jitted copy a sync of ``params`` runs on the first
        engine (after a first sync of the same structure): output and temporary bytes."""
        self._check_open()
        return self._group.first.memory_analysis(flatten_params(params))

    def _placed_for_merge(self, flat: Mapping[str, object], adapters) -> Mapping[str, object]:
        """``flat`` with each adapted kernel that has no placement of its own (host arrays, as
        ``load_hf_params`` gives them; uncommitted ones) put where the engines keep it: merged
        there, the engines use the merged kernel as it is, where a merge on JAX's default device
        took that device's memory and was copied again. (In a pod the trainer's leaves are
        global arrays: the reshard across processes places them.)"""
        if self._group.pod.multi_process:
            return flat
        unplaced = [
            a.kernel for a in adapters if not (isinstance(flat[a.kernel], jax.Array) and flat[a.kernel].committed)
        ]
        if not unplaced:
            return flat
        shardings = self._group.param_shardings()
        return {**flat, **{path: jax.device_put(flat[path], shardings[path]) for path in unplaced}}

    def call_seed(self, seed: int | None = None) -> int:
        """The seed a call given ``seed`` samples under: ``seed`` (an int64, else
        InvalidRequest), or for None the next one of the worker's stream, seeded with
        ``WorkerConfig.seed`` (as ``generate`` and ``run_episodes`` draw theirs)."""
        return self._requests.call_seed(seed)

    def param_shardings(self) -> dict:
        """Where to place a trainer param tree so that ``sync_params`` moves no bytes.

        A nested dict in the trainer layout: each leaf the engines use as it is gets the
        engine's sharding (with several engines: that sharding within each engine's devices,
        replicated across engines); the others (transposed; k/v projections, whose heads the
        engine may repeat) are replicated, and the sync transforms them.
        """
        self._check_open()
        return unflatten_params(self._group.param_shardings())

    def adapter_shardings(self) -> dict:
        """Where to place a LoRA adapter tree (this project's ``lora_a``/``lora_b`` names) so
        that ``sync_adapters`` moves no bytes, for a worker started with
        ``WorkerConfig.unmerged_lora`` (an empty dict otherwise): A split like its kernel's
        input axis, B like its output axis; B of k/v projections whose heads the engine repeats
        replicated (the sync repeats them)."""
        self._check_open()
        return unflatten_params(self._group.param_shardings(adapters=True))

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

    def load_hf(
        self, model_dir, *, check_finite: bool = True, in_flight: bool = False, recompute_kv: bool = False
    ) -> SyncReport:
        """Serve the weights of an HF safetensors directory (single file or sharded with an
        index json), through the same plan as ``sync_params`` (NaN/inf refused unless
        ``check_finite=False``; ``in_flight``, ``recompute_kv`` as there). A config.json that
        sets the forward otherwise than the served model's (heads, RoPE, norm epsilon, ...: what
        the weights' shapes do not show) is refused. On error nothing changes."""
        self._check_open()
        check_swap_mode(in_flight, recompute_kv, check_finite=check_finite)
        hf_model_dir(model_dir)  # a missing dir, a file, no weights: named first, as the load names them
        check_same_forward(self.config.model_path, model_dir)  # before reading the weights
        try:
            return self._sync(
                load_hf_params(model_dir, dtype=None),
                "load_hf",
                allow_cast=True,
                check_finite=check_finite,
                in_flight=in_flight,
                recompute_kv=recompute_kv,
                reason="weights are being reloaded",
            )
        except SyncError as error:
            # Named as the files hold it: the sync names the trainer's path, in the trainer's layout.
            if error.path:
                source = hf_source(model_dir, error.path)
                if source:
                    raise SyncError(f"{model_dir}: {source}: {error}", error.non_finite, error.path) from None
            sources = [f"{path}: {source}" for path in error.non_finite[:8] if (source := hf_source(model_dir, path))]
            if not sources:
                raise
            raise SyncError(f"{model_dir}: {error} ({'; '.join(sources)})", error.non_finite, error.path) from None

    def load_checkpoint(
        self,
        path,
        step: int | None = None,
        *,
        check_finite: bool = True,
        in_flight: bool = False,
        recompute_kv: bool = False,
    ) -> SyncReport:
        """Serve a trainer param tree saved with orbax: a ``StandardCheckpointer`` directory,
        or a ``CheckpointManager`` root (latest step, or ``step``). A checkpoint of LoRA
        adapters alone is loaded as :meth:`load_adapters` loads it.

        Leaves the engines can use as they are restored straight into the engines' dtype and
        sharding and then aliased; the others are restored replicated and transformed on
        device. No host copy of the tree is made. NaN/inf weights are refused as by
        ``sync_params`` (``check_finite=False`` skips that read); ``in_flight``,
        ``recompute_kv``: as for ``sync_params``. On error nothing changes.
        """
        swap = dict(check_finite=check_finite, in_flight=in_flight, recompute_kv=recompute_kv)
        return self._load_orbax(path, step, adapters_only=False, **swap)

    def load_adapters(
        self,
        path,
        step: int | None = None,
        *,
        name: str | None = None,
        check_finite: bool = True,
        in_flight: bool = False,
        recompute_kv: bool = False,
    ) -> SyncReport:
        """Serve the LoRA adapters of an orbax checkpoint (of the adapter tree alone, in either
        accepted layout) on the base the engines serve, as :meth:`sync_adapters` does (``name``
        as there): for workers started with ``WorkerConfig.unmerged_lora``. A checkpoint
        holding anything but LoRA factors is a SyncError naming a path that is not one; the
        rest as :meth:`load_checkpoint`."""
        swap = dict(check_finite=check_finite, in_flight=in_flight, recompute_kv=recompute_kv)
        return self._load_orbax(path, step, adapters_only=True, name=name, **swap)

    def _load_orbax(
        self,
        path,
        step: int | None,
        *,
        adapters_only: bool,
        check_finite: bool,
        in_flight: bool,
        recompute_kv: bool,
        name: str | None = None,
    ) -> SyncReport:
        self._check_open()
        check_swap_mode(in_flight, recompute_kv, check_finite=check_finite)
        item_dir = resolve_checkpoint(path, step)
        layout = saved_layout(item_dir)
        saved = layout.flat
        adapters = is_adapter_tree(saved)
        if adapters_only and not adapters:
            other = next(p for p in saved if not is_factor_path(p)) if saved else "<empty tree>"
            raise SyncError(f"checkpoint {item_dir} is not of LoRA adapters alone: '{other}' is not a LoRA factor")
        if adapters and self.config.unmerged_lora is None:
            raise SyncError(
                f"checkpoint {item_dir} holds LoRA adapters alone; loading them onto the served base "
                "needs a worker started with WorkerConfig(unmerged_lora=LoraConfig(...)) (a worker that "
                "merges adapters no longer has its base): restore it and call sync_params(base, "
                "adapters=..., lora=...)"
            )
        if adapters:  # targets by the engine's factor names, restored under the names it was saved with
            saved_as = canonical_adapters({path: path for path in saved})
            by_name = self._group.checkpoint_targets(
                {name: saved[path] for name, path in saved_as.items()}, item_dir, adapters_only=True
            )
            targets = {saved_as[name]: target for name, target in by_name.items()}
        else:  # a base with factors of qwix's names (unmerged LoRA) is read as the engine names them
            renamed, saved_as = self._factors_renamed(saved)
            with _naming_factors_as_given(saved_as):
                by_name = self._group.checkpoint_targets(renamed, item_dir)
            targets = {saved_as.get(name, name): target for name, target in by_name.items()}
        caller = "load_adapters" if adapters_only else "load_checkpoint"
        if not in_flight:
            self._gate.check_no_own_calls(f"{caller}()")
        # The restore is itself collective in a multi-process job (every process reads its shards).
        self._group.pod.agree(caller, tree_fingerprint(targets))
        restored = restore_saved(item_dir, layout, targets)
        swap = dict(check_finite=check_finite, in_flight=in_flight, recompute_kv=recompute_kv)
        try:
            if adapters:
                return self.sync_adapters(restored, name=name, **swap)
            restored, given = self._factors_renamed(restored)
            with _naming_factors_as_given(given):
                return self._sync(
                    restored, "load_checkpoint", allow_cast=True, reason="weights are being reloaded", **swap
                )
        except SyncError as exc:
            # orbax cast these leaves to the engine's dtype as it read them: what the check saw
            # as inf may be finite in the checkpoint, past the narrower dtype's range.
            narrowed = [
                p
                for p in exc.non_finite
                if p in targets and np.dtype(saved[p].dtype).itemsize > np.dtype(targets[p].dtype).itemsize
            ]
            if not narrowed:
                raise
            pod = self._group.pod.multi_process  # there a read is collective, and only this process failed
            if not pod:  # read again as saved: NaN/inf there is the checkpoint's own, not the cast's
                # Onto the host: a float64 leaf on a device would be float32 again.
                as_saved = {p: jax.ShapeDtypeStruct(targets[p].shape, saved[p].dtype) for p in narrowed}
                reread = restore_saved(item_dir, dataclasses.replace(layout, beside_others=True), as_saved)
                narrowed = [p for p in narrowed if finite_as_given(reread[p])]
                if not narrowed:
                    raise
            dtype = np.dtype(targets[narrowed[0]].dtype)
            cast = f"restored into the engine's {dtype} from the checkpoint's {np.dtype(saved[narrowed[0]].dtype)}"
            inf = f"{beyond_range(dtype)}, which are inf there" if pod else f"{beyond_range(dtype)} are inf there"
            note = f"NaN/inf in the checkpoint, or {inf}" if pod else inf
            raise SyncError(f"{exc} ({', '.join(narrowed[:8])} {cast}: {note})", exc.non_finite) from None

    def _replace_engine_leaves(
        self, new_leaves: Sequence[Mapping[int, jax.Array]], reason: str, *, in_flight: bool = False
    ) -> int:
        """Swap engine-owned arrays in by leaf index, one mapping per engine (same shapes,
        dtypes and shardings as the leaves they replace); ``in_flight`` as for ``sync_params``
        (the running requests keep their KV). Returns the new weight version."""
        with (
            self._closed_is_clear(),
            self._gate.holding(self._sync_lock, "perturb_weights()"),
            self._swapping(reason, in_flight),
            interrupts_deferred(),
        ):
            version = self.weight_version + 1
            self._group.replace_leaves(dict(enumerate(new_leaves)), version, in_flight=in_flight)
            self.weight_version = version
            return version

    # ---- KV cache and memory -----------------------------------------------------------------

    def drop_kv(self, *, hold: str | None = None) -> KvReport:
        """Free every engine's KV cache buffers (and prefix cache) until :meth:`rebuild_kv`.

        Waits for running generate calls. ``generate`` while dropped rebuilds first; with
        ``hold`` (a reason, e.g. a server's "the KV cache was dropped through /admin/drop_kv")
        it is refused instead (``WorkerUnavailable(hold)``) until :meth:`rebuild_kv`, calls
        already waiting to start included. Dropping twice frees nothing more. With every engine
        failed it frees what they hold, then raises their ``EngineError`` (a second drop too).
        """
        self._check_open()
        if hold is not None and (not isinstance(hold, str) or not hold.strip()):
            # An empty reason held nothing (a falsy hold is no hold), anything else would be shown as one.
            raise InvalidRequest(
                "hold", f"hold must be a non-empty string (the reason given to refused calls) or None, got {hold!r:.80}"
            )
        self._gate.check_no_own_calls("drop_kv()")
        self._group.pod.agree("drop_kv")
        return self._drop_kv(hold)

    def _drop_kv(self, hold: str | None = None) -> KvReport:
        with self._closed_is_clear(), self._gate.exclusive("the KV cache is being dropped"), self._state_lock:
            self._kv_hold_reason = hold or self._kv_hold_reason
            if self._kv_dropped:
                self._group.live()  # no engine running: its error, not a drop that did nothing
                return KvReport(0, 0, 0.0)
            start = time.perf_counter()
            try:
                reports = self._group.drop_kv()
            finally:
                # Where an engine's drop raised, those before it have no KV left: the next
                # generate rebuilds theirs (an engine that kept its buffers rebuilds nothing).
                self._kv_dropped = True
        report = kv.combine(list(reports.values()), time.perf_counter() - start)
        self._phases.record("kv_dropped", report.seconds, bytes=report.bytes)
        return report

    def rebuild_kv(self) -> KvReport:
        """Recreate the KV caches with their original shapes, dtype and sharding (no recompile),
        lifting a ``drop_kv(hold=...)``. After :meth:`released_for_training`, refused
        (``WorkerUnavailable``) until the next ``sync_params``: the train step's memory."""
        self._check_open()
        self._gate.check_no_own_calls("rebuild_kv()")
        self._group.pod.agree("rebuild_kv")
        return self._rebuild_kv(lift_hold=True)

    def _rebuild_kv(self, lift_hold: bool = False) -> KvReport:
        with self._closed_is_clear(), self._gate.exclusive("the KV cache is being rebuilt"), self._state_lock:
            if self._stale_reason is not None:  # a train step may be running: the memory is its
                raise self._stale_error()  # (an explicit rebuild_kv, /admin/rebuild_kv, too)
            if lift_hold:
                self._kv_hold_reason = None
            elif self._kv_hold_reason is not None:  # held since the caller found it dropped
                raise WorkerUnavailable(self._kv_hold_reason)
            if not self._kv_dropped:
                return KvReport(0, 0, 0.0)
            start = time.perf_counter()
            with interrupts_deferred():
                reports = self._group.rebuild_kv()
                self._kv_dropped = False
        report = kv.combine(list(reports.values()), time.perf_counter() - start)
        self._phases.record("kv_rebuilt", report.seconds, bytes=report.bytes)
        return report

    @contextlib.contextmanager
    def released_for_training(self) -> Iterator[KvReport]:
        """Around a train step: drops the KV caches and the engines' references to the
        trainer's buffers they were serving, so the train step may donate its params.

        Afterwards ``generate`` refuses to run until the next ``sync_params`` (or
        ``sync_adapters``, on a base the engines own). Yields the KV drop report.
        """
        self._check_open()
        self._gate.check_no_own_calls("released_for_training()")
        self._group.pod.agree("released_for_training")
        # After any sync being prepared: its commit would serve the leaves released here again.
        with self._sync_lock, self._gate.exclusive("a train step is running"):
            report = self._drop_kv()
            with self._state_lock:
                self._stale_reason = "a train step ran since the last sync_params"
                self._group.release_aliased()
        yield report

    def memory(self) -> MemoryReport:
        """Device bytes of weights and KV per engine, and of all live arrays per device."""
        self._check_open()
        return self._group.memory()

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
        return_routing: bool = False,
        session: str | None = None,
        lora: str | None = None,
        prompt_offset: int = 0,
    ) -> RolloutBatch:
        """Sample ``n`` completions for every prompt (token-id lists, or strings).

        ``temperature=0`` (or below 1e-6) is greedy decoding. Sample ``j`` of ``prompts[i]`` draws from its
        own seed, derived from ``(seed, i, j)``: the same call seed gives the same samples for
        that prompt whatever the other prompts, ``n`` or ``dp_size`` are (``seed=None``
        draws a call seed from the worker's own random stream). Calls from several threads
        run concurrently and are batched together by the engines.
        ``return_logprobs=True`` fills ``batch.logprobs`` (see :class:`RolloutBatch`).
        ``return_routing=True`` (MoE models, ``WorkerConfig(record_routing=True)``) fills
        ``batch.routed_experts``: the experts each token was routed to, for routing replay.
        ``session="key"`` (one prompt, ``n=1``): a conversation's calls. They run on one engine,
        which keeps each call's tokens pinned in its prefix cache until the session's next call
        finishes, so that call prefills only what was appended (``batch.cached_tokens`` says
        how much it found); :meth:`release_session` ends the pin.
        ``lora="name"``: the rows use the adapters loaded under that name
        (:meth:`sync_adapters`, ``WorkerConfig.max_loras``) instead of the default ones.
        ``prompt_offset=k``: ``prompts[i]`` draws as global prompt ``k + i`` does, so processes
        that each generate their share of a global batch (same ``seed``) draw what one worker
        would over the whole batch.
        """
        # Before any other local: locals() is the arguments alone, the options agenerate gets.
        options = {k: v for k, v in locals().items() if k not in ("self", "prompts")}
        start = time.perf_counter()
        batch = _run_blocking(self._generate(prompts, options, blocking=True))
        self._phases.record("generate", time.perf_counter() - start, rows=len(batch.completions))
        return batch

    def check_sampling(self, **sampling) -> SamplingParams:
        """``generate``'s sampling options checked against this worker (its vocabulary, LoRA
        adapters, routing), as generate checks them, without generating: the
        :class:`SamplingParams`, or the InvalidRequest naming what is wrong."""
        self._check_open()
        return self._requests.check_sampling(sampling)

    async def agenerate(self, prompts, **options) -> RolloutBatch:
        """:meth:`generate` for asyncio callers: awaits the engines without blocking the loop.
        Cancelling it (``asyncio.wait_for``'s timeout, a task's ``cancel()``) aborts its rows
        in the engines: they stop within a forward and free their KV cache."""
        return await self._generate(prompts, options, blocking=False)

    async def _generate(self, prompts, options: dict, *, blocking: bool) -> RolloutBatch:
        """The one body of :meth:`generate` and :meth:`agenerate`, so the two cannot drift apart.
        ``blocking``: it waits on this thread and never suspends (:func:`_run_blocking` runs it);
        otherwise it awaits on the caller's event loop."""
        self._check_open()
        request = self._requests.validate(prompts, options)
        with counting_compiles() as compiles, self._closed_is_clear():
            loop = await self._admit(blocking=blocking)
            try:
                version = self.weight_version
                future = self._group.submit(request.prompts, request.params, request.seeds)
                try:
                    outputs = future.result() if blocking else await asyncio.wrap_future(future)
                finally:
                    # A call left unanswered (Ctrl-C in a blocking wait, a cancelled agenerate)
                    # aborts its rows, not left generating for nobody; a no-op once answered.
                    future.cancel()
            finally:
                self._gate.leave(loop)
        return self._pack(request, outputs, version, compiles.value)

    async def astream(self, prompts, **options) -> AsyncIterator[StreamChunk]:
        """Stream completions as tokens arrive: one :class:`StreamChunk` per row update
        (the new tokens since that row's last chunk), and a last chunk per row carrying its
        ``finish_reason``. Takes :meth:`generate`'s arguments except ``pad_prompts_to``.
        Leaving the loop early (``break``, ``aclose()``, cancellation) aborts the rows still
        generating."""
        if "pad_prompts_to" in options:
            raise TypeError(
                "astream() got an unexpected keyword argument 'pad_prompts_to': streamed rows are not padded"
            )
        if options.get("return_routing"):
            raise InvalidRequest("return_routing", "astream() does not return routing: use generate or agenerate")
        self._check_open()
        request = self._requests.validate(prompts, options)
        loop = await self._admit(blocking=False)
        try:
            version = self.weight_version
            updates = self._group.astream(request.prompts, request.params, request.seeds)
            rows = len(request.prompts) * request.params.n
            async with contextlib.aclosing(stream.chunks(updates, rows, request.params.n, version)) as chunks:
                with self._closed_is_clear():
                    async for chunk in chunks:
                        yield chunk
        finally:
            self._gate.leave(loop)

    def run_episodes(self, prompts, make_env, **options) -> EpisodeBatch:
        """:meth:`arun_episodes` for callers without a running event loop (it runs one, on a
        thread of its own: the call returns when the episodes end, not when the environment
        steps they abandoned at their timeout do)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return run_until_returned(self.arun_episodes(prompts, make_env, **options))
        raise RuntimeError("run_episodes() was called inside a running event loop: await arun_episodes() there")

    async def arun_episodes(
        self,
        prompts,
        make_env,
        *,
        n: int = 1,
        limits: EpisodeLimits = EpisodeLimits(),
        tools=None,
        chat_template_kwargs=None,
        seed: int | None = None,
        pad_prompts_to: int | None = None,
        completion_width: int | None = None,
        threads=None,
        **sampling,
    ) -> EpisodeBatch:
        """Multi-turn episodes (``rollout.episodes``): ``n`` per prompt (a list of chat messages,
        rendered with the chat template, ``tools`` and ``chat_template_kwargs`` such as Qwen3's
        ``{"enable_thinking": False}``, where a last message of the assistant's is a prefill that
        the first turn continues; or token ids), all at once. Each turn samples with
        ``sampling`` (:meth:`generate`'s options: temperature, top_p, return_logprobs, ...) up to
        ``limits.max_new_tokens``; ``make_env(i, j)`` gives sample ``j`` of prompt ``i`` its
        environment, whose ``step(turn)`` answers each turn with a
        :class:`rollout.episodes.StepResult`. Returns the episodes and their
        :class:`RolloutBatch` (``completion_mask``: the tokens the model sampled), whose regions
        are ``pad_prompts_to`` and ``completion_width`` wide when given (fixed shapes for a
        jitted train step), else as wide as the longest. ``threads``: a thread pool of the
        caller's for the environments' synchronous steps (:func:`rollout.episodes.run_episodes`)."""
        return await episodes.run_episodes(
            self,
            prompts,
            make_env,
            n=n,
            limits=limits,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            seed=seed,
            pad_prompts_to=pad_prompts_to,
            completion_width=completion_width,
            threads=threads,
            **sampling,
        )

    def release_session(self, session: str) -> bool:
        """Unlock what ``session`` pinned in its engine's prefix cache (it stays cached, now
        evictable). False if it held nothing (never pinned, released, or flushed by a weight
        change or a KV drop); an InvalidRequest for no session name, as ``generate`` gives."""
        self._check_open()
        if not isinstance(session, str) or not session:
            raise InvalidRequest("session", f"session must be a non-empty string, got {session!r:.80}")
        return self._group.session_engine(session).engine.release_session(session)

    def session_stats(self) -> list[SessionStats]:
        """Per engine: the sessions holding pinned prefixes and the tokens they hold."""
        self._check_open()
        return [w.engine.session_stats() for w in self._group.live().values()]

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

    async def _admit(self, *, blocking: bool) -> asyncio.AbstractEventLoop | None:
        """Enter the gate as a generate call, rebuilding the KV caches first if dropped; raises
        (gate left) when the weights cannot serve. ``blocking`` as for :meth:`_generate`.
        Returns what :meth:`EngineGate.leave` takes: the event loop of a call that awaits."""
        while True:
            if self._kv_dropped:
                if blocking:
                    self._rebuild_kv()
                else:
                    await asyncio.to_thread(self._rebuild_kv)
            loop = None
            if blocking:
                try:
                    self._gate.enter()
                except GateClosed as closed:
                    raise WorkerUnavailable(
                        closed.reason,
                        f"generate() on a thread whose event loop runs generate calls, while {closed.reason}: the "
                        "change waits for those calls, which the loop cannot run while it waits; await agenerate()",
                    ) from None
            else:
                loop = await self._gate.aenter()
            if not self._kv_dropped:
                break
            self._gate.leave(loop)  # dropped again meanwhile: rebuild first (refused if held)
        try:
            self._check_weights_alive()
        except BaseException:
            self._gate.leave(loop)
            raise
        return loop

    def _next_version(self, requested: int | None) -> int:
        """The version a sync labels its weights with: ``requested``, checked, or the next."""
        if requested is None:
            return self.weight_version + 1
        is_int = isinstance(requested, numbers.Integral) and not isinstance(requested, bool)
        if not is_int or requested <= self.weight_version:
            raise SyncError(
                f"version={requested!r:.40}: must be an int above the version served ({self.weight_version}): "
                "tokens' versions only grow"
            )
        return int(requested)

    def _check_weights_alive(self) -> None:
        self._check_open()
        if self._stale_reason is not None:
            raise self._stale_error()
        freed = self._group.dead_leaves()
        if freed:
            index, dead = next(iter(freed.items()))
            raise WorkerUnavailable(
                f"the weights of engine {index} were freed",
                f"the weights of engine {index} were freed ({len(dead)} leaves, e.g. '{dead[0]}'): "
                "the trainer donated buffers the engine was using. Call worker.sync_params(params) "
                "before generate.",
            )

    def _stale_error(self) -> WorkerUnavailable:
        return WorkerUnavailable(
            self._stale_reason, f"{self._stale_reason}: call worker.sync_params(params) before generate"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerClosed()

    def _pack(
        self, request: GenerateRequest, outputs: list[GenerateOutput], version: int, compiles: int
    ) -> RolloutBatch:
        params = request.params
        completions = [list(o.output_ids[: params.max_new_tokens]) for o in outputs]
        texts = None
        if self._tokenizer is not None:
            texts = [completion_text(self._tokenizer, c) for c in completions]
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
            kept_counts=[o.kept_counts[: len(c)] for o, c in zip(outputs, completions)]
            if params.return_logprobs
            else None,
            token_versions=(
                None
                if any(o.token_versions is None for o in outputs)
                else [o.token_versions[: len(c)] for o, c in zip(outputs, completions)]
            ),
            routed_experts=[o.routed_experts for o in outputs] if params.return_routing else None,
            cached_tokens=[o.cached_tokens for o in outputs],
            prefill_tokens=[o.prefill_tokens for o in outputs],
        )

    # ---- weight checks (the server's admin routes) -------------------------------------------

    def weights_checksum(self) -> dict:
        """A checksum of the weights being served, computed on device: the same weights give
        the same value in any process and any sharding. Returns ``checksum`` (hex, of the
        first engine), ``weight_version``, ``leaves`` and, with several engines, ``per_engine``."""
        with self._gate.holding(self._sync_lock, "weights_checksum()"):  # no swap frees the leaves being read
            self._check_weights_alive()
            return weight_tools.checksum_report(self._group, self.weight_version)

    def perturb_weights(
        self, seed: int, scale: float, num_leaves: int, *, check_finite: bool = True, in_flight: bool = False
    ) -> dict:
        """Add ``scale * normal(key(seed, i))`` to the first ``num_leaves`` weight leaves (engine
        order), on every engine: a deterministic weight update for testing the update path
        (``in_flight`` as for ``sync_params``). Perturbed weights that are not finite are
        refused as by ``sync_params`` (the previous weights keep serving). Returns the perturbed
        leaf paths and the new weight version."""
        weight_tools.check_flags(check_finite=check_finite, in_flight=in_flight)
        perturbation = weight_tools.Perturbation.checked(self._group, seed, scale, num_leaves)
        if not in_flight:  # before the perturbed weights are computed
            self._gate.check_no_own_calls("perturb_weights()")
        self._check_weights_alive()
        # Held from reading the leaves to the swap, so no sync lands in between and is undone.
        with self._gate.holding(self._sync_lock, "perturb_weights()"):
            new_leaves = perturbation.new_leaves(self._group, check_finite=check_finite)
            version = self._replace_engine_leaves(new_leaves, "weights are being perturbed", in_flight=in_flight)
        return {"leaves": perturbation.paths, "weight_version": version}

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


@contextlib.contextmanager
def _naming_factors_as_given(given: Mapping[str, str]) -> Iterator[None]:
    """SyncErrors raised inside name each adapter factor by its path in the caller's tree
    (``given``: the engine's path of a factor -> the caller's), not by the name the sync gave
    it (this project's factor names, a named slot's: ``q_proj.lora_a_1``)."""
    renamed = {engine: path for engine, path in given.items() if engine != path}
    try:
        yield
    except SyncError as exc:
        if not renamed:
            raise
        # Longest first, and never inside a longer name: "x.lora_a" is not read in "x.lora_a_1".
        names = "|".join(map(re.escape, sorted(renamed, key=len, reverse=True)))
        message = re.sub(rf"(?<![\w.])(?:{names})(?![\w.])", lambda m: renamed[m.group(0)], str(exc))
        if isinstance(exc, PeerSyncError):  # another process's failure: still one, renamed
            raise PeerSyncError(message, exc.processes) from None
        raise SyncError(message, [renamed.get(path, path) for path in exc.non_finite]) from None


def _merge_overflow(error: SyncError, base: Mapping[str, object], adapters) -> SyncError:
    """``error``, or where it finds NaN/inf in merged kernels whose base kernels are finite (their
    adapters were checked before the merge), the error of the merge that overflowed: it had
    named the kernels alone, as if the trainer's were broken."""
    kernels = {adapter.kernel for adapter in adapters}
    merged = [path for path in error.non_finite if path in kernels]
    broken = set(non_finite_leaves([base[path] for path in merged]))
    overflowed = [path for i, path in enumerate(merged) if i not in broken]
    if not overflowed:
        return error
    return SyncError(
        f"{error} ({', '.join(overflowed[:8])}: finite in the base tree, as are their adapters, but not once "
        "merged: kernel + alpha / rank * A @ B overflows float32)",
        non_finite=error.non_finite,
    )


def _combine_sync_reports(reports: Mapping[int, SyncReport], engines: int, compiles: int) -> SyncReport:
    """One report of the engines' (by engine index); with several engines each one's in
    ``per_engine``, None for an engine that failed."""
    first = reports[min(reports)]
    if engines == 1:
        return dataclasses.replace(first, compiles=compiles)
    fields = (
        "leaves_aliased",
        "leaves_relabeled",
        "leaves_copied",
        "leaves_resharded",
        "bytes_aliased",
        "bytes_copied",
    )
    totals = {name: sum(getattr(r, name) for r in reports.values()) for name in fields}
    per_engine = tuple(reports.get(index) for index in range(engines))
    return dataclasses.replace(first, **totals, compiles=compiles, per_engine=per_engine)


def _run_blocking(body: Coroutine):
    """The result of a coroutine that never suspends, run to its end on this thread without an
    event loop (``generate`` may be called where a loop is running, and must not start one)."""
    try:
        body.send(None)
    except StopIteration as done:
        return done.value
    body.close()  # it awaited after all: not left half-run (holding the gate)
    raise RuntimeError("generate's blocking body suspended")


def _load_tokenizer(model_path: str):
    if not has_tokenizer_files(model_path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _eos_token_ids(tokenizer, engine_ids: frozenset[int]) -> set[int]:
    """EOS ids: the tokenizer's, and those the engine ends completions at (the model config's and
    its generation config's; the engine runs without a tokenizer)."""
    tokenizer_id = getattr(tokenizer, "eos_token_id", None)
    return set(engine_ids) | ({tokenizer_id} if isinstance(tokenizer_id, int) else set())


def _pad_token_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0
