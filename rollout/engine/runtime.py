"""The engine's threads: guarded scheduler loop, idle wait, queued calls, watchdog, detokenizer."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import queue
import socket
import threading
import time
import traceback

import jax
from jax._src import config as jax_config

from . import freed
from .lora import write_token_slots
from .routing import RoutingRecorder
from .start_up import current_start_up, default_device
from .types import EngineError
from .workarounds import workaround_enabled

logger = logging.getLogger(__name__)


class _StopScheduler(BaseException):
    """Raised inside the scheduler loop to end it cleanly (the loop catches Exception only)."""


# Forward passes whose (start, end) times each engine keeps; as many weight swaps' records.
BUSY_INTERVALS_KEPT = 4096

# The threads every engine runs besides the caller's: start-up waits until each has registered.
ENGINE_THREAD_ROLES = ("scheduler", "watchdog", "detokenizer")


# How long the scheduler waits for the rest of a call's requests once the first has arrived; a
# backstop only (the tokenizer manager sends them within microseconds of each other).
WHOLE_BATCH_WAIT_S = 5.0


class BatchArrivals:
    """The request ids of calls being sent to the scheduler, so that it admits each call whole.

    0.0.2's tokenizer manager sends a call's requests one by one, and the scheduler takes what
    has arrived when it wakes: on a loaded host a call's rows were split over several prefills
    (extra forwards, and batch shapes a warmed engine had never compiled). The request loop
    registers a call's ids before sending it; the scheduler, having received part of a call,
    waits for the rest (``_idle_aware_recv``).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._call_of: dict[str, int] = {}  # rid -> call
        self._missing: dict[int, set[str]] = {}  # call -> its rids not received yet
        self._started: set[int] = set()  # calls with some but not all rids received
        self._next_call = 0

    def expect(self, rids: list[str]) -> int:
        with self._lock:
            call, self._next_call = self._next_call, self._next_call + 1
            self._missing[call] = set(rids)
            self._call_of.update(dict.fromkeys(rids, call))
            return call

    def withdraw(self, call: int) -> None:
        """The call is sent, or failed before sending all (then the scheduler stops waiting)."""
        with self._lock:
            for rid in self._missing.pop(call, ()):
                self._call_of.pop(rid, None)
            self._started.discard(call)

    def received(self, requests: list) -> None:
        with self._lock:
            for request in requests:
                rid = getattr(request, "rid", None)
                call = self._call_of.pop(rid, None) if isinstance(rid, str) else None
                if call is None:
                    continue
                missing = self._missing[call]
                missing.discard(request.rid)
                if missing:
                    self._started.add(call)
                else:
                    del self._missing[call]
                    self._started.discard(call)

    @property
    def partly_received(self) -> bool:
        return bool(self._started)


class SchedulerControl:
    """State shared between the caller's threads and one engine's threads."""

    _registry_lock = threading.Lock()

    def __init__(self, name: str = "engine"):
        self.name = name
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        # Calls that run at the next forward boundary, busy or not:
        # [(condition, fn, future, keeps_decode_chunks)].
        self.boundary_calls: list[tuple] = []
        self._boundary_lock = threading.Lock()
        # The weight version the engine's forwards use (set by each swap, on the scheduler thread).
        self.weight_version = 0
        # rid -> the weight version of each token sampled for that request (every request).
        self.version_sinks: dict[str, list[int]] = {}
        # rid -> [the tokens its prefills computed], re-prefills after a retraction included.
        self.prefill_sinks: dict[str, list[int]] = {}
        self.arrivals = BatchArrivals()
        # Set when the engine records MoE routing (EngineOptions.record_routing).
        self.routing: RoutingRecorder | None = None
        # Several LoRA adapter slots (EngineOptions.max_loras > 1, rollout/engine/lora.py): the
        # slot of each named adapter, the slot of each request using one (others: slot 0), and
        # the index of the forward's leaf holding each token's slot.
        self.lora_names: dict[str, int] = {}
        self.lora_slots: dict[str, int] = {}
        # Held around every change and read of the two (not the scheduler's lookups): a call
        # looks up its adapter's slot and registers its requests on it at once, so an unload
        # never leaves the slot of a call about to run looking free.
        self.lora_lock = threading.Lock()
        self.token_slots_leaf: int | None = None
        # Decode steps computed ahead (EngineOptions.decode_steps, multistep.DecodeChunks).
        self.decode_chunks = None
        # rid -> the error of a request the engine aborted itself (freed.py), read with its answer.
        self.aborted: dict[str, BaseException] = {}
        self.error: BaseException | None = None
        self.error_traceback = ""
        self.stop_requested = False
        self.stopped = threading.Event()
        # Set by close(): the watchdog and detokenizer threads end.
        self.closing = threading.Event()
        self.thread: threading.Thread | None = None
        self.threads: dict[str, threading.Thread] = {}
        self._threads_changed = threading.Condition()
        self.busy: collections.deque[tuple[float, float]] = collections.deque(maxlen=BUSY_INTERVALS_KEPT)
        self.swaps: collections.deque = collections.deque(maxlen=BUSY_INTERVALS_KEPT)
        # A socket pair lets other threads wake the scheduler out of its idle poll.
        self.wake_reader, self.wake_writer = socket.socketpair()
        self.wake_reader.setblocking(False)

    @classmethod
    def of(cls, scheduler) -> SchedulerControl:
        with cls._registry_lock:
            control = scheduler.__dict__.get("_rollout_control")
            if control is None:
                start_up = current_start_up()
                control = scheduler._rollout_control = cls(start_up.name if start_up else "engine")
                if start_up is not None:
                    start_up.control = control
            return control

    def register_thread(self, role: str) -> None:
        """Called first thing by each engine thread, so that close() can join it."""
        thread = threading.current_thread()
        thread.name = f"sglang-jax::{role} {self.name}"
        with self._threads_changed:
            self.threads[role] = thread
            self._threads_changed.notify_all()

    def wait_for_threads(self, timeout: float) -> None:
        with self._threads_changed:
            if not self._threads_changed.wait_for(
                lambda: all(role in self.threads for role in ENGINE_THREAD_ROLES), timeout
            ):
                missing = sorted(set(ENGINE_THREAD_ROLES) - set(self.threads))
                logger.warning("%s: threads %s did not start within %s s", self.name, missing, timeout)

    def stop_threads(self, timeout: float = 30.0) -> None:
        """Stop the scheduler loop, then end and join every thread the engine registered."""
        self.stop_requested = True
        self.wake()
        deadline = time.monotonic() + timeout
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        # The watchdog waits on `stopped`, the detokenizer on `closing`.
        self.closing.set()
        self.stopped.set()
        for role, thread in list(self.threads.items()):
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("%s: %s thread did not stop within %s s", self.name, role, timeout)

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self.wake_writer.send(b"x")

    def drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self.wake_reader.recv(4096):
                pass

    def fail(self, exc: BaseException) -> None:
        """Record the engine's error, fail the calls waiting on it, and end its scheduler loop
        (at its next top: a failed engine runs no forward again, and what it holds may be freed)."""
        if self.error is None:
            self.error = exc
            self.error_traceback = "".join(traceback.format_exception(exc))
            logger.error("%s failed:\n%s", self.name, self.error_traceback)
        self.stop_requested = True
        self.wake()
        self._fail_pending()

    def _fail_pending(self) -> None:
        with self._boundary_lock:
            boundary, self.boundary_calls = self.boundary_calls, []
        for _, _, future, _ in boundary:
            self._fail_future(future)
        while True:
            try:
                _, future = self.calls.get_nowait()
            except queue.Empty:
                return
            self._fail_future(future)

    def _fail_future(self, future: concurrent.futures.Future) -> None:
        # Not one already running (the scheduler thread sets its outcome) or cancelled.
        if future.set_running_or_notify_cancel():
            future.set_exception(self.dead_error())

    def dead_error(self) -> EngineError:
        if self.error is not None:
            return EngineError(
                f"{self.name}: the sglang-jax engine thread failed: {self.error!r}\n{self.error_traceback}"
            )
        return EngineError(f"{self.name}: the sglang-jax engine has been shut down")

    def queue_at_boundary(self, fn, when, future, keeps_decode_chunks: bool = False) -> None:
        with self._boundary_lock:
            self.boundary_calls.append((when, fn, future, keeps_decode_chunks))
        self.wake()

    @property
    def boundary_calls_queued(self) -> int:
        return len(self.boundary_calls)

    def run_boundary_calls(self) -> None:
        """Run the boundary calls whose condition holds (in queue order), again until none is
        ready: a call queued while another runs (a swap queued during a hold) runs at the same
        boundary, with no forward in between."""
        while True:
            with self._boundary_lock:
                ready, waiting = [], []
                for entry in self.boundary_calls:
                    (ready if _ready(entry) else waiting).append(entry)
                if not ready:
                    return
                self.boundary_calls = waiting
            # A call that may change weights or KV ends the decode chunks computed under them.
            if self.decode_chunks is not None and not all(entry[3] for entry in ready):
                self.decode_chunks.release()
            for when, fn, future, _ in ready:
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    if when is not None:
                        when()  # re-raises a condition that failed
                    future.set_result(fn())
                except BaseException as exc:  # the caller gets it; the engine keeps serving
                    future.set_exception(exc)

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


def _ready(entry) -> bool:
    when, _, future, _ = entry
    if when is None or future.cancelled():
        return True
    try:
        return bool(when())
    except Exception:  # a broken condition fails its call (the call re-raises it), not the engine
        return True


def _scheduler_is_idle(scheduler) -> bool:
    return (
        not scheduler.waiting_queue
        and scheduler.running_batch.is_empty()
        and scheduler.chunked_req is None
        and scheduler.cur_batch is None
    )


def _idle_aware_recv(scheduler, original_recv, control: SchedulerControl, poller, arrival_poller):
    """Replacement for Scheduler.recv_requests: runs queued calls, sleeps while idle, and takes
    each call's requests together."""
    # Disabled, the idle loop polls without blocking, as 0.0.2's own loop does.
    idle_wait_ms = 1000 if workaround_enabled("idle-busy-spin") else 0
    whole_calls = workaround_enabled("whole-batch-admission")

    def recv_whole_calls():
        requests = original_recv()
        if not whole_calls:
            return requests
        control.arrivals.received(requests)
        deadline = time.monotonic() + WHOLE_BATCH_WAIT_S
        while control.arrivals.partly_received and not control.stop_requested:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("%s: a call's requests still incomplete after %.0f s", control.name, WHOLE_BATCH_WAIT_S)
                break
            # Short polls: a call that failed before sending all its requests is withdrawn.
            arrival_poller.poll(max(1, int(min(left, 0.05) * 1000)))
            more = original_recv()
            control.arrivals.received(more)
            requests += more
        return requests

    def recv_requests():
        while True:
            if control.stop_requested:  # close(): stop between forwards, even with work running
                raise _StopScheduler()
            # The top of a loop iteration: the previous forward's results are processed and the
            # next batch is not chosen yet.
            control.run_boundary_calls()
            requests = recv_whole_calls()
            if not _scheduler_is_idle(scheduler):
                return requests
            control.run_pending()
            if requests:
                return requests
            poller.poll(idle_wait_ms)
            control.drain_wakeups()

    return recv_requests


def _timed(run_batch, control: SchedulerControl):
    """Records each forward pass's (start, end) perf_counter times (run_batch waits for the
    sampled tokens, so the interval covers the device work). With decode chunks a step taken
    from a chunk records its host work only: the device's is in the step that dispatched the
    chunk, or for a chunk computed ahead in the scheduler's wait before its first step."""

    def timed_run_batch(batch):
        start = time.perf_counter()
        try:
            return run_batch(batch)
        finally:
            control.busy.append((start, time.perf_counter()))

    return timed_run_batch


def _versions_recorded(run_batch, control: SchedulerControl):
    """Records, per request, the weight version of the forward that sampled each of its tokens:
    exact across swaps at forward boundaries, whatever KV the request continues from; the
    tokens each of its prefill chunks computed; and the prompt tokens its first prefill found
    cached (0.0.2 adds a retracted request's count again when it is prefilled again)."""

    def versioned_run_batch(batch):
        result = run_batch(batch)
        version, sinks = control.weight_version, control.version_sinks
        extend = batch.forward_mode.is_extend()
        if extend:
            for req in batch.reqs:
                prefilled = control.prefill_sinks.get(req.rid)
                if prefilled is not None:
                    prefilled[0] += req.extend_input_len
                    if prefilled[1] is None:
                        prefilled[1] = req.cached_tokens
        for req in batch.reqs:
            # As process_batch_result (no overlap scheduler): retracted rows and prefill chunks
            # before the last get no token.
            sink = sinks.get(req.rid)
            if sink is not None and not req.is_retracted and not (extend and req.is_chunked > 0):
                sink.append(version)
        return result

    return versioned_run_batch


def _token_slots_written(run_batch, scheduler, control: SchedulerControl):
    """With several LoRA slots, each token's slot is written before its forward runs."""

    def slotted_run_batch(batch):
        if control.token_slots_leaf is not None:
            write_token_slots(scheduler, batch, control.lora_slots, control.token_slots_leaf)
        return run_batch(batch)

    return slotted_run_batch


def _routing_recorded(run_batch, scheduler, control: SchedulerControl):
    """Files each forward's MoE routing with the engine's ``RoutingRecorder`` (when it has one)."""

    def routing_run_batch(batch):
        result = run_batch(batch)
        runner = scheduler.tp_worker.worker.model_runner
        routing = runner.__dict__.pop("_rollout_routing", None)
        if control.routing is not None and routing is not None:
            control.routing.record(batch, routing, scheduler.req_to_token_pool.req_to_token)
        return result

    return routing_run_batch


def _run_scheduler_loop(scheduler, control: SchedulerControl, server_args, devices, matmul_precision) -> None:
    # The engine's default device, and the matmul precision its start-up left set: 0.0.2 sets
    # 'highest' process-wide on GPU; preserved_process_state puts the process-wide value back,
    # so here it holds for this engine's thread only.
    with default_device(devices), jax.default_matmul_precision(matmul_precision):
        _scheduler_loop(scheduler, control, server_args)


def _scheduler_loop(scheduler, control: SchedulerControl, server_args) -> None:
    import zmq
    from sgl_jax.srt.managers.scheduler import scheduler_loop_after_create

    control.register_thread("scheduler")
    poller = zmq.Poller()
    poller.register(scheduler.recv_from_tokenizer, zmq.POLLIN)
    poller.register(scheduler.recv_from_rpc, zmq.POLLIN)
    poller.register(control.wake_reader.fileno(), zmq.POLLIN)
    arrival_poller = zmq.Poller()
    arrival_poller.register(scheduler.recv_from_tokenizer, zmq.POLLIN)
    scheduler.recv_requests = _idle_aware_recv(scheduler, scheduler.recv_requests, control, poller, arrival_poller)
    scheduler.run_batch = _routing_recorded(
        _versions_recorded(_timed(_token_slots_written(scheduler.run_batch, scheduler, control), control), control),
        scheduler,
        control,
    )
    try:
        if workaround_enabled("process-kill-on-error"):
            while True:
                try:
                    scheduler.event_loop_normal()
                except Exception as exc:
                    if not freed.aborted_for_freed_weights(scheduler, control, exc):
                        raise  # the calls of freed weights fail, the engine serves on; not others
        else:
            # The engine's own loop wrapper: an exception signals SIGQUIT to this process.
            scheduler_loop_after_create(server_args, scheduler)
    except _StopScheduler:
        pass
    except BaseException as exc:
        control.fail(exc)
    finally:
        control.stopped.set()
        control._fail_pending()


def start_scheduler_thread(server_args, port_args) -> dict:
    """Replacement for run_scheduler_loop_thread_after_create: errors reach the caller."""
    from sgl_jax.srt.managers.scheduler import Scheduler

    scheduler = Scheduler(server_args, port_args)
    control = SchedulerControl.of(scheduler)
    start_up = current_start_up()
    control.thread = threading.Thread(
        target=_run_scheduler_loop,
        args=(
            scheduler,
            control,
            server_args,
            start_up.devices if start_up else None,
            jax_config.default_matmul_precision.get_global(),
        ),
        daemon=True,
    )
    control.thread.start()
    return {
        "status": "ready",
        "max_total_num_tokens": scheduler.max_total_num_tokens,
        "max_req_input_len": scheduler.max_req_input_len,
        "scheduler": scheduler,
    }


def watchdog_thread(scheduler) -> None:
    """Replacement for Scheduler.watchdog_thread: fails the engine instead of killing a process."""
    control = SchedulerControl.of(scheduler)
    control.register_thread("watchdog")
    last_count, last_progress = scheduler.forward_ct, time.perf_counter()
    period = max(1.0, min(60.0, scheduler.watchdog_timeout / 4))
    while not control.stopped.wait(period):
        now = time.perf_counter()
        if scheduler.cur_batch is None or scheduler.forward_ct != last_count:
            last_count, last_progress = scheduler.forward_ct, now
        elif now - last_progress > scheduler.watchdog_timeout:
            control.fail(EngineError(f"no forward progress for {scheduler.watchdog_timeout:.0f} s (watchdog)"))
            return


def run_detokenizer_thread(server_args, port_args) -> None:
    """Replacement for run_detokenizer_thread: stoppable, and errors do not kill the process.

    Started by the engine during start-up, after the scheduler: the start-up (which holds the
    start-up lock until this thread has registered) says which engine it belongs to.
    """
    import zmq
    from sgl_jax.srt.managers.detokenizer_manager import DetokenizerManager

    start_up = current_start_up()
    if start_up is None or start_up.control is None:
        raise EngineError("sglang-jax detokenizer started outside an engine start-up")
    control = start_up.control
    control.register_thread("detokenizer")
    manager = DetokenizerManager(server_args, port_args)
    try:
        while not control.closing.is_set():
            if not manager.recv_from_scheduler.poll(100, zmq.POLLIN):
                continue
            output = manager._request_dispatcher(manager.recv_from_scheduler.recv_pyobj())
            manager.send_to_tokenizer.send_pyobj(output)
    except Exception:
        logger.exception("sglang-jax detokenizer thread failed")
    finally:
        for sock in (manager.recv_from_scheduler, manager.send_to_tokenizer):
            sock.close(linger=0)
