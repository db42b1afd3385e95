"""One process of the small jobs in ``tests/test_pod_leave.py``: join, optionally lose the last
process, then ``rollout.launch.leave``. No engines: a job starts in seconds.

Usage: python -m tests.pod_leave_program OUT_DIR MODE [CODE]. MODE ``clean``: every process leaves;
``lost``: the last process is SIGKILLed after a roll call, the others get the PodError naming it,
then leave. Writes OUT_DIR/<process>.json just before leaving; leaves with exit status CODE (0).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from rollout import PodError  # noqa: E402
from rollout.launch import join, leave  # noqa: E402
from rollout.pod import Pod  # noqa: E402

# JAX terminates the survivors this long after the lost process's last heartbeat, whatever they
# do: far longer than the loss check below and leave() take on a loaded machine.
HEARTBEAT_TIMEOUT_S = 120
# Generous for the first roll call (processes start seconds apart on a loaded machine), short
# for the one that names the lost process.
START_TIMEOUT_S = 120.0
LOSS_TIMEOUT_S = 5.0


def main(out_dir: str, mode: str, code: int = 0) -> None:
    join(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    me, last = jax.process_index(), jax.process_count() - 1
    pod = Pod.current(START_TIMEOUT_S)
    pod.agree("start")
    result: dict = {}
    if mode == "lost":
        if me == last:
            os.kill(os.getpid(), signal.SIGKILL)
        pod.timeout_s = LOSS_TIMEOUT_S
        try:
            pod.agree("after the loss")
        except PodError as exc:
            result["lost"] = list(exc.processes)
    result["leaving_at"] = time.monotonic()  # CLOCK_MONOTONIC: the test compares it with its own
    (Path(out_dir) / f"{me}.json").write_text(json.dumps(result))
    leave(code)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:4]))
