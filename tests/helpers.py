"""Shared test helpers."""

import contextlib
import os
import re
import subprocess
import sys
import time

import jax

from rollout import WorkerConfig


def tiny_worker_config(model_dir, **overrides) -> WorkerConfig:
    """Small engine limits that start fast on a 2-core CPU, on the first dp_size x tp_size
    of the 4 fake devices unless ``devices`` is given."""
    settings = dict(
        model_path=str(model_dir),
        dtype="float32",
        max_total_tokens=2048,
        context_length=256,
        max_running_requests=16,
        max_prefill_tokens=512,
        chunked_prefill_size=512,
    )
    settings.update(overrides)
    if "devices" not in settings:
        settings["devices"] = tuple(jax.devices()[: settings.get("dp_size", 1) * settings.get("tp_size", 1)])
    return WorkerConfig(**settings)


@contextlib.contextmanager
def serve_process(model_dir, *flags, env=None):
    """``python -m rollout.serve`` on a tiny model in a subprocess: yields (process, url) once it
    serves; killed at exit if still running."""
    command = [
        sys.executable, "-m", "rollout.serve", "--model-path", str(model_dir), "--port", "0", "--dtype", "float32",
        "--max-total-tokens", "1024", "--context-length", "256", "--max-running-requests", "4", *flags,
    ]
    env = {**os.environ, "XLA_FLAGS": "", **(env or {})}
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            assert line, "the server exited before serving"
            match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            url = match.group(1) if match else None
        assert url is not None, "the server did not start serving within 180 s"
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
