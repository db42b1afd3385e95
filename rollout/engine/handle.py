"""EngineHandle: one sglang-jax engine running in this process: start-up, facts, calls on its
scheduler thread, failure and close. It is made of parts: its model state (weights, KV pool,
``state.py``), its request loop (generate, stream, ``requests.py``) and its test hooks
(``testing.py``)."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import signal
import threading
import time
import types
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from trainer_bridge.sync import EngineLeaf

from ..sampling import SamplingParams
from . import inflight, multistep, sessions, tpu_interpret
from .lora import TOKEN_SLOTS
from .patches import eos_id_set, install_workarounds, preserved_process_state, variables_sharded_lazily
from .programs import static_decode_chunks
from .requests import RequestLoop
from .routing import RoutingRecorder
from .runtime import SchedulerControl
from .sessions import SessionStats
from .start_up import engine_start_up
from .state import ModelState
from .testing import EngineTesting
from .types import EngineError, EngineOptions, ForwardMemory, GenerateOutput, engine_name
from .workarounds import workaround_enabled

logger = logging.getLogger(__name__)

# The interrupts deferred on this thread (interrupts_deferred): None outside such a block.
_deferred = threading.local()


@contextlib.contextmanager
def interrupts_deferred():
    """A Ctrl-C (KeyboardInterrupt) during the block raises at its end, once the block has run:
    a call queued on the scheduler thread runs whatever its caller does (a swap cannot be taken
    back), so the block records what it did (the weight version the engines now serve) before
    the interrupt goes on. A second interrupt raises at once. On the main thread under Python's
    own SIGINT handler, the block's SIGINT is recorded wherever it lands; elsewhere (a handler
    of the program's own that raises KeyboardInterrupt), one that lands while the thread waits
    for an engine call is deferred."""
    if getattr(_deferred, "interrupts", None) is not None:  # nested: the outer block raises it
        yield
        return
    _deferred.interrupts = interrupts = []
    handler = _recording_sigint(interrupts)
    try:
        yield
    finally:
        _deferred.interrupts = None
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
        if interrupts:
            raise interrupts[0]


def _recording_sigint(interrupts: list):
    """Python's SIGINT handler replaced by one that records the first interrupt in
    ``interrupts`` (the next raises at once); returns the handler to put back, or None where
    it was not replaced (not the main thread, or the program's own handler)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None

    def record(signum, frame):
        if interrupts:
            raise KeyboardInterrupt
        interrupts.append(KeyboardInterrupt())
        logger.warning("interrupted while the engines run a change that cannot be taken back: raising once it ends")

    signal.signal(signal.SIGINT, record)
    return signal.default_int_handler


class EngineHandle:
    """An sglang-jax engine running in this process, and everything done to its internals.

    Several can run in one process, each on its own devices (``EngineOptions.devices``),
    started from any thread (start-ups take turns) and driven concurrently.
    """

    def __init__(self, options: EngineOptions):
        install_workarounds()
        if options.max_loras > 1 and options.unmerged_lora is None:
            raise EngineError("max_loras > 1 holds several unmerged adapters: set unmerged_lora too")
        if options.record_routing and not workaround_enabled("moe-forward"):
            raise EngineError("record_routing needs workaround moe-forward: its expert block records the routing")
        device = options.device or jax.default_backend()
        attention_backend = engine_attention_backend(options.attention_backend, device)
        check_decode_steps(options, attention_backend)
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
            disable_radix_cache=not options.prefix_cache,
            watchdog_timeout=options.watchdog_timeout_s,
            log_level="error",
        )
        optional = {
            "context_length": options.context_length,
            "attention_backend": attention_backend,
            "device": device,
            "precompile_token_paddings": list(options.precompile_token_paddings or []) or None,
            "precompile_bs_paddings": list(options.precompile_bs_paddings or []) or None,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        from sgl_jax.srt.hf_transformers_utils import get_config

        with engine_start_up(self.name, options.devices, options.unmerged_lora, options.max_loras) as start_up:
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
        self._closed = False
        self._requests = None
        self._model = ModelState(self._scheduler, self._engine, options.seed)
        try:
            self._finish_start_up(options, device)
        except BaseException:
            self.close()  # a started engine's threads, sockets and device memory
            raise

    def _finish_start_up(self, options: EngineOptions, device: str) -> None:
        budget = self.kv_pool_tokens // 2 if options.session_budget_tokens is None else options.session_budget_tokens
        self._sessions = self.call(lambda: sessions.install(self._scheduler, budget, options.max_session_tokens))
        self._requests = RequestLoop(
            self._engine, self._scheduler, self._control, self.check_alive, self.kv_pool_tokens, self._sessions
        )
        self.testing = EngineTesting(self.call, self._control, self._model)
        if options.max_loras > 1:
            specs = self._model.leaf_specs()
            self._control.token_slots_leaf = next(spec.index for spec in specs if spec.path == TOKEN_SLOTS)
        _open_handles.add(self)
        # Registered again at each start, so it runs before the exit handlers JAX registered
        # meanwhile (they run last first): run after them, it stopped an engine mid-forward on
        # torn-down caches, which logged a failure (a KeyError) at every exit with a call running.
        atexit.unregister(_close_open_handles)
        atexit.register(_close_open_handles)
        if options.record_routing:
            if not getattr(self._model.runner.model_config.hf_config, "num_experts", 0):
                raise ValueError(f"record_routing: {options.model_path} is not a mixture-of-experts model")
            self._control.routing = RoutingRecorder()
        if options.decode_steps > 1:
            static = static_decode_chunks(options, device)
            multistep.install(self._scheduler, self._control, options.decode_steps, static)
            if options.precompile:
                self.call(lambda: multistep.precompile(self._scheduler, options.decode_steps, static))

    # ---- engine facts ----------------------------------------------------------------------

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._model.runner.mesh

    @property
    def forward_count(self) -> int:
        """Forward passes run so far (one per scheduled batch)."""
        return int(self._scheduler.forward_ct)

    @property
    def requests_in_flight(self) -> int:
        """Requests the scheduler holds now, waiting or running (a racy read: for waiting on
        work to start or end, not for decisions)."""
        scheduler = self._scheduler
        return len(scheduler.waiting_queue) + len(scheduler.running_batch.reqs)

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
        return int(self._model.runner.model_config.context_len)

    @property
    def vocab_size(self) -> int:
        return int(self._model.runner.model_config.vocab_size)

    @property
    def decode_chunk_stats(self) -> multistep.DecodeChunkStats | None:
        """What the engine's decode chunks did (``EngineOptions.decode_steps`` > 1), or None.
        A racy read while the engine runs (counters of its scheduler thread)."""
        chunks = self._control.decode_chunks
        return None if chunks is None else chunks.stats()

    @property
    def attention_backend(self) -> str:
        return str(self._engine.server_args.attention_backend)

    @property
    def hf_config(self):
        """The model's HF config as the engine holds it: its ``num_key_value_heads`` is the
        engine's, repeated for tp_size (see :attr:`num_key_value_heads`)."""
        return self._model.runner.model_config.hf_config

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids the engine ends a completion at unless ``ignore_eos``: the model config's and
        its ``generation_config.json``'s EOS ids."""
        return frozenset(eos_id_set(self._model.runner.model_config.hf_eos_token_id))

    @property
    def lora_names(self) -> Mapping[str, int]:
        """Adapter name -> its slot (``EngineOptions.max_loras``), as the worker assigns them:
        ``generate(..., lora=name)`` runs on that slot's adapters. A read-only view: changed by
        :meth:`name_adapters` and :meth:`unload_adapters`."""
        return types.MappingProxyType(self._control.lora_names)

    def name_adapters(self, name: str, slot: int) -> None:
        """Calls for ``name`` run on ``slot`` from now on."""
        with self._control.lora_lock:
            self._control.lora_names[name] = slot

    def unload_adapters(self, name: str) -> bool:
        """Calls for ``name`` are refused from now on (those running finish on its slot, which
        :meth:`lora_slots_in_use` reports until they have); False if it had no slot."""
        with self._control.lora_lock:
            return self._control.lora_names.pop(name, None) is not None

    def lora_slots_in_use(self) -> set[int]:
        """The adapter slots requests of running calls use (besides the default slot 0)."""
        with self._control.lora_lock:
            return set(self._control.lora_slots.values())

    @property
    def num_key_value_heads(self) -> int:
        """The model's own KV heads, before the engine repeats them for tp_size."""
        return int(self._model.runner.model_config._original_hf_num_key_value_heads)

    @property
    def routing_table_bytes(self) -> int:
        """Host bytes of the routing recorder's table by KV slot (0 when not recording)."""
        routing = self._control.routing
        return 0 if routing is None else routing.host_bytes

    def busy_intervals(self) -> list[tuple[float, float]]:
        """(start, end) ``time.perf_counter()`` of this engine's latest forward passes."""
        return list(self._control.busy)

    @property
    def alive(self) -> bool:
        return not self._closed and self._control.error is None and not self._control.stopped.is_set()

    def fail(self, exc: BaseException) -> None:
        """Mark the engine failed (``exc`` its error): every waiting and later call raises."""
        self._control.fail(exc)

    def check_alive(self) -> None:
        if not self.alive:
            raise self._control.dead_error()

    # ---- scheduler thread ------------------------------------------------------------------

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the scheduler thread while the engine is idle and return its result.

        An exception raised by ``fn`` is re-raised here and leaves the engine serving.
        """
        self.check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._control.calls.put((fn, future))
        self._control.wake()
        return self._wait(future)

    def call_at_boundary(
        self,
        fn: Callable[[], Any],
        when: Callable[[], bool] | None = None,
        keeps_decode_chunks: bool = False,
    ) -> Any:
        """Run ``fn`` on the scheduler thread at the next forward boundary, with requests in
        flight: after one forward's tokens are processed and before the next batch is chosen
        (a waiting caller waits at most one forward). ``when`` (evaluated there, at each
        boundary) delays it to the first boundary where it holds. Returns ``fn``'s result.
        ``keeps_decode_chunks``: ``fn`` changes neither weights nor the running requests' KV, so
        the decode steps computed ahead (``EngineOptions.decode_steps``) stay valid."""
        self.check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._control.queue_at_boundary(fn, when, future, keeps_decode_chunks)
        return self._wait(future)

    def _wait(self, future: concurrent.futures.Future) -> Any:
        # No timeout: a call cannot be taken back once the scheduler thread runs it (a swap
        # would happen after its caller gave up). A stopped engine fails what it left queued.
        while True:
            try:
                return future.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if self._control.stopped.is_set() and not future.done():
                    self._control._fail_pending()
            except KeyboardInterrupt as interrupt:
                interrupts = getattr(_deferred, "interrupts", None)
                if interrupts is None or interrupts:  # not deferred here, or a second one
                    raise
                interrupts.append(interrupt)
                logger.warning(
                    "%s: interrupted while its engine runs a change that cannot be taken back: waiting for it to "
                    "end, then raising (interrupt again to stop waiting)",
                    self.name,
                )

    # ---- generation (the request loop) ------------------------------------------------------

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
        return self._requests.submit(prompts, params, seeds).result()

    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: np.ndarray
    ) -> concurrent.futures.Future:
        """:meth:`generate` without waiting: a future of its outputs (``asyncio.wrap_future``
        makes it awaitable on any event loop)."""
        return self._requests.submit(prompts, params, seeds)

    def astream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: np.ndarray
    ) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """Yield ``(row, output so far)`` as tokens arrive; a row is done when its
        ``finish_reason`` is set. Rows are prompt-major as in :meth:`generate`."""
        return self._requests.astream(prompts, params, seeds)

    # ---- sessions ---------------------------------------------------------------------------

    def release_session(self, session: str) -> bool:
        """Unlock a session's pinned prefix (it stays cached, evictable); False if it held none.
        Runs at the next forward boundary."""
        return self.call_at_boundary(lambda: self._sessions.release(session), keeps_decode_chunks=True)

    def session_stats(self) -> SessionStats:
        return self.call_at_boundary(self._sessions.stats, keeps_decode_chunks=True)

    # ---- weights, KV pool, compiled forward (the model state) --------------------------------

    def weight_leaves(self) -> list[jax.Array]:
        """The arrays the next forward pass will read, in the engine's leaf order."""
        return self._model.weight_leaves()

    def leaf_specs(self) -> list[EngineLeaf]:
        """Weight leaves by path (``transformer.layers.0.self_attn.q_proj.weight``), in order."""
        return self._model.leaf_specs()

    @property
    def weight_version(self) -> int:
        """The version label of the weights the next forward samples with."""
        return self._control.weight_version

    def replace_weight_leaves(
        self,
        new_leaves: Sequence[jax.Array],
        *,
        flush_prefix_cache: bool = True,
        free: Iterable[int] = (),
        version: int | None = None,
        in_flight: bool = False,
        recompute_kv: bool = False,
        on_swapped: Callable[[], None] | None = None,
    ) -> inflight.SwapRecord:
        """Swap in a whole new leaf list between forwards, then (by default) forget the cached
        prefixes computed with the old weights, and delete the old arrays at the indices in
        ``free`` (those the engine owns) at once, so a swap's peak memory stays at the bytes
        it writes. Every leaf must keep its shape, dtype and sharding (the caller checks).
        Tokens sampled from then on are labelled ``version`` (``GenerateOutput.token_versions``).
        ``on_swapped`` runs on the scheduler thread as soon as the new leaves serve, before
        anything that may still fail. ``flush_prefix_cache=False`` is for tests of the engine's
        own cache.

        Drain (default): runs while the engine is idle. ``in_flight``: runs at the next forward
        boundary and the running requests go on (see :mod:`.inflight`), keeping their KV or,
        with ``recompute_kv``, prefilled again under the new weights first.

        A failure once the new leaves serve (the prefix cache's flush, the running requests'
        KV made to agree) fails the engine: its KV state no longer matches its weights.
        """
        new_leaves, free = list(new_leaves), tuple(free)
        model, control, queued = self._model, self._control, time.perf_counter()
        swapped = False

        def swap():
            nonlocal swapped
            old = model.weight_leaves()
            model.replace_weight_leaves(new_leaves)
            swapped = True
            if on_swapped is not None:  # first: what follows may fail
                on_swapped()
            if version is not None:
                control.weight_version = version
            for index in free:
                if old[index] is not new_leaves[index]:
                    old[index].delete()

        def drained() -> inflight.SwapRecord:
            start = time.perf_counter()
            swap()
            if flush_prefix_cache:
                model.flush_prefix_cache()
            return inflight.SwapRecord(control.weight_version, queued, start, time.perf_counter(), False, 0, 0)

        def in_flight_swap() -> inflight.SwapRecord:
            label = control.weight_version if version is None else version
            return inflight.swap_at_boundary(
                model.scheduler, swap, version=label, recompute=recompute_kv, queued=queued
            )

        def failing_the_engine_past_the_swap(step):
            def run():
                try:
                    return step()
                except BaseException as exc:
                    if swapped:
                        control.fail(exc)
                        raise control.dead_error() from exc
                    raise

            return run

        swap_step = failing_the_engine_past_the_swap(in_flight_swap if in_flight else drained)
        record = self.call_at_boundary(swap_step) if in_flight else self.call(swap_step)
        control.swaps.append(record)
        return record

    def release_weight_leaves(self, indices: Iterable[int]) -> None:
        """Drop the engine's references to the leaves at ``indices``, so a trainer can donate
        the buffers. The forward must not run again until :meth:`replace_weight_leaves` puts
        real leaves back (the worker enforces this)."""
        indices = tuple(indices)
        self.call(lambda: self._model.release_weight_leaves(indices))

    def copy_weight_leaves(self, indices: Iterable[int]) -> None:
        """Serve copies of the leaves at ``indices`` (same values and sharding, buffers of the
        engine's own), so a trainer can donate the arrays they were."""
        indices = tuple(indices)
        self.call(lambda: self._model.copy_weight_leaves(indices))

    def reload_weights_from_model_dir(self) -> None:
        """sglang-jax's own safetensors load into the running model.

        The engine's reload path, kept as the baseline the sync benchmark compares against.
        Needs an engine started with a safetensors load format (the loader adds rng leaves).
        """
        self.call(self._model.reload_weights_from_model_dir)

    def kv_buffers(self) -> list[jax.Array]:
        return self._model.kv_buffers()

    def drop_kv_buffers(self) -> tuple[int, int]:
        """Flush the prefix cache and delete the KV buffers.

        Returns (number of buffers, device bytes they held, summed over devices).
        """
        return self.call(self._model.drop_kv_buffers)

    def delete_failed_kv_buffers(self) -> tuple[int, int]:
        """Delete the KV buffers of an engine whose thread failed, on the caller's thread (no
        forward runs again). Returns (number of buffers, device bytes they held)."""
        if self.alive:
            raise EngineError(f"{self._control.name} is running: drop its KV cache between forwards (drop_kv_buffers)")
        return self._model.delete_kv_buffers()

    def rebuild_kv_buffers(self) -> bool:
        """Recreate the KV buffers (same shapes, dtype and sharding) where dropped; whether
        they were."""
        return self.call(self._model.rebuild_kv_buffers)

    def forward_memory(self, num_tokens: int, decode: bool = False) -> ForwardMemory:
        """XLA's memory analysis of the forward compiled for one batch, padded as the scheduler
        pads it: a prefill of ``num_tokens`` tokens (requests padded to the largest batch size,
        ``cache_loc`` to that many full contexts) or a decode step of ``num_tokens`` rows.

        Compiles (with this engine's weights, KV pool and attention) and runs nothing.
        """
        return self.call(lambda: self._model.forward_memory(num_tokens, decode))

    # ---- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine's threads and release its sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _open_handles.discard(self)
        control = self._control
        control.stop_threads()
        if self._requests is not None:
            self._requests.close()
        scheduler, tm = self._scheduler, self._engine.tokenizer_manager
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
        # Drop references to device memory (weights, KV) held by the engine objects; the decode
        # chunks reach the whole scheduler.
        control.decode_chunks = None
        self._model.close()
        self._scheduler = None
        self._engine = None


# Engines not closed yet. Held strongly: an unclosed engine collected as garbage would have its
# zmq context terminated with sockets still open, which blocks forever (a hung interpreter
# exit); instead they are closed properly at exit.
_open_handles: set[EngineHandle] = set()


def open_engines() -> list[EngineHandle]:
    """The engines of this process not closed yet."""
    return list(_open_handles)


def _close_open_handles() -> None:
    for handle in list(_open_handles):
        with contextlib.suppress(Exception):
            handle.close()


def check_decode_steps(options: EngineOptions, attention_backend: str) -> None:
    """The engines that can run several decode steps per dispatch (multistep.py)."""
    if options.decode_steps <= 1:
        return
    why = None
    # Each step's view of the KV: the cache_loc this project's paged attention reads, or the
    # TPU kernel's metadata (multistep._step_attention_backend).
    if attention_backend not in ("native", "fa"):
        why = f"the native or the fa attention backend (not {attention_backend!r})"
    elif attention_backend == "native" and not workaround_enabled("native-attention-memory"):
        why = "workaround native-attention-memory (its paged attention reads each step's KV)"
    elif not workaround_enabled("sampler"):
        why = "workaround sampler (its sampler returns the log-probs the chunk keeps)"
    elif options.record_routing:
        why = "record_routing off (routing is filed per forward)"
    elif options.max_loras > 1:
        why = "max_loras = 1 (each forward's token slots are written on the host)"
    if why is not None:
        raise EngineError(f"decode_steps={options.decode_steps} needs {why}")


def default_attention_backend(device: str) -> str:
    """The engine's attention backend when the config names none: its Pallas kernel ("fa") is
    written for TPU, and 0.0.2 only falls back to "native" by itself on CPU (on GPU it would
    try to compile the TPU kernel)."""
    return "fa" if device == "tpu" else "native"


def engine_attention_backend(requested: str | None, device: str) -> str:
    """The attention backend an engine on ``device`` runs when ``requested`` (None: the
    default). 0.0.2 builds "native" for "fa" on a CPU, where it cannot compile the kernel
    (outside :func:`tpu_interpret.tpu_interpret_mode`): asked for there, the engine is started
    with "native", so what it reports and the checks of what it can run are of the backend it
    runs."""
    backend = requested or default_attention_backend(device)
    if backend == "fa" and device == "cpu" and not tpu_interpret.keeps_fa():
        logger.warning("attention_backend 'fa' (the TPU kernel) runs 'native' on a CPU outside tpu_interpret_mode")
        return "native"
    return backend
