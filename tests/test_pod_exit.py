"""Ending a multi-process job: ``rollout.launch.leave`` (also after a process was lost) and the
local launcher stopping the others when one fails, as a function and as ``python -m
rollout.launch``. Small jobs without engines (``tests/pod_leave_program.py``, or a few lines of
Python), so each launch takes seconds."""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout import launch
from rollout.launch import exit_status, launch_local
from tests import pod_leave_program

# leave() after a loss in a job of 2 ends the survivor at once; this also covers the launcher
# noticing the exit on a loaded machine. JAX's own way out takes the heartbeat timeout.
LEAVE_BOUND_S = 60
LAUNCH_TIMEOUT_S = 240

# Process 0 ignores SIGTERM (as a process of a JAX job does) and would wait far longer than any
# launch timeout below unless the launcher kills it; process 1 fails once process 0 is ready.
FAIL_ONE = """
import os, pathlib, signal, sys, threading, time
ready = pathlib.Path({ready!r})
if os.environ["JAX_PROCESS_ID"] == "0":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.touch()
    print("process 0 waits", flush=True)
    threading.Event().wait(600)
deadline = time.monotonic() + 120
while not ready.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
{failure}
"""


@pytest.mark.parametrize("mode", ["lost", "clean"])
def test_leave_ends_every_survivor_with_its_status_at_once(tmp_path, mode):
    argv = ["-m", "tests.pod_leave_program", str(tmp_path), mode]
    # The killed process is on purpose: the survivor goes on (grace_s) until it leaves by itself.
    runs = launch_local(argv, 2, timeout_s=LAUNCH_TIMEOUT_S, grace_s=LAUNCH_TIMEOUT_S)
    returned_at = time.monotonic()
    logs = "\n".join(f"--- process {r.process_id} ({r.ended}):\n{r.log[-3000:]}" for r in runs)
    survivor = json.loads((tmp_path / "0.json").read_text())
    if mode == "lost":
        assert [r.returncode for r in runs] == [0, -9], logs
        assert survivor["lost"] == [1]
        # Not JAX's shutdown barrier: that waits for the lost process until the heartbeat timeout,
        # then ends the survivor with status 1.
        assert returned_at - survivor["leaving_at"] < LEAVE_BOUND_S < pod_leave_program.HEARTBEAT_TIMEOUT_S, logs
    else:
        assert [r.returncode for r in runs] == [0, 0], logs


@pytest.mark.one_end  # the launcher supervising children that import no jax: no release changes it
def test_launch_local_stops_the_others_when_one_dies(tmp_path):
    code = FAIL_ONE.format(ready=str(tmp_path / "ready"), failure="os.kill(os.getpid(), signal.SIGKILL)")
    runs = launch_local(["-c", code], 2, timeout_s=LAUNCH_TIMEOUT_S)
    assert runs[1].returncode == -9 and runs[1].ended == "killed by SIGKILL" and runs[1].stopped == ""
    # SIGTERM first, then SIGKILL: process 0 ignores SIGTERM.
    assert runs[0].returncode is None, runs[0]
    assert runs[0].stopped == "process 1 failed first (killed by SIGKILL)", runs[0]
    assert exit_status(runs) == 128 + 9


@pytest.mark.one_end  # the launcher supervising children that import no jax: no release changes it
def test_the_launch_command_names_the_failed_process_and_exits_with_its_status(tmp_path):
    code = FAIL_ONE.format(ready=str(tmp_path / "ready"), failure="sys.exit(3)")
    command = [sys.executable, "-m", "rollout.launch", "-n", "2", "--timeout", str(LAUNCH_TIMEOUT_S), "--", "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S + 60)
    assert done.returncode == 3, done
    assert "process 1: exit status 3" in done.stderr, done.stderr
    assert "process 0: stopped: process 1 failed first (exit status 3)" in done.stderr, done.stderr
    # Each process's output, under its heading.
    assert "--- process 0 (stopped: process 1 failed first (exit status 3)) ---\nprocess 0 waits\n" in done.stdout, (
        done.stdout
    )
    assert "--- process 1 (exit status 3) ---\n" in done.stdout, done.stdout


# Each process says it waits, writes its pid where the test finds it (whole, by a rename), then
# waits for ever.
WAIT_FOREVER = """
import os, pathlib, threading
print("process", os.environ["JAX_PROCESS_ID"], "waits", flush=True)
staged = pathlib.Path({pids!r}, os.environ["JAX_PROCESS_ID"] + ".tmp")
staged.write_text(str(os.getpid()))
os.replace(staged, staged.with_suffix(""))
threading.Event().wait()
"""


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone (or a zombie no one reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _within(seconds: float, condition) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(sys.platform != "linux", reason="children die with a killed launcher on Linux (prctl)")
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_stopping_the_launcher_stops_its_processes(tmp_path, stop):
    # A stopped `--local-processes N` run used to leave its processes training on their own.
    code = WAIT_FOREVER.format(pids=str(tmp_path))
    command = [sys.executable, "-m", "rollout.launch", "-n", "2", "--", "-c", code]
    launcher = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert _within(LAUNCH_TIMEOUT_S, lambda: all((tmp_path / str(i)).exists() for i in range(2)))
        pids = [int((tmp_path / str(i)).read_text()) for i in range(2)]
        launcher.send_signal(stop)
        _, stderr = launcher.communicate(timeout=LAUNCH_TIMEOUT_S)
        assert launcher.returncode == (128 + stop if stop == signal.SIGTERM else -stop), stderr
        assert _within(LAUNCH_TIMEOUT_S, lambda: all(_ended(pid) for pid in pids)), pids
        if stop == signal.SIGTERM:  # their output is not lost with the launcher
            for i in range(2):
                assert f"--- process {i}, stopped with the launcher" in stderr and f"process {i} waits" in stderr
    finally:
        launcher.kill()
        launcher.communicate()
        for file in tmp_path.glob("[0-9]"):  # none left running, should the test fail
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(file.read_text()), signal.SIGKILL)


@pytest.mark.one_end  # the launcher supervising children that import no jax: no release changes it
def test_launch_local_sets_no_time_limit_by_default(monkeypatch):
    # examples.grpo/ppo --local-processes N launch with the default: a training run must not be
    # stopped after some fixed time (it was 600 s).
    limits = []
    supervise = launch._supervise
    monkeypatch.setattr(launch, "_supervise", lambda *args: (limits.append(args[3]), supervise(*args))[1])
    runs = launch_local(["-c", "pass"], 1)
    assert limits == [math.inf] and exit_status(runs) == 0
