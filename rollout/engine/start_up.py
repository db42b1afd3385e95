"""Engine start-up, one at a time process-wide: which engine is being built (read by the
patched engine code and by the engine's own threads while they register)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import jax


@dataclasses.dataclass
class StartUp:
    """The engine being started: read by the patched engine code during its start-up."""

    name: str
    devices: tuple[jax.Device, ...] | None
    # Adapters the engine's projections compute unmerged (rollout/engine/lora.py), or None.
    unmerged_lora: Any = None
    max_loras: int = 1  # adapter slots of an unmerged engine
    control: Any = None  # its runtime.SchedulerControl, once its scheduler exists
    # zmq sockets the engine opened in the caller's thread: a failed start-up closes them.
    sockets: list = dataclasses.field(default_factory=list)

    def close_sockets(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(Exception):
                sock.close(linger=0)


_start_up_lock = threading.Lock()
_start_up: StartUp | None = None


def current_start_up() -> StartUp | None:
    return _start_up


@contextlib.contextmanager
def engine_start_up(name: str, devices: tuple[jax.Device, ...] | None, unmerged_lora=None, max_loras: int = 1):
    """Start one engine at a time, process-wide.

    Start-up changes process state that is restored afterwards and reads caches that it
    mutates (see WORKAROUNDS "concurrent-start-up"); the patched engine code reads which
    engine it is building (its devices, its name) from here, the engine's own threads
    included, so the lock is held until they have registered.
    """
    global _start_up
    with _start_up_lock:
        _start_up = StartUp(name, devices, unmerged_lora, max_loras)
        try:
            with default_device(devices):
                yield _start_up
        finally:
            _start_up = None


def default_device(devices):
    """Arrays the engine creates without a sharding (rng state, ...) land on its first device."""
    return jax.default_device(devices[0]) if devices else contextlib.nullcontext()
