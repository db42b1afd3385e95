"""EngineHandle: one sglang-jax engine running in this process: start-up, facts, calls on its
scheduler thread, failure and close. Its model state (weights, KV pool) is in ``state.py``, its
request loop (generate, stream) in ``requests.py``."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import jax

from .patches import install_workarounds, preserved_process_state, variables_sharded_lazily
from .requests import RequestLoop
from .runtime import SchedulerControl
from .start_up import engine_start_up
from .state import ModelState
from .types import EngineError, EngineOptions, engine_name
from .workarounds import workaround_enabled

logger = logging.getLogger(__name__)


class EngineHandle(ModelState, RequestLoop):
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
        self._start_request_loop()
        self._closed = False
        _open_handles.add(self)
        if workaround_enabled("untied-head-dtype"):
            self.call(self._align_lm_head_dtype)

    # ---- engine facts ----------------------------------------------------------------------

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

    def inject_failure(self, error: BaseException) -> None:
        """Make this engine's next forward pass raise ``error`` on its scheduler thread, as a
        real engine bug would: the engine fails and every caller gets an EngineError naming it.
        For fault-tolerance tests and drills."""

        def failing_run_batch(batch):
            raise error

        scheduler = self._scheduler
        self.call(lambda: setattr(scheduler, "run_batch", failing_run_batch))

    # ---- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine's threads and release its sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _open_handles.discard(self)
        control = self._control
        control.stop_threads()
        self._stop_request_loop()
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
