"""The one package that touches sglang-jax internals.

Everything version-specific about the engine lives here: how it is started in-process, where its
weights and KV cache live, how work is run on its scheduler thread, and the workarounds for the
bugs of ``sglang-jax==0.0.2`` (each listed in ``WORKAROUNDS`` with the bug it fixes and pinned
by a test in ``tests/test_engine_workarounds.py``). Nothing else in this project imports
``sgl_jax``.

Threads: the engine runs its scheduler (which owns the model, the weights and the KV cache) in
a daemon thread of the caller's process. Any work that touches weights or KV is queued with
:meth:`EngineHandle.call` and runs on that thread at the top of a loop iteration while no
request is waiting, running or half-prefilled, so it never races a forward pass; work queued
with :meth:`EngineHandle.call_at_boundary` runs there between two forwards with requests in
flight (in-flight weight swaps, ``inflight``).

Several engines: each ``EngineHandle`` can be given its own devices (``EngineOptions.devices``,
``tp_size`` of them; its mesh is exactly those). Engines may be started from any thread (start-
ups take turns, process-wide) and driven concurrently; each names itself in its threads and
errors (``EngineHandle.name``, e.g. ``engine 1 (devices 2,3)``), records its forward passes
(``busy_intervals()``), fails alone, and joins all its threads on ``close()``.

Methods that change the engine's weights or KV pool run on the scheduler thread: they are
private, and their public counterparts (``replace_weight_leaves``, ``release_weight_leaves``,
``flush_prefix_cache``, ``drop_kv_buffers``, ``rebuild_kv_buffers``, ...) go through
:meth:`EngineHandle.call` themselves, so they may be called from any thread.
:meth:`EngineHandle.inject_failure` makes an engine fail as an engine bug would (tests, drills).

Modules: ``workarounds`` (the registry ``WORKAROUNDS`` and its switches; imports nothing),
``patches`` (the 0.0.2 patches themselves), ``start_up`` (one start-up at a time, and which
engine is being built), ``runtime`` (the engine's threads), ``handle`` (``EngineHandle``:
start-up, facts, calls, close), ``state`` (its weights and KV pool), ``requests`` (its request
loop), ``inflight`` (weight swaps with requests running), ``profile`` (where steps spend
their time), ``types`` (options, leaf specs, errors; no sgl_jax import).
"""

from .handle import EngineHandle
from .inflight import SwapRecord
from .patches import engine_version, install_workarounds
from .profile import Step, StepSplit, StepTimes, profile_steps
from .types import (
    DEFAULT_WATCHDOG_TIMEOUT_S,
    SUPPORTED_ENGINE_VERSION,
    EngineError,
    EngineOptions,
    ForwardMemory,
    GenerateOutput,
    LeafSpec,
    UnsupportedEngineVersion,
    device_buffers,
    device_nbytes,
)
from .workarounds import DISABLE_ENV, WORKAROUNDS, disabled_workarounds, workaround_enabled

__all__ = [
    "DEFAULT_WATCHDOG_TIMEOUT_S",
    "DISABLE_ENV",
    "SUPPORTED_ENGINE_VERSION",
    "WORKAROUNDS",
    "EngineError",
    "EngineHandle",
    "EngineOptions",
    "ForwardMemory",
    "GenerateOutput",
    "LeafSpec",
    "Step",
    "StepSplit",
    "StepTimes",
    "SwapRecord",
    "UnsupportedEngineVersion",
    "device_buffers",
    "device_nbytes",
    "disabled_workarounds",
    "engine_version",
    "install_workarounds",
    "profile_steps",
    "workaround_enabled",
]
