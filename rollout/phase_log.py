"""The phase log: one JSON line per lifecycle phase with its duration and a memory summary."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class PhaseLog:
    """Appends to ``path`` (None: records nothing). A record that cannot be written is logged,
    not raised: it comes after the phase's change, which stands (a sync's weights serve), and a
    caller told otherwise would retry a change that was made or lose a generated batch."""

    def __init__(self, path: str | None, memory: Callable):
        self._path = path
        self._memory = memory
        self._lock = threading.Lock()
        self._failing = False  # the last write failed: the next failure is not logged again

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
        with self._lock:
            try:
                self._append((json.dumps(record) + "\n").encode())
            except OSError as exc:
                if not self._failing:
                    logger.error(
                        "phase log %s: cannot write the %r record (%s); phases go unrecorded", self._path, phase, exc
                    )
                self._failing = True
                return
            if self._failing:
                logger.warning("phase log %s: writing again from the %r record", self._path, phase)
            self._failing = False

    def _append(self, line: bytes) -> None:
        """Appends ``line`` whole or not at all: a write cut short (a full disk) is taken back,
        so that the next record does not continue a broken line. (The file is this worker's: a
        record another process appended meanwhile would be cut with it.)"""
        with open(self._path, "ab", buffering=0) as log:
            start = log.seek(0, os.SEEK_END)
            try:
                written = 0
                while written < len(line):
                    written += log.write(line[written:])
            except OSError:
                with contextlib.suppress(OSError):
                    log.truncate(start)
                raise
