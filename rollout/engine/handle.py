"""EngineHandle: one sglang-jax engine running in this process."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..sampling import SamplingParams
from .patches import (
    LOGPROB_SINKS,
    install_workarounds,
    preserved_process_state,
    variables_sharded_lazily,
    workaround_enabled,
)
from . import inflight
from .runtime import SchedulerControl, engine_start_up
from .types import (
    EngineError,
    EngineOptions,
    ForwardMemory,
    GenerateOutput,
    LeafSpec,
    device_nbytes,
    engine_name,
)

logger = logging.getLogger(__name__)


class EngineHandle:
    """An sglang-jax engine running in this process, and everything done to its internals.

    Several can run in one process, each on its own devices (``EngineOptions.devices``),
    started from any thread (start-ups take turns) and driven concurrently.
    """

    def __init__(self, options: EngineOptions):
        install_workarounds()
        from sgl_jax.srt.entrypoints.engine import Engine

        self.options = options
        self.name = engine_name(options.name, options.devices or jax.devices())
        kwargs = dict(
            model_path=options.model_path,
            dtype=options.dtype,
            tp_size=options.tp_size,
            max_total_tokens=options.max_total_tokens,
            max_running_requests=options.max_running_requests,
            max_prefill_tokens=options.max_prefill_tokens,
            chunked_prefill_size=options.chunked_prefill_size,
            page_size=options.page_size,
            random_seed=options.seed,
            load_format=options.load_format,
            # Token ids in, token ids out: with a tokenizer loaded, 0.0.2's detokenizer path
            # returns output_ids that drop special tokens mid-sequence (len(output_ids) <
            # completion_tokens). The worker encodes and decodes text itself.
            skip_tokenizer_init=workaround_enabled("detokenizer-output-ids"),
            enable_single_process=True,
            # Weight swaps and KV work run between forwards on the scheduler thread; the overlap
            # scheduler would keep a batch in flight on another thread.
            disable_overlap_schedule=True,
            enable_deterministic_sampling=True,
            disable_jax_precompile=not options.precompile,
            watchdog_timeout=options.watchdog_timeout_s,
            log_level="error",
        )
        device = options.device or jax.default_backend()
        optional = {
            "context_length": options.context_length,
            "attention_backend": options.attention_backend or default_attention_backend(device),
            "device": device,
            "precompile_token_paddings": list(options.precompile_token_paddings or []) or None,
            "precompile_bs_paddings": list(options.precompile_bs_paddings or []) or None,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        from sgl_jax.srt.hf_transformers_utils import get_config

        with engine_start_up(self.name, options.devices) as start_up:
            if workaround_enabled("shared-hf-config"):
                get_config.cache_clear()
            logger.info("starting sglang-jax on %s with the %s attention backend", device, kwargs["attention_backend"])
            try:
                with preserved_process_state(), variables_sharded_lazily():
                    self._engine = Engine(**kwargs)
            except BaseException:
                # What a half-built engine started: its threads, its sockets.
                if start_up.control is not None:
                    start_up.control.stop_threads()
                start_up.close_sockets()
                raise
            self._scheduler = self._engine.scheduler_info["scheduler"]
            self._control = SchedulerControl.of(self._scheduler)
            self._control.wait_for_threads(timeout=30)
        self._tokenizer_manager = self._engine.tokenizer_manager
        # Every use of the tokenizer manager (its zmq sockets, its per-request asyncio events)
        # happens on one event loop in a thread of this handle, so callers on any thread or
        # event loop can generate at once and the scheduler batches their requests. (It would
        # also install SIGTERM/SIGQUIT handlers on first use of a loop of its own.)
        self._loop = asyncio.new_event_loop()
        self._tokenizer_manager.no_create_loop = True
        self._tokenizer_manager.event_loop = self._loop
        self._result_task = self._loop.create_task(self._tokenizer_manager.handle_loop())
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="sglang-jax::requests", daemon=True
        )
        self._loop_thread.start()
        self._closed = False
        _open_handles.add(self)
        self._kv_allocator = None
        # rid -> the log-probs of a request that asked for them (filled on the scheduler thread).
        self._logprob_sinks: dict[str, list[float]] = {}
        setattr(self._scheduler, LOGPROB_SINKS, self._logprob_sinks)
        if workaround_enabled("untied-head-dtype"):
            self.call(self._align_lm_head_dtype)

    def _align_lm_head_dtype(self) -> None:
        from flax import nnx

        runner = self._model_runner
        head = getattr(runner.model, "lm_head", None)
        if head is None or jnp.dtype(head.dtype) == jnp.dtype(runner.dtype):
            return
        weight = head.embedding.value
        head.dtype = head.param_dtype = runner.dtype
        head.embedding.value = jax.device_put(weight.astype(runner.dtype), weight.sharding)
        graph_def, state = nnx.split(runner.model)
        leaves, state_def = jax.tree_util.tree_flatten(state)
        cells = self._closure_cells()
        cells["model_def"].cell_contents = graph_def
        cells["model_state_def"].cell_contents = state_def
        cells["model_state_leaves"].cell_contents = leaves

    # ---- engine facts ----------------------------------------------------------------------

    @property
    def _model_runner(self):
        return self._scheduler.tp_worker.worker.model_runner

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._model_runner.mesh

    @property
    def forward_count(self) -> int:
        """Forward passes run so far (one per scheduled batch)."""
        return int(self._scheduler.forward_ct)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices of this engine's mesh."""
        return tuple(self.mesh.devices.flat)

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt the scheduler accepts (it aborts prompts of max_req_input_len)."""
        return int(self._scheduler.max_req_input_len) - 1

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + new tokens one request may ask for: the scheduler silently lowers
        max_new_tokens to max_req_len - len(prompt) - 1, and max_req_len is the smaller of
        the context length and the KV pool, minus one."""
        return int(self._scheduler.max_req_len) - 1

    @property
    def kv_pool_tokens(self) -> int:
        return int(self._scheduler.max_total_num_tokens)

    @property
    def context_length(self) -> int:
        return int(self._model_runner.model_config.context_len)

    @property
    def vocab_size(self) -> int:
        return int(self._model_runner.model_config.vocab_size)

    @property
    def attention_backend(self) -> str:
        return str(self._engine.server_args.attention_backend)

    @property
    def hf_config(self):
        return self._model_runner.model_config.hf_config

    def busy_intervals(self) -> list[tuple[float, float]]:
        """(start, end) ``time.perf_counter()`` of this engine's latest forward passes."""
        return list(self._control.busy)

    @property
    def alive(self) -> bool:
        return not self._closed and self._control.error is None and not self._control.stopped.is_set()

    def check_alive(self) -> None:
        if self._closed or self._control.error is not None or self._control.stopped.is_set():
            raise self._control.dead_error()

    # ---- scheduler thread ------------------------------------------------------------------

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` on the scheduler thread while the engine is idle and return its result.

        An exception raised by ``fn`` is re-raised here and leaves the engine serving.
        """
        self.check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._control.calls.put((fn, future))
        self._control.wake()
        return self._wait(future, timeout)

    def call_at_boundary(
        self, fn: Callable[[], Any], when: Callable[[], bool] | None = None, timeout: float | None = None
    ) -> Any:
        """Run ``fn`` on the scheduler thread at the next forward boundary, with requests in
        flight: after one forward's tokens are processed and before the next batch is chosen
        (a waiting caller waits at most one forward). ``when`` (evaluated there, at each
        boundary) delays it to the first boundary where it holds. Returns ``fn``'s result."""
        self.check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._control.queue_at_boundary(fn, when, future)
        return self._wait(future, timeout)

    @property
    def boundary_calls_queued(self) -> int:
        """Calls queued with :meth:`call_at_boundary` that have not started."""
        return self._control.boundary_calls_queued

    def output_lengths(self) -> dict[str, int]:
        """rid -> tokens sampled so far of every request the scheduler holds. Scheduler thread
        only (a ``call_at_boundary`` condition, for instance)."""
        return inflight.output_lengths(self._scheduler)

    def _wait(self, future: concurrent.futures.Future, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if self._control.stopped.is_set() and not future.done():
                    self._control._fail_pending()
                if deadline is not None and time.monotonic() > deadline:
                    future.cancel()
                    raise TimeoutError(f"engine call did not run within {timeout} s") from None

    # ---- weights ---------------------------------------------------------------------------

    def _closure_cells(self) -> dict[str, Any]:
        run_model = self._model_runner.jitted_run_model
        return dict(zip(run_model.__code__.co_freevars, run_model.__closure__))

    def weight_leaves(self) -> list[jax.Array]:
        """The arrays the next forward pass will read, in the engine's leaf order."""
        return list(self._closure_cells()["model_state_leaves"].cell_contents)

    def leaf_specs(self) -> list[LeafSpec]:
        """Weight leaves by path (``transformer.layers.0.self_attn.q_proj.weight``), in order."""
        from flax import nnx

        _, state = nnx.split(self._model_runner.model)
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        leaves = self.weight_leaves()
        if len(flat) != len(leaves):
            raise EngineError(
                f"model state has {len(flat)} leaves but the forward reads {len(leaves)}"
            )
        specs = []
        for (path, _), leaf in zip(flat, leaves):
            name = ".".join(_key_name(k) for k in path).removesuffix(".value")
            rng_state = name.startswith("rng.")
            specs.append(LeafSpec(name, tuple(leaf.shape), leaf.dtype, leaf.sharding, int(leaf.nbytes), rng_state))
        return specs

    def replace_weight_leaves(self, new_leaves: Sequence[jax.Array]) -> None:
        """Swap in a whole new leaf list. Must run on the scheduler thread (use :meth:`call`).

        The forward reads its leaves from a closure cell on every call, so replacing the cell's
        list takes effect at the next forward with no recompilation, provided every leaf keeps
        its shape, dtype and sharding (the caller checks). The nnx module is updated too so
        that it agrees with what the forward reads.
        """
        from flax import nnx

        cells = self._closure_cells()
        state_def = cells["model_state_def"].cell_contents
        new_leaves = list(new_leaves)
        state = jax.tree_util.tree_unflatten(state_def, new_leaves)
        cells["model_state_leaves"].cell_contents = new_leaves
        nnx.update(self._model_runner.model, state)

    def release_weight_leaves(self, indices) -> None:
        """Drop the engine's references to the leaves at ``indices``. Scheduler thread only.

        They are replaced by a scalar placeholder in both the forward's leaf list and the nnx
        module, so a trainer can donate the buffers. The forward must not run again until
        :meth:`replace_weight_leaves` puts real leaves back (the worker enforces this).
        """
        from flax import nnx

        cells = self._closure_cells()
        leaves = list(cells["model_state_leaves"].cell_contents)
        for index in indices:
            leaves[index] = _RELEASED
        cells["model_state_leaves"].cell_contents = leaves
        nnx.update(self._model_runner.model, jax.tree_util.tree_unflatten(cells["model_state_def"].cell_contents, leaves))

    @property
    def weight_version(self) -> int:
        """The weight version the next forward samples with (set by :meth:`swap_weights`)."""
        return self._control.weight_version

    def swap_weights(
        self, swap: Callable[[], None], version: int, *, in_flight: bool = False, recompute_kv: bool = False
    ) -> inflight.SwapRecord:
        """Run ``swap`` (it replaces the weight leaves) on the scheduler thread, flush the prefix
        cache and label the tokens sampled from then on with ``version``.

        Drain (default): runs while the engine is idle. ``in_flight``: runs at the next forward
        boundary and the running requests go on (see :mod:`.inflight`), keeping their KV or,
        with ``recompute_kv``, prefilled again under the new weights first.
        """
        control = self._control

        def drained() -> inflight.SwapRecord:
            start = time.perf_counter()
            swap()
            self.flush_prefix_cache()
            control.weight_version = version
            return inflight.SwapRecord(version, start, time.perf_counter(), False, 0, 0)

        def in_flight_swap() -> inflight.SwapRecord:
            def swap_and_label():
                swap()
                control.weight_version = version

            return inflight.swap_at_boundary(self._scheduler, swap_and_label, version=version, recompute=recompute_kv)

        record = self.call_at_boundary(in_flight_swap) if in_flight else self.call(drained)
        control.swaps.append(record)
        return record

    def swap_records(self) -> list[inflight.SwapRecord]:
        """This engine's latest weight swaps (see :meth:`busy_intervals` for its forwards)."""
        return list(self._control.swaps)

    def reload_weights_from_model_dir(self) -> None:
        """sglang-jax's own safetensors load into the running model. Scheduler thread only.

        The engine's reload path, kept as the baseline the sync benchmark compares against.
        Needs an engine started with a safetensors load format (the loader adds rng leaves).
        """
        from flax import nnx

        runner = self._model_runner
        with variables_sharded_lazily():
            runner.model.load_weights(runner.model_config, jax.random.key(self.options.seed))
        _, state = nnx.split(runner.model)
        leaves, _ = jax.tree_util.tree_flatten(state)
        self._closure_cells()["model_state_leaves"].cell_contents = leaves

    # ---- KV cache and prefix cache ---------------------------------------------------------

    def flush_prefix_cache(self) -> None:
        """Forget every cached prefix so no KV computed with old weights is reused.

        Must run on the scheduler thread while idle (use :meth:`call`).
        """
        if not workaround_enabled("flush-cache"):
            self._engine.flush_cache()
            return
        inflight.reset_kv_state(self._scheduler)

    @property
    def _kv_pool(self):
        return self._model_runner.token_to_kv_pool

    def kv_buffers(self) -> list[jax.Array]:
        return list(self._kv_pool.kv_buffer)

    def kv_buffer_spec(self) -> tuple[tuple[int, ...], np.dtype, int]:
        """(shape of one layer's buffer, dtype, number of layers) of the KV pool."""
        pool = self._kv_pool
        shape = (pool.size + pool.page_size, pool.head_num * 2, pool.head_dim)
        return shape, np.dtype(pool.dtype), int(pool.layer_num)

    def drop_kv_buffers(self) -> tuple[int, int]:
        """Flush the prefix cache and delete the KV buffers. Scheduler thread only.

        Returns (number of buffers, device bytes they held, summed over devices).
        """
        self.flush_prefix_cache()
        pool = self._kv_pool
        buffers = list(pool.kv_buffer)
        pool.kv_buffer = []
        device_bytes = sum(device_nbytes(buf) for buf in buffers)
        for buf in buffers:
            buf.delete()
        return len(buffers), device_bytes

    def rebuild_kv_buffers(self) -> None:
        """Recreate the KV buffers: same shapes, dtype and sharding. Scheduler thread only.

        The pool's own ``_create_buffers`` jits a fresh lambda per layer, compiling on every
        rebuild; one allocator compiled once per handle is reused instead.
        """
        pool = self._kv_pool
        if self._kv_allocator is None:
            shape, dtype, _ = self.kv_buffer_spec()
            self._kv_allocator = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=pool.kv_sharding)
        pool.kv_buffer = [self._kv_allocator() for _ in range(pool.layer_num)]

    # ---- compiled forward ------------------------------------------------------------------

    def forward_memory(self, num_tokens: int, decode: bool = False) -> ForwardMemory:
        """XLA's memory analysis of the forward compiled for one batch, padded as the scheduler
        pads it: a prefill of ``num_tokens`` tokens (requests padded to the largest batch size,
        ``cache_loc`` to that many full contexts) or a decode step of ``num_tokens`` rows.

        Compiles (with this engine's weights, KV pool and attention) and runs nothing.
        """

        def analyse() -> ForwardMemory:
            from sgl_jax.srt.layers.logits_processor import LogitsMetadata
            from sgl_jax.srt.model_executor.forward_batch_info import (
                ForwardBatch,
                ForwardMode,
            )

            worker, runner = self._scheduler.tp_worker, self._model_runner
            if decode:
                rows, mode = num_tokens, ForwardMode.DECODE
                page = worker.page_size
                slots = -(-num_tokens * worker.max_req_len // page) * page
            else:
                rows, mode = worker.get_max_padded_size()[0], ForwardMode.EXTEND
                slots = worker.precompile_cache_loc_paddings[-1]
            batch = worker.generate_model_worker_batch(rows, num_tokens, mode, slots)
            cells = self._closure_cells()
            with jax.set_mesh(runner.mesh):
                compiled = cells["jitted_run_model"].cell_contents.lower(
                    cells["model_def"].cell_contents,
                    cells["model_state_def"].cell_contents,
                    cells["model_state_leaves"].cell_contents,
                    ForwardBatch.init_new(batch, runner),
                    runner.token_to_kv_pool,
                    LogitsMetadata.from_model_worker_batch(batch, runner.mesh),
                ).compile()
            analysis = compiled.memory_analysis()
            return ForwardMemory(
                temp_bytes=int(analysis.temp_size_in_bytes),
                argument_bytes=int(analysis.argument_size_in_bytes),
                output_bytes=int(analysis.output_size_in_bytes),
            )

        return self.call(analyse)

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: np.ndarray
    ) -> list[GenerateOutput]:
        """Sample ``params.n`` completions of every token-id prompt, prompt-major.

        ``seeds[i, j]`` is the sampling seed of sample ``j`` of prompt ``i``. Safe to call from
        several threads at once: the engine batches the requests together. With
        ``params.return_logprobs`` every output carries the log-prob of each of its tokens
        under the distribution it was drawn from (``models/logprobs.py``), collected on the
        scheduler thread (the engine's own return_logprob path crashes in 0.0.2).
        """
        return self.submit(prompts, params, seeds).result()

    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: np.ndarray
    ) -> concurrent.futures.Future:
        """:meth:`generate` without waiting: a future of its outputs (``asyncio.wrap_future``
        makes it awaitable on any event loop)."""
        return self._submit(self._generate(prompts, params, seeds))

    async def astream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: np.ndarray
    ) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """Yield ``(row, output so far)`` as tokens arrive; a row is done when its
        ``finish_reason`` is set. Rows are prompt-major as in :meth:`generate`."""
        caller = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        request, rids = self._request(prompts, params, seeds, stream=True)

        async def pump():
            with self._logprobs_collected(rids, params.return_logprobs) as sinks, self._versions_collected(rids) as versions:
                async for result in self._tokenizer_manager.generate_request(request, None):
                    row = int(result.get("index", 0))
                    output = _to_output(result, finished_only=False)
                    count = len(output.output_ids)
                    output = dataclasses.replace(output, token_versions=versions[row][:count])
                    if sinks is not None:
                        output = dataclasses.replace(output, logprobs=sinks[row][:count])
                    caller.call_soon_threadsafe(updates.put_nowait, (row, output))

        future = self._submit(pump())
        future.add_done_callback(lambda _: caller.call_soon_threadsafe(updates.put_nowait, None))
        try:
            while (update := await updates.get()) is not None:
                yield update
            future.result()
        finally:
            future.cancel()

    def _request(self, prompts, params: SamplingParams, seeds, *, stream: bool = False):
        """The engine request for a call, and its request ids (prompt-major rows)."""
        from sgl_jax.srt.managers.io_struct import GenerateReqInput

        seeds = np.asarray(seeds).reshape(len(prompts), params.n)
        if workaround_enabled("one-request-per-sample"):
            # 0.0.2 ignores n for a single prompt and is slow with batched n: one request per sample.
            input_ids = [list(map(int, ids)) for ids in prompts for _ in range(params.n)]
            sampling = [_sampling_dict(params, int(seed)) for seed in seeds.reshape(-1)]
        else:  # the engine's own n (one seed per prompt)
            input_ids = [list(map(int, ids)) for ids in prompts]
            sampling = [dict(_sampling_dict(params, int(row[0])), n=params.n) for row in seeds]
        rids = [uuid.uuid4().hex for _ in input_ids]
        return GenerateReqInput(input_ids=input_ids, sampling_params=sampling, rid=rids, stream=stream), rids

    @contextlib.contextmanager
    def _logprobs_collected(self, rids: list[str], wanted: bool):
        """Per row, the list the patched sampler appends each sampled token's log-prob to
        (None when not wanted)."""
        if not wanted:
            yield None
            return
        sinks = [[] for _ in rids]
        self._logprob_sinks.update(zip(rids, sinks))
        try:
            yield sinks
        finally:
            for rid in rids:
                self._logprob_sinks.pop(rid, None)

    @contextlib.contextmanager
    def _versions_collected(self, rids: list[str]):
        """Per row, the list the scheduler appends each sampled token's weight version to."""
        sinks = [[] for _ in rids]
        versions = self._control.version_sinks
        versions.update(zip(rids, sinks))
        try:
            yield sinks
        finally:
            for rid in rids:
                versions.pop(rid, None)

    async def _generate(self, prompts, params: SamplingParams, seeds) -> list[GenerateOutput]:
        request, rids = self._request(prompts, params, seeds)
        with self._logprobs_collected(rids, params.return_logprobs) as sinks, self._versions_collected(rids) as versions:
            results = await self._tokenizer_manager.generate_request(request, None).__anext__()
        if isinstance(results, dict):
            results = [results]
        outputs = [_to_output(r) for r in results]
        if len(outputs) != len(rids):  # the engine's own n: its rows are not our request ids
            versions = [None] * len(outputs)
        for i, (out, tokens) in enumerate(zip(outputs, versions)):
            if tokens is None:
                continue
            if len(tokens) != out.completion_tokens:
                raise EngineError(
                    f"request {i}: recorded {len(tokens)} weight versions for {out.completion_tokens} completion tokens"
                )
        outputs = [dataclasses.replace(out, token_versions=tokens) for out, tokens in zip(outputs, versions)]
        if sinks is None:
            return outputs
        for i, (out, logprobs) in enumerate(zip(outputs, sinks)):
            if len(logprobs) != out.completion_tokens:
                raise EngineError(
                    f"request {i}: collected {len(logprobs)} log-probs for {out.completion_tokens} completion tokens"
                )
        return [dataclasses.replace(out, logprobs=lp) for out, lp in zip(outputs, sinks)]

    def _submit(self, coroutine) -> concurrent.futures.Future:
        """Run ``coroutine`` on this handle's request loop; it fails with EngineError as soon as
        the engine does."""
        try:
            self.check_alive()
        except EngineError:
            coroutine.close()
            raise
        return asyncio.run_coroutine_threadsafe(self._guarded(coroutine), self._loop)

    async def _guarded(self, coroutine):
        task = asyncio.ensure_future(coroutine)
        try:
            while True:
                done, _ = await asyncio.wait({task, self._result_task}, timeout=0.05)
                if task in done:
                    return task.result()
                if self._result_task in done:
                    exc = self._result_task.exception()
                    self._control.fail(exc or EngineError("engine result loop ended"))
                if self._control.error is not None or self._control.stopped.is_set():
                    raise self._control.dead_error()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    # ---- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine's threads and release its sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _open_handles.discard(self)
        control = self._control
        control.stop_threads()

        async def stop_results():
            self._result_task.cancel()
            with contextlib.suppress(BaseException):
                await self._result_task

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop_results(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)
        if not self._loop_thread.is_alive():
            self._loop.close()
        scheduler, tm = self._scheduler, self._tokenizer_manager
        sockets = [
            getattr(scheduler, "recv_from_tokenizer", None),
            getattr(scheduler, "send_to_tokenizer", None),
            getattr(scheduler, "send_to_detokenizer", None),
            getattr(scheduler, "recv_from_rpc", None),
            getattr(tm, "recv_from_detokenizer", None),
            getattr(tm, "send_to_scheduler", None),
            self._engine.send_to_rpc,
        ]
        for sock in sockets:
            if sock is not None and hasattr(sock, "close"):
                with contextlib.suppress(Exception):
                    sock.close(linger=0)
        control.wake_reader.close()
        control.wake_writer.close()
        # Drop references to device memory (weights, KV) held by the engine objects.
        self._scheduler = None
        self._tokenizer_manager = None
        self._engine = None



# Engines not closed yet. Held strongly: an unclosed engine collected as garbage would have its
# zmq context terminated with sockets still open, which blocks forever (a hung interpreter
# exit); instead they are closed properly at exit.
_open_handles: set[EngineHandle] = set()


@atexit.register
def _close_open_handles() -> None:
    for handle in list(_open_handles):
        with contextlib.suppress(Exception):
            handle.close()


def default_attention_backend(device: str) -> str:
    """The engine's attention backend when the config names none: its Pallas kernel ("fa") is
    written for TPU, and 0.0.2 only falls back to "native" by itself on CPU (on GPU it would
    try to compile the TPU kernel)."""
    return "fa" if device == "tpu" else "native"


# Stands in for a released weight leaf (see EngineHandle.release_weight_leaves).
_RELEASED = np.zeros((), np.float32)


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _sampling_dict(params: SamplingParams, seed: int) -> dict:
    """sglang-jax's per-request sampling dict."""
    sampling = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "ignore_eos": params.ignore_eos,
        "sampling_seed": seed,
        # Keep the stop token in the output: a trainer must learn to emit it.
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    return sampling


def _to_output(result: dict, finished_only: bool = True) -> GenerateOutput:
    meta = result.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    output_ids = list(result.get("output_ids", []))
    completion_tokens = int(meta.get("completion_tokens", len(output_ids)))
    if len(output_ids) != completion_tokens and (finished_only or finish):
        logger.warning(
            "engine returned %d output ids but counted %d completion tokens", len(output_ids), completion_tokens
        )
    return GenerateOutput(
        output_ids=output_ids[:completion_tokens],
        finish_reason=str(finish.get("type", "")) if finish else ("unknown" if finished_only else ""),
        completion_tokens=completion_tokens,
        cache_miss_count=int(meta.get("cache_miss_count", 0)),
    )
