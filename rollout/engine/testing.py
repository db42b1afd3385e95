"""What tests, drills and benchmarks reach into an engine for (``EngineHandle.testing``): make
it fail, read its bookkeeping, run single steps of its state changes. Not for the worker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import inflight
from .runtime import SchedulerControl
from .state import ModelState


class EngineTesting:
    """Test hooks of one engine; ``call`` runs a function on its scheduler thread
    (:meth:`EngineHandle.call`)."""

    def __init__(self, call: Callable[[Callable[[], Any]], Any], control: SchedulerControl, model: ModelState):
        self._call = call
        self._control = control
        self._model = model

    def inject_failure(self, error: BaseException) -> None:
        """Make the engine's next forward pass raise ``error`` on its scheduler thread, as a
        real engine bug would: the engine fails and every caller gets an EngineError naming it."""

        def failing_run_batch(batch):
            raise error

        self._call(lambda: setattr(self._model.scheduler, "run_batch", failing_run_batch))

    def fail_next_flush(self, error: BaseException) -> None:
        """Make the engine's next prefix-cache flush (a weight swap's, after the new leaves
        serve) raise ``error``."""
        model = self._model
        flush = model.flush_prefix_cache

        def failing_flush():
            model.flush_prefix_cache = flush
            raise error

        model.flush_prefix_cache = failing_flush

    def kv_tokens_held(self) -> int:
        """KV slots held by requests once the engine is idle (waits for that): what a request
        that ended or was aborted did not give back. Prefix-cache slots are free to evict and
        not counted."""

        def held() -> int:
            scheduler = self._model.scheduler
            free = scheduler.token_to_kv_pool_allocator.available_size() + scheduler.tree_cache.evictable_size()
            return int(scheduler.max_total_num_tokens) - int(free)

        return self._call(held)

    def swap_records(self) -> list[inflight.SwapRecord]:
        """The engine's latest weight swaps (see ``EngineHandle.busy_intervals`` for its forwards)."""
        return list(self._control.swaps)

    @property
    def boundary_calls_queued(self) -> int:
        """Calls queued with :meth:`EngineHandle.call_at_boundary` that have not started."""
        return self._control.boundary_calls_queued

    def requests_remembered(self) -> int:
        """Requests the request side still keeps state of: the tokenizer manager's, and engine
        aborts not read yet (freed.py). 0 once every call ended."""
        return len(self._model.tokenizer_manager().rid_to_state) + len(self._control.aborted)

    def request_states(self) -> dict:
        """The tokenizer manager's state of each request it remembers, by request id (a copy of
        the dict; ``state.finished`` once its answer arrived)."""
        return dict(self._model.tokenizer_manager().rid_to_state)

    def output_lengths(self) -> dict[str, int]:
        """rid -> tokens sampled so far of every request the scheduler holds. Scheduler thread
        only (a ``call_at_boundary`` condition, for instance)."""
        return inflight.output_lengths(self._model.scheduler)

    def flush_prefix_cache(self) -> None:
        """Forget every cached prefix (a weight swap does it unless told not to)."""
        self._call(self._model.flush_prefix_cache)

    def kv_buffer_spec(self) -> tuple[tuple[int, ...], np.dtype, int]:
        """(shape of one layer's buffer, dtype, number of layers) of the KV pool."""
        return self._model.kv_buffer_spec()

    @property
    def model_runner(self):
        """The engine's model runner (sglang-jax's), to wrap its forward."""
        return self._model.runner
