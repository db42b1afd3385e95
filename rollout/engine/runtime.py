"""The engine's scheduler thread: guarded loop, idle wait, queued calls, watchdog, detokenizer."""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
import traceback

from .types import EngineError

logger = logging.getLogger(__name__)


class _StopScheduler(BaseException):
    """Raised inside the scheduler loop to end it cleanly (the loop catches Exception only)."""


class SchedulerControl:
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
    def of(cls, scheduler) -> SchedulerControl:
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


def _idle_aware_recv(scheduler, original_recv, control: SchedulerControl, poller):
    """Replacement for Scheduler.recv_requests: runs queued calls and sleeps while idle."""
    from .patches import workaround_enabled

    # Disabled, the idle loop polls without blocking, as 0.0.2's own loop does.
    idle_wait_ms = 1000 if workaround_enabled("idle-busy-spin") else 0

    def recv_requests():
        while True:
            requests = original_recv()
            if not _scheduler_is_idle(scheduler):
                return requests
            control.run_pending()
            if requests:
                return requests
            poller.poll(idle_wait_ms)
            control.drain_wakeups()

    return recv_requests


def _run_scheduler_loop(scheduler, control: SchedulerControl, server_args) -> None:
    import zmq
    from sgl_jax.srt.managers.scheduler import scheduler_loop_after_create

    from .patches import workaround_enabled

    threading.current_thread().name = "sglang-jax::scheduler"
    poller = zmq.Poller()
    poller.register(scheduler.recv_from_tokenizer, zmq.POLLIN)
    poller.register(scheduler.recv_from_rpc, zmq.POLLIN)
    poller.register(control.wake_reader.fileno(), zmq.POLLIN)
    scheduler.recv_requests = _idle_aware_recv(
        scheduler, scheduler.recv_requests, control, poller
    )
    try:
        if workaround_enabled("process-kill-on-error"):
            scheduler.event_loop_normal()
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
    control.thread = threading.Thread(
        target=_run_scheduler_loop, args=(scheduler, control, server_args), daemon=True
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
detokenizers: dict[str, tuple[threading.Event, threading.Thread]] = {}


def run_detokenizer_thread(server_args, port_args) -> None:
    """Replacement for run_detokenizer_thread: stoppable, and errors do not kill the process."""
    import zmq
    from sgl_jax.srt.managers.detokenizer_manager import DetokenizerManager

    threading.current_thread().name = "sglang-jax::detokenizer"
    stop = threading.Event()
    detokenizers[port_args.detokenizer_ipc_name] = (stop, threading.current_thread())
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
