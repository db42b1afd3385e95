"""Multi-process jobs: join one (``jax.distributed.initialize`` from flags or environment
variables), leave it (also after a process was lost), or launch N local processes of a program
(CPU runs and tests on one machine; ``python -m rollout.launch -n 2 -- prog.py args...``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from . import pod

logger = logging.getLogger(__name__)

# JAX itself reads JAX_COORDINATOR_ADDRESS; the process count and index are this project's names
# (on TPU pods and SLURM, jax.distributed.initialize() detects all three by itself).
COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def join(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int = 100,
) -> bool:
    """``jax.distributed.initialize`` from the arguments, else the environment variables above.
    False (nothing done) when neither names a job of more than one process.

    ``heartbeat_timeout_s``: after that long without heartbeats from a process, JAX's
    coordination service declares it dead and terminates every other process (JAX's default
    is 100 s); the worker's own checks name a lost process sooner (``WorkerConfig.pod_timeout_s``).
    """
    coordinator = coordinator or os.environ.get(COORDINATOR_ENV)
    if num_processes is None and os.environ.get(NUM_PROCESSES_ENV):
        num_processes = int(os.environ[NUM_PROCESSES_ENV])
    if process_id is None and os.environ.get(PROCESS_ID_ENV):
        process_id = int(os.environ[PROCESS_ID_ENV])
    if not coordinator or not num_processes or num_processes < 2:
        return False
    if process_id is None:
        raise ValueError(
            f"a job of {num_processes} processes needs this process's id ({PROCESS_ID_ENV} or process_id=)"
        )
    import jax

    jax.distributed.initialize(
        coordinator, num_processes=num_processes, process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s
    )
    logger.info("process %d of %d joined the job at %s", process_id, num_processes, coordinator)
    return True


def leave(code: int = 0, *, timeout_s: float = 60.0) -> NoReturn:
    """End this process of the job with exit status ``code``; it never returns. Call it last,
    after ``worker.close()``.

    Every process alive: ``jax.distributed.shutdown()`` (JAX's barrier: each process waits there
    until every process has left), then ``sys.exit(code)``. Outside a job: ``sys.exit(code)``.

    After a :class:`PodError` named a process that did not arrive (``rollout.pod.gone_processes()``):
    JAX's client cannot disconnect without its shutdown barrier, which waits for the lost process
    until ``heartbeat_timeout_s`` and then terminates this one with status 1 however the error was
    handled (jax 0.8 to 0.12; a shorter shutdown timeout only terminates it sooner). So the
    process flushes its logs and ends with ``os._exit(code)``, skipping atexit hooks (finish
    checkpoint writes first). Bound: at once (one key-value write), except on process 0 while
    other processes survive: its exit ends JAX's coordination service, and JAX terminates every
    process still connected to it, so process 0 first waits for the others to call ``leave`` (at
    most ``timeout_s``), then 2 s for their exits to land. Between the loss and ``leave`` a survivor
    may go on (generation is local) for up to ``heartbeat_timeout_s``: then JAX terminates it.
    """
    import jax

    if not jax.distributed.is_initialized():
        sys.exit(code)
    gone = pod.gone_processes()
    if not gone:
        jax.distributed.shutdown()
        sys.exit(code)
    logger.warning(
        "process %d leaves the job without JAX's shutdown barrier: process(es) %s gone",
        jax.process_index(),
        sorted(gone),
    )
    if jax.process_index() != 0:
        _flush()  # before announcing: after it, only the exit itself is left
    late = pod.announce_leaving(timeout_s)
    if late:
        logger.warning("process(es) %s did not leave within %g s; JAX will terminate them", list(late), timeout_s)
    if jax.process_index() == 0 and len(gone | set(late) | {0}) < jax.process_count():
        # The others announced just before their os._exit: let it land before the coordination
        # service goes (no signal of another host's exit exists to wait on).
        time.sleep(_EXIT_LANDING_S)
    _flush()
    os._exit(code)


def _flush() -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


# How long process 0 lets the other survivors' exits land after they announced them.
_EXIT_LANDING_S = 2.0


def free_port() -> int:
    """A loopback port nobody listens on now (the coordinator binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    process_id: int
    returncode: int | None  # None: the launcher stopped it (``stopped`` says why)
    log: str  # its stdout and stderr
    stopped: str = ""  # why the launcher stopped it: its timeout, or another process failing first
    seconds: float = 0.0  # from the launch to its end

    @property
    def ended(self) -> str:
        """How it ended, in words: 'exit status 0', 'killed by SIGKILL', 'stopped: ...'."""
        if self.returncode is None:
            return f"stopped: {self.stopped}"
        return _how(self.returncode)


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


# A stopped process gets SIGTERM, then SIGKILL this much later: a process of a JAX job takes
# SIGTERM as a preemption notice and goes on (JAX's preemption notifier).
_KILL_AFTER_S = 5.0
# What a stopped launcher logs of each process's output.
_OUTPUT_TAIL = 20_000

# What a child runs first on Linux, before the program (``argv[1]``: the launcher's pid): the
# kernel is to SIGKILL it when the launcher dies (PR_SET_PDEATHSIG), as a launcher killed with
# SIGKILL cannot stop its children itself; a launcher already gone ends it at once.
_DIE_WITH_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(128 + signal.SIGKILL)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


def _child_argv(argv: Sequence[str]) -> list[str]:
    if sys.platform == "linux":
        return [sys.executable, "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *argv]
    return [sys.executable, *argv]


@contextlib.contextmanager
def _stopped_by_signals():
    """While open, SIGTERM or SIGHUP to the launcher raise SystemExit (128 + the signal) where
    it waits, so that it stops its children on the way out instead of leaving them running.
    Only on the main thread, where Python delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    previous = {signum: signal.signal(signum, leave) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():  # None: a handler not set from Python
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """Stop the processes still running: SIGTERM, then SIGKILL after ``_KILL_AFTER_S``."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + _KILL_AFTER_S
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def launch_local(
    argv: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    timeout_s: float = math.inf,
    grace_s: float = 0.0,
    env: Mapping[str, str] | None = None,
) -> list[ProcessResult]:
    """Run ``python argv...`` as ``num_processes`` processes of one JAX job on this machine
    (coordinator on a free loopback port) and wait for all of them, at most ``timeout_s``
    (by default no limit: a training run takes what it takes). Once a process fails (a non-zero
    exit status or a signal), the others may go on for ``grace_s`` (to handle their ``PodError``
    and ``leave()``), then they are stopped: SIGTERM, SIGKILL 5 s later; so are they when the
    launcher is interrupted or (called from the main thread) gets SIGTERM or SIGHUP, their
    output then logged, and on Linux they die with a launcher killed outright. The results are in
    process order; a stopped process's ``stopped`` names the process that failed first and how.
    ``devices_per_process`` fakes that many host-platform devices in each process
    (``--xla_force_host_platform_device_count``)."""
    base = {**os.environ, **(env or {})}
    base.update({COORDINATOR_ENV: f"127.0.0.1:{free_port()}", NUM_PROCESSES_ENV: str(num_processes)})
    if devices_per_process is not None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", base.get("XLA_FLAGS", ""))
        base["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
    with tempfile.TemporaryDirectory(prefix="rollout-launch-") as logs:
        procs: list[subprocess.Popen] = []
        ends: queue.Queue[int] = queue.Queue()
        start = time.monotonic()
        try:
            with _stopped_by_signals():
                for i in range(num_processes):
                    with open(Path(logs) / f"{i}.log", "w") as log:  # the child keeps its own copy
                        env_i = {**base, PROCESS_ID_ENV: str(i)}
                        procs.append(
                            subprocess.Popen(_child_argv(argv), env=env_i, stdout=log, stderr=subprocess.STDOUT)
                        )
                    # One waiter per child: the launcher wakes on whichever ends first.
                    threading.Thread(target=lambda p=procs[i], i=i: (p.wait(), ends.put(i)), daemon=True).start()
                seconds, stopped = _supervise(procs, ends, start, timeout_s, grace_s)
        except BaseException:  # the launcher itself was interrupted or signalled
            _stop(procs)
            for i in range(len(procs)):  # the caller, which prints them from the results, gets none
                output = (Path(logs) / f"{i}.log").read_text(errors="replace")
                logger.warning(
                    "--- process %d, stopped with the launcher (last %d characters) ---\n%s",
                    i,
                    _OUTPUT_TAIL,
                    output[-_OUTPUT_TAIL:],
                )
            raise
        finally:
            _stop(procs)  # any left running
        return [
            ProcessResult(
                i,
                None if i in stopped else proc.returncode,
                (Path(logs) / f"{i}.log").read_text(errors="replace"),
                stopped.get(i, ""),
                seconds.get(i, time.monotonic() - start),
            )
            for i, proc in enumerate(procs)
        ]


def _supervise(
    procs: list[subprocess.Popen], ends: queue.Queue, start: float, timeout_s: float, grace_s: float
) -> tuple[dict[int, float], dict[int, str]]:
    """Wait for every process to end; stop the rest at the timeout, or ``grace_s`` after the
    first failure. (seconds each ran, why each stopped one was stopped)."""
    pending = set(range(len(procs)))
    seconds: dict[int, float] = {}
    stopped: dict[int, str] = {}
    stop_at, reason = start + timeout_s, f"the launch's {timeout_s:g} s timeout"
    signalled = None  # the signal the pending processes got last
    failed = False
    while pending:
        wait = None if math.isinf(stop_at) else max(0.0, stop_at - time.monotonic())
        try:
            i = ends.get(timeout=wait)
        except queue.Empty:
            if signalled == signal.SIGKILL:
                logger.warning("process(es) %s did not end %g s after SIGKILL", sorted(pending), _KILL_AFTER_S)
                break
            signalled = signal.SIGTERM if signalled is None else signal.SIGKILL
            for j in pending:
                stopped.setdefault(j, reason)
                procs[j].send_signal(signalled)
            stop_at = time.monotonic() + _KILL_AFTER_S
            continue
        pending.discard(i)
        seconds[i] = time.monotonic() - start
        code = procs[i].returncode
        if code != 0 and not failed and signalled is None:
            failed = True
            if pending:
                logger.warning("process %d failed (%s): the others are stopped in %g s", i, _how(code), grace_s)
            if time.monotonic() + grace_s < stop_at:
                stop_at, reason = time.monotonic() + grace_s, f"process {i} failed first ({_how(code)})"
    return seconds, stopped


def exit_status(results: Sequence[ProcessResult]) -> int:
    """One exit status for a launch: 0 when every process exited 0, else that of the process that
    failed first by itself (a signal as 128 + its number, as shells do; 124 when the launcher
    only stopped processes at its timeout)."""
    failures = sorted((r for r in results if r.returncode not in (0, None)), key=lambda r: r.seconds)
    if failures:
        code = failures[0].returncode
        return 128 - code if code < 0 else code
    return 124 if any(r.returncode is None for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rollout.launch -n N [options] -- prog.py args...`` (or ``-- -m module args...``):
    :func:`launch_local` as a command. Prints each process's output after the run, then how each
    ended; exits with :func:`exit_status`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        argv.append("--")  # argparse then reports what is missing
    split = argv.index("--")
    parser = argparse.ArgumentParser(
        prog="python -m rollout.launch",
        usage="%(prog)s -n N [options] -- prog.py args... | -m module args...",
        description="Run a Python program as N processes of one JAX job on this machine "
        "(coordinator on a free loopback port; JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
        "JAX_PROCESS_ID set for rollout.launch.join()).",
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, help="fake host-platform (CPU) devices per process")
    parser.add_argument(
        "--timeout", type=float, default=math.inf, help="seconds; then every process is stopped (default: none)"
    )
    parser.add_argument(
        "--grace", type=float, default=0.0, help="seconds the others may go on after one fails (default: 0)"
    )
    args = parser.parse_args(argv[:split])
    program = argv[split + 1 :]
    if not program:
        parser.error("no program after --")
    results = launch_local(
        program,
        args.num_processes,
        devices_per_process=args.devices_per_process,
        timeout_s=args.timeout,
        grace_s=args.grace,
    )
    for r in results:
        sys.stdout.write(f"--- process {r.process_id} ({r.ended}) ---\n{r.log}")
    sys.stdout.flush()
    for r in results:
        sys.stderr.write(f"process {r.process_id}: {r.ended} after {r.seconds:.1f} s\n")
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
