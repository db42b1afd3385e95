"""The phase log: one JSON line per lifecycle phase with its duration and a memory summary."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable


class PhaseLog:
    def __init__(self, path: str | None, memory: Callable):
        self._path = path
        self._memory = memory
        self._lock = threading.Lock()

    def record(self, phase: str, seconds: float, **details) -> None:
        if self._path is None:
            return
        memory = self._memory()
        record = {
            "phase": phase,
            "seconds": round(seconds, 6),
            "time": time.time(),
            **details,
            "weight_bytes": memory.weight_bytes,
            "kv_bytes": memory.kv_bytes,
            "live_bytes": sum(memory.live_bytes_per_device.values()),
            "live_bytes_per_device": memory.live_bytes_per_device,
        }
        with self._lock, open(self._path, "a", encoding="utf-8") as log:
            log.write(json.dumps(record) + "\n")
