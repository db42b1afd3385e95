"""Multi-process jobs: join one (``jax.distributed.initialize`` from flags or environment
variables) or launch N local processes of a program (CPU runs and tests on one machine)."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

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
        raise ValueError(f"a job of {num_processes} processes needs this process's id ({PROCESS_ID_ENV} or process_id=)")
    import jax

    jax.distributed.initialize(
        coordinator, num_processes=num_processes, process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s
    )
    logger.info("process %d of %d joined the job at %s", process_id, num_processes, coordinator)
    return True


def free_port() -> int:
    """A loopback port nobody listens on now (the coordinator binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    process_id: int
    returncode: int | None  # None: killed at the timeout
    log: str  # its stdout and stderr


def launch_local(
    argv: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
) -> list[ProcessResult]:
    """Run ``python argv...`` as ``num_processes`` processes of one JAX job on this machine
    (coordinator on a free loopback port) and wait for all of them, at most ``timeout_s``
    (then the rest are killed). ``devices_per_process`` fakes that many host-platform devices
    in each process (``--xla_force_host_platform_device_count``)."""
    base = {**os.environ, **(env or {})}
    base.update({COORDINATOR_ENV: f"127.0.0.1:{free_port()}", NUM_PROCESSES_ENV: str(num_processes)})
    if devices_per_process is not None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", base.get("XLA_FLAGS", ""))
        base["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
    with tempfile.TemporaryDirectory(prefix="rollout-launch-") as logs:
        procs = []
        for i in range(num_processes):
            log = open(Path(logs) / f"{i}.log", "w")  # closed below, after the process ends
            procs.append((subprocess.Popen([sys.executable, *argv], env={**base, PROCESS_ID_ENV: str(i)}, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for proc, _ in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes.append(None)
        results = []
        for i, ((_, log), code) in enumerate(zip(procs, codes)):
            log.close()
            results.append(ProcessResult(i, code, (Path(logs) / f"{i}.log").read_text(errors="replace")))
    return results
