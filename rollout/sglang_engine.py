"""The one module that touches sglang-jax internals.

Everything version-specific about the engine lives here: how it is started in-process, where its
weights and KV cache live, how work is run on its scheduler thread, and the workarounds for the
bugs of ``sglang-jax==0.0.2`` (each listed in ``WORKAROUNDS`` with the bug it fixes and pinned
by a test in ``tests/test_engine_workarounds.py``). Nothing else in this project imports
``sgl_jax``.

Threads: the engine runs its scheduler (which owns the model, the weights and the KV cache) in
a daemon thread of the caller's process. Any work that touches weights or KV is queued with
:meth:`EngineHandle.call` and runs on that thread at the top of a loop iteration while no
request is waiting, running or half-prefilled, so it never races a forward pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import random
import signal
import socket
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

SUPPORTED_ENGINE_VERSION = "0.0.2"

# Seeds travel to the engine as int32 (``SamplingBatchInfo.sampling_seeds``).
MAX_SAMPLING_SEED = 2**31 - 1

# Seconds without progress on a running forward after which the watchdog fails the engine.
DEFAULT_WATCHDOG_TIMEOUT_S = 1800.0

WORKAROUNDS: dict[str, str] = {
    "duplicate-pytree-registration": (
        "layers/attention/native_backend.py registers NativeAttention as a pytree although nnx "
        "already registers every Module subclass: importing it raises 'Duplicate custom "
        "PyTreeDef type registration'. It is imported here with the duplicate registration "
        "skipped."
    ),
    "min-p-operands": (
        "Off TPU, layers/sampler.py passes 3 operands to _apply_min_p_filter, which unpacks 2; "
        "lax.cond traces it even for greedy decoding, so every sampled request crashes. "
        "Replaced by a filter that takes either form."
    ),
    "sampler-rng": (
        "The sampler's RNG state is frozen inside a functools.partial, so every call and every "
        "step reuses one key: temperature sampling repeats itself. The engine's own seeded "
        "path (enable_deterministic_sampling) uses a weak integer hash and, off TPU, takes a "
        "softmax of probabilities, which flattens the distribution. Deterministic sampling is "
        "always on, every request gets its own seed, and each token is drawn with "
        "jax.random.categorical under a key folded from (seed, position): fresh samples per "
        "call, the same samples for the same seed, independent of how requests are batched."
    ),
    "process-kill-on-error": (
        "An exception in the scheduler or detokenizer thread, a failed scheduler start, or the "
        "watchdog sends SIGQUIT, whose handler kills the whole process tree (and the watchdog "
        "signals the parent process). Engine.shutdown kills every child process of the caller. "
        "Here the threads run under guards that record the error and fail the waiting caller "
        "with EngineError; no signal handler is installed and shutdown is done by hand."
    ),
    "idle-busy-spin": (
        "The idle scheduler loop polls its sockets without blocking: one core at 100%. The "
        "loop now blocks in a zmq poll while idle, woken by requests or queued calls."
    ),
    "process-global-side-effects": (
        "Engine start-up forces the root logger to its level (basicConfig(force=True)), reseeds "
        "numpy and random, installs uvloop's event-loop policy, SIGCHLD/SIGQUIT/SIGTERM "
        "handlers and an atexit hook, disables the multiprocessing resource tracker, and "
        "disables threading's atexit registration. Each is prevented or undone."
    ),
    "untied-head-dtype": (
        "Untied models (tie_word_embeddings false) create lm_head with the default param dtype "
        "bfloat16 and compute logits in it whatever the model dtype. The head's dtype and "
        "weight are set to the model dtype before the first forward is compiled."
    ),
    "detokenizer-output-ids": (
        "With a tokenizer loaded, the detokenizer path returns output_ids that silently drop "
        "special tokens (EOS mid-sequence under ignore_eos, a matched stop token), so "
        "len(output_ids) < completion_tokens. The engine always runs with skip_tokenizer_init "
        "and exact token ids; the worker encodes prompts and decodes completions itself."
    ),
    "shared-hf-config": (
        "hf_transformers_utils.get_config caches the HF config object per model path, and "
        "ModelConfig.configure_for_tensor_parallel mutates it (KV heads replicated for tp): a "
        "second engine on the same model dir in one process starts from the mutated config "
        "and crashes in its first forward ('Incompatible shapes for broadcasting'). The cache "
        "is cleared before every engine start."
    ),
    "flush-cache": (
        "Engine.flush_cache and release/resume_memory_occupation raise TypeError and the "
        "scheduler has no handler for them. Cache flush and KV drop/rebuild are done directly "
        "on the scheduler thread."
    ),
}


class EngineError(RuntimeError):
    """The engine failed: its scheduler thread raised, or it was used after it stopped."""


class UnsupportedEngineVersion(RuntimeError):
    """The installed sglang-jax is not a version this module knows the internals of."""


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """One weight leaf of the engine: its path in the model state and its placement."""

    path: str
    shape: tuple[int, ...]
    dtype: Any  # a numpy dtype, or a JAX PRNG key dtype for the engine's rng leaves
    sharding: jax.sharding.Sharding
    nbytes: int


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What the engine is started with (a subset of sglang-jax's ServerArgs)."""

    model_path: str
    dtype: str = "bfloat16"
    tp_size: int = 1
    max_total_tokens: int = 4096
    context_length: int | None = None
    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    chunked_prefill_size: int = 2048
    page_size: int = 1
    seed: int = 0
    load_format: str = "auto"
    precompile: bool = False
    precompile_token_paddings: tuple[int, ...] | None = None
    precompile_bs_paddings: tuple[int, ...] | None = None
    attention_backend: str | None = None
    device: str | None = None
    watchdog_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """One finished request as the engine returned it."""

    output_ids: list[int]
    finish_reason: str
    completion_tokens: int
    cache_miss_count: int


# --------------------------------------------------------------------------------------------
# Workarounds that must be in place before the engine is imported or started.
# --------------------------------------------------------------------------------------------

_install_lock = threading.Lock()
_installed = False


def engine_version() -> str:
    from sgl_jax.version import __version__

    return __version__


def install_workarounds() -> None:
    """Import sglang-jax with the 0.0.2 workarounds applied. Idempotent, process-wide."""
    global _installed
    with _install_lock:
        if _installed:
            return
        version = engine_version()
        if version != SUPPORTED_ENGINE_VERSION:
            raise UnsupportedEngineVersion(
                f"sglang-jax {version} is installed; this release of sglang-jax-rollout knows the "
                f"internals of sglang-jax=={SUPPORTED_ENGINE_VERSION} only"
            )
        _import_native_backend_without_duplicate_registration()
        with _preserved_process_state():
            # Importing the entrypoint installs uvloop's policy and rebinds
            # threading._register_atexit; the guard puts both back.
            import sgl_jax.srt.entrypoints.engine as engine_module
        _patch_sampler()
        _patch_start_up(engine_module)
        _installed = True


def _import_native_backend_without_duplicate_registration() -> None:
    from flax import nnx

    original = jax.tree_util.register_pytree_node_class

    def register_unless_nnx_module(cls):
        # nnx registers every Module subclass itself; a second registration raises.
        if isinstance(cls, type) and issubclass(cls, nnx.Module):
            return cls
        return original(cls)

    jax.tree_util.register_pytree_node_class = register_unless_nnx_module
    try:
        import sgl_jax.srt.layers.attention.native_backend  # noqa: F401
    finally:
        jax.tree_util.register_pytree_node_class = original


def _apply_min_p_filter(operands):
    # The engine passes (probs, min_ps) on TPU and (probs, min_ps, unused) elsewhere.
    probs, min_ps = operands[0], operands[1]
    thresholds = jnp.max(probs, axis=1) * min_ps
    return jnp.where(probs < thresholds.reshape(-1, 1), 0.0, probs)


def _keyed_categorical(operands):
    """Draw one token per row with a key folded from (row seed, row position).

    The engine hands this branch logits on TPU and (sorted, filtered) probabilities elsewhere;
    ``sampler.multinomial`` makes the same distinction.
    """
    from sgl_jax.srt.layers import sampler
    from sgl_jax.srt.utils.jax_utils import is_tpu_runtime

    scores, seeds, positions, _ = operands
    if seeds is None:
        return sampler.multinomial(operands)
    logits = scores if is_tpu_runtime() else jnp.log(scores)
    base = jax.random.key(0)

    def draw(seed, position, row_logits):
        key = jax.random.fold_in(jax.random.fold_in(base, seed), position)
        return jax.random.categorical(key, row_logits)

    rows = jax.vmap(draw)(seeds.astype(jnp.uint32), positions.astype(jnp.uint32), logits)
    return rows.reshape(-1, 1)


def _patch_sampler() -> None:
    from sgl_jax.srt.layers import sampler

    sampler._apply_min_p_filter = _apply_min_p_filter
    sampler.multinomial_with_seed = _keyed_categorical


def _patch_start_up(engine_module) -> None:
    from sgl_jax.srt.managers import detokenizer_manager, scheduler

    def leave_logging_alone(*args, **kwargs):
        return None

    for module in (engine_module, scheduler, detokenizer_manager):
        module.configure_logger = leave_logging_alone
    # No SIGCHLD/SIGQUIT handlers, no ulimit change, resource tracker left alone.
    engine_module._set_envs_and_config = lambda server_args: None
    # Engine.__init__ registers its process-tree-killing shutdown at exit, even when start-up
    # then fails; EngineHandle.close does the shutdown instead.
    engine_module.atexit = types.SimpleNamespace(register=lambda *args, **kwargs: None)
    engine_module.run_scheduler_loop_thread_after_create = _start_scheduler_thread
    engine_module.run_detokenizer_thread = _run_detokenizer_thread
    scheduler.Scheduler.watchdog_thread = _watchdog_thread


@contextlib.contextmanager
def _preserved_process_state():
    """Put back the process-global state that engine import and start-up change."""
    root = logging.getLogger()
    root_level, root_handlers = root.level, list(root.handlers)
    numpy_state = np.random.get_state()
    random_state = random.getstate()
    policy = asyncio.get_event_loop_policy()
    register_atexit = threading._register_atexit
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGCHLD, signal.SIGQUIT, signal.SIGTERM):
            handlers[sig] = signal.getsignal(sig)
    try:
        yield
    finally:
        root.setLevel(root_level)
        root.handlers[:] = root_handlers
        np.random.set_state(numpy_state)
        random.setstate(random_state)
        asyncio.set_event_loop_policy(policy)
        threading._register_atexit = register_atexit
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


# --------------------------------------------------------------------------------------------
# Scheduler thread: guarded loop, idle wait, queued calls, watchdog.
# --------------------------------------------------------------------------------------------


class _StopScheduler(BaseException):
    """Raised inside the scheduler loop to end it cleanly (the loop catches Exception only)."""


class _SchedulerControl:
    """State shared between the caller's threads and one engine's scheduler thread."""

    _registry_lock = threading.Lock()

    def __init__(self):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.error_traceback = ""
        self.stop_requested = False
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        # A socket pair lets other threads wake the scheduler out of its idle poll.
        self.wake_reader, self.wake_writer = socket.socketpair()
        self.wake_reader.setblocking(False)

    @classmethod
    def of(cls, scheduler) -> _SchedulerControl:
        with cls._registry_lock:
            control = scheduler.__dict__.get("_rollout_control")
            if control is None:
                control = scheduler._rollout_control = cls()
            return control

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self.wake_writer.send(b"x")

    def drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self.wake_reader.recv(4096):
                pass

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.error_traceback = "".join(traceback.format_exception(exc))
            logger.error("sglang-jax engine failed:\n%s", self.error_traceback)
        self._fail_pending()

    def _fail_pending(self) -> None:
        while True:
            try:
                _, future = self.calls.get_nowait()
            except queue.Empty:
                return
            future.set_exception(self.dead_error())

    def dead_error(self) -> EngineError:
        if self.error is not None:
            return EngineError(
                f"the sglang-jax engine thread failed: {self.error!r}\n{self.error_traceback}"
            )
        return EngineError("the sglang-jax engine has been shut down")

    def run_pending(self) -> None:
        while True:
            try:
                fn, future = self.calls.get_nowait()
            except queue.Empty:
                break
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except _StopScheduler:
                future.set_result(None)
                raise
            except BaseException as exc:  # the caller gets it; the engine keeps serving
                future.set_exception(exc)
        if self.stop_requested:
            raise _StopScheduler()


def _scheduler_is_idle(scheduler) -> bool:
    return (
        not scheduler.waiting_queue
        and scheduler.running_batch.is_empty()
        and scheduler.chunked_req is None
        and scheduler.cur_batch is None
    )


def _idle_aware_recv(scheduler, original_recv, control: _SchedulerControl, poller):
    """Replacement for Scheduler.recv_requests: runs queued calls and sleeps while idle."""

    def recv_requests():
        while True:
            requests = original_recv()
            if not _scheduler_is_idle(scheduler):
                return requests
            control.run_pending()
            if requests:
                return requests
            poller.poll(1000)
            control.drain_wakeups()

    return recv_requests


def _run_scheduler_loop(scheduler, control: _SchedulerControl) -> None:
    import zmq

    threading.current_thread().name = "sglang-jax::scheduler"
    poller = zmq.Poller()
    poller.register(scheduler.recv_from_tokenizer, zmq.POLLIN)
    poller.register(scheduler.recv_from_rpc, zmq.POLLIN)
    poller.register(control.wake_reader.fileno(), zmq.POLLIN)
    scheduler.recv_requests = _idle_aware_recv(
        scheduler, scheduler.recv_requests, control, poller
    )
    try:
        scheduler.event_loop_normal()
    except _StopScheduler:
        pass
    except BaseException as exc:
        control.fail(exc)
    finally:
        control.stopped.set()
        control._fail_pending()


def _start_scheduler_thread(server_args, port_args) -> dict:
    """Replacement for run_scheduler_loop_thread_after_create: errors reach the caller."""
    from sgl_jax.srt.managers.scheduler import Scheduler

    scheduler = Scheduler(server_args, port_args)
    control = _SchedulerControl.of(scheduler)
    control.thread = threading.Thread(
        target=_run_scheduler_loop, args=(scheduler, control), daemon=True
    )
    control.thread.start()
    return {
        "status": "ready",
        "max_total_num_tokens": scheduler.max_total_num_tokens,
        "max_req_input_len": scheduler.max_req_input_len,
        "scheduler": scheduler,
    }


def _watchdog_thread(scheduler) -> None:
    """Replacement for Scheduler.watchdog_thread: fails the engine instead of killing a process."""
    control = _SchedulerControl.of(scheduler)
    last_count, last_progress = scheduler.forward_ct, time.perf_counter()
    period = max(1.0, min(60.0, scheduler.watchdog_timeout / 4))
    while not control.stopped.wait(period):
        now = time.perf_counter()
        if scheduler.cur_batch is None or scheduler.forward_ct != last_count:
            last_count, last_progress = scheduler.forward_ct, now
        elif now - last_progress > scheduler.watchdog_timeout:
            control.fail(
                EngineError(f"no forward progress for {scheduler.watchdog_timeout:.0f} s (watchdog)")
            )
            return


# Per engine (keyed by its detokenizer socket name): the stop event and the thread.
_detokenizers: dict[str, tuple[threading.Event, threading.Thread]] = {}


def _run_detokenizer_thread(server_args, port_args) -> None:
    """Replacement for run_detokenizer_thread: stoppable, and errors do not kill the process."""
    import zmq
    from sgl_jax.srt.managers.detokenizer_manager import DetokenizerManager

    threading.current_thread().name = "sglang-jax::detokenizer"
    stop = threading.Event()
    _detokenizers[port_args.detokenizer_ipc_name] = (stop, threading.current_thread())
    manager = DetokenizerManager(server_args, port_args)
    try:
        while not stop.is_set():
            if not manager.recv_from_scheduler.poll(100, zmq.POLLIN):
                continue
            output = manager._request_dispatcher(manager.recv_from_scheduler.recv_pyobj())
            manager.send_to_tokenizer.send_pyobj(output)
    except Exception:
        logger.exception("sglang-jax detokenizer thread failed")
    finally:
        for sock in (manager.recv_from_scheduler, manager.send_to_tokenizer):
            sock.close(linger=0)


# --------------------------------------------------------------------------------------------
# The handle.
# --------------------------------------------------------------------------------------------


class EngineHandle:
    """An sglang-jax engine running in this process, and everything done to its internals."""

    def __init__(self, options: EngineOptions):
        install_workarounds()
        from sgl_jax.srt.entrypoints.engine import Engine

        self.options = options
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
            skip_tokenizer_init=True,
            enable_single_process=True,
            # Weight swaps and KV work run between forwards on the scheduler thread; the overlap
            # scheduler would keep a batch in flight on another thread.
            disable_overlap_schedule=True,
            enable_deterministic_sampling=True,
            disable_jax_precompile=not options.precompile,
            watchdog_timeout=options.watchdog_timeout_s,
            log_level="error",
        )
        optional = {
            "context_length": options.context_length,
            "attention_backend": options.attention_backend,
            "device": options.device or jax.default_backend(),
            "precompile_token_paddings": list(options.precompile_token_paddings or []) or None,
            "precompile_bs_paddings": list(options.precompile_bs_paddings or []) or None,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        from sgl_jax.srt.hf_transformers_utils import get_config

        get_config.cache_clear()
        with _preserved_process_state():
            self._engine = Engine(**kwargs)

        self._scheduler = self._engine.scheduler_info["scheduler"]
        self._control = _SchedulerControl.of(self._scheduler)
        self._tokenizer_manager = self._engine.tokenizer_manager
        self._loop = asyncio.new_event_loop()
        # The tokenizer manager would install SIGTERM/SIGQUIT handlers on first use; its result
        # loop is started here instead, on a loop private to this handle.
        self._tokenizer_manager.no_create_loop = True
        self._tokenizer_manager.event_loop = self._loop
        self._result_task = self._loop.create_task(self._tokenizer_manager.handle_loop())
        self._closed = False
        self._kv_allocator = None
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
    def max_request_input_len(self) -> int:
        return int(self._scheduler.max_req_input_len)

    @property
    def context_length(self) -> int:
        return int(self._model_runner.model_config.context_len)

    @property
    def vocab_size(self) -> int:
        return int(self._model_runner.model_config.vocab_size)

    @property
    def hf_config(self):
        return self._model_runner.model_config.hf_config

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
            specs.append(LeafSpec(name, tuple(leaf.shape), leaf.dtype, leaf.sharding, int(leaf.nbytes)))
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

    def reload_weights_from_model_dir(self) -> None:
        """sglang-jax's own safetensors load into the running model. Scheduler thread only.

        The engine's reload path, kept as the baseline the sync benchmark compares against.
        Needs an engine started with a safetensors load format (the loader adds rng leaves).
        """
        from flax import nnx

        runner = self._model_runner
        runner.model.load_weights(runner.model_config, jax.random.key(self.options.seed))
        _, state = nnx.split(runner.model)
        leaves, _ = jax.tree_util.tree_flatten(state)
        self._closure_cells()["model_state_leaves"].cell_contents = leaves

    # ---- KV cache and prefix cache ---------------------------------------------------------

    def flush_prefix_cache(self) -> None:
        """Forget every cached prefix so no KV computed with old weights is reused.

        Must run on the scheduler thread while idle (use :meth:`call`).
        """
        scheduler = self._scheduler
        scheduler.tree_cache.reset()
        scheduler.req_to_token_pool.clear()
        scheduler.token_to_kv_pool_allocator.clear()
        scheduler.last_batch = None

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

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self,
        input_ids: Sequence[Sequence[int]],
        sampling_params: Sequence[dict],
    ) -> list[GenerateOutput]:
        """Generate for each token-id prompt with its own sampling params (one dict each)."""
        from sgl_jax.srt.managers.io_struct import GenerateReqInput

        self.check_alive()
        request = GenerateReqInput(
            input_ids=[list(map(int, ids)) for ids in input_ids],
            sampling_params=[dict(p) for p in sampling_params],
        )
        results = self._run(self._tokenizer_manager.generate_request(request, None).__anext__())
        if isinstance(results, dict):
            results = [results]
        return [_to_output(r) for r in results]

    def _run(self, coroutine):
        async def guarded():
            task = asyncio.ensure_future(coroutine)
            while True:
                done, _ = await asyncio.wait({task, self._result_task}, timeout=0.05)
                if task in done:
                    return task.result()
                if self._result_task in done:
                    task.cancel()
                    exc = self._result_task.exception()
                    self._control.fail(exc or EngineError("engine result loop ended"))
                if self._control.error is not None or self._control.stopped.is_set():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                    raise self._control.dead_error()

        return self._loop.run_until_complete(guarded())

    # ---- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine's threads and release its sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        control = self._control
        control.stop_requested = True
        control.wake()
        if control.thread is not None:
            control.thread.join(timeout=30)
            if control.thread.is_alive():
                logger.warning("sglang-jax scheduler thread did not stop within 30 s")
        detokenizer = _detokenizers.pop(self._engine.port_args.detokenizer_ipc_name, None)
        if detokenizer is not None:
            stop, thread = detokenizer
            stop.set()
            thread.join(timeout=5)
        self._result_task.cancel()
        with contextlib.suppress(BaseException):
            self._loop.run_until_complete(self._result_task)
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


# Stands in for a released weight leaf (see EngineHandle.release_weight_leaves).
_RELEASED = np.zeros((), np.float32)


def device_buffers(array: jax.Array) -> dict[tuple[int, int], int]:
    """The device buffers behind an array: (device id, buffer address) -> bytes."""
    return {
        (shard.device.id, shard.data.unsafe_buffer_pointer()): int(shard.data.nbytes)
        for shard in array.addressable_shards
    }


def device_nbytes(array: jax.Array) -> int:
    """Bytes an array occupies summed over its devices (replicas count once per device)."""
    return sum(device_buffers(array).values())


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _to_output(result: dict) -> GenerateOutput:
    meta = result.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    return GenerateOutput(
        output_ids=list(result.get("output_ids", [])),
        finish_reason=str(finish.get("type", "unknown")),
        completion_tokens=int(meta.get("completion_tokens", len(result.get("output_ids", [])))),
        cache_miss_count=int(meta.get("cache_miss_count", 0)),
    )

