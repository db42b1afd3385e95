"""KV cache lifecycle and device-memory accounting, per engine."""

from __future__ import annotations

import dataclasses
import time

import jax

from .engine import EngineHandle, device_buffers, device_nbytes


@dataclasses.dataclass(frozen=True)
class KvReport:
    """What a KV cache drop freed or a rebuild allocated (summed over the worker's engines)."""

    bytes: int  # device bytes of the pools' own buffers, summed over devices and layers
    buffers: int
    seconds: float
    # Live device bytes released beyond the pools' buffers: on backends without buffer
    # donation (CPU) the previous step's KV arrays can still be alive until the drop.
    transient_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """One engine's device memory, counting only its own buffers."""

    devices: tuple[str, ...]
    weight_bytes: int  # its weight leaves (aliased trainer buffers included), summed over devices
    kv_bytes: int  # its KV cache buffers (0 while dropped)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    weight_bytes: int  # all engines' weight leaves, summed over devices (shared buffers once)
    kv_bytes: int  # all engines' KV caches
    live_bytes_per_device: dict[str, int]  # every live JAX array on the worker's devices
    engines: tuple[EngineMemory, ...] = ()


def live_device_buffers(devices=None) -> dict[tuple[int, int], int]:
    """Device buffers of all live JAX arrays: (device id, address) -> bytes, optionally only
    on ``devices``.

    Counted from the arrays because ``device.memory_stats()`` is unavailable on CPU. Each
    buffer counts once although several arrays may view it (an array and the single-device
    arrays of its shards, an aliased trainer leaf and the engine's relabel of it).
    """
    wanted = None if devices is None else {d.id for d in devices}
    buffers: dict[tuple[int, int], int] = {}
    for array in jax.live_arrays():
        if array.is_deleted():
            continue
        if wanted is not None and not wanted & {d.id for d in array.sharding.device_set}:
            continue
        for key, nbytes in device_buffers(array).items():
            if wanted is None or key[0] in wanted:
                buffers[key] = nbytes
    return buffers


def live_device_bytes(devices=None) -> int:
    return sum(live_device_buffers(devices).values())


def drop_kv(engine: EngineHandle) -> KvReport:
    """Free one engine's KV buffers and prefix cache (between forwards)."""
    start = time.perf_counter()
    devices = engine.devices
    live_before = live_device_bytes(devices)
    count, freed = engine.drop_kv_buffers()
    transient = max(0, live_before - live_device_bytes(devices) - freed)
    return KvReport(freed, count, time.perf_counter() - start, transient)


def free_failed_kv(engine: EngineHandle) -> KvReport:
    """Delete a failed engine's KV buffers (its thread is gone: nothing reads them again), so
    the trainer, which shares its devices, gets the memory back."""
    start = time.perf_counter()
    count, freed = engine.delete_failed_kv_buffers()
    return KvReport(freed, count, time.perf_counter() - start)


def rebuild_kv(engine: EngineHandle) -> KvReport:
    """Recreate one engine's KV buffers with their original shapes, dtype and sharding."""
    start = time.perf_counter()
    if not engine.rebuild_kv_buffers():
        return KvReport(0, 0, time.perf_counter() - start)
    buffers = engine.kv_buffers()
    jax.block_until_ready(buffers)
    return KvReport(sum(device_nbytes(b) for b in buffers), len(buffers), time.perf_counter() - start)


def combine(reports: list[KvReport], seconds: float) -> KvReport:
    return KvReport(
        sum(r.bytes for r in reports), sum(r.buffers for r in reports), seconds, sum(r.transient_bytes for r in reports)
    )


def engine_memory(engine: EngineHandle, weight_buffers: dict[tuple[int, int], int]) -> EngineMemory:
    kv = sum(device_nbytes(b) for b in engine.kv_buffers())
    return EngineMemory(tuple(str(d) for d in engine.devices), sum(weight_buffers.values()), kv)
