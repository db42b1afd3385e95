"""The one package that touches sglang-jax internals.

Everything version-specific about the engine lives here: how it is started in-process, where its
weights and KV cache live, how work is run on its scheduler thread, and the workarounds for the
bugs of ``sglang-jax==0.0.2`` (each listed in ``WORKAROUNDS`` with the bug it fixes and pinned
by a test listed in ``PINNING_TESTS``, ``tests/helpers.py``). Nothing else in this project imports
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

An ``EngineHandle`` is made of parts, each handed what it uses: its model state
(``state.ModelState``: weights and KV pool, whose changes must run on the scheduler thread) and
its request loop (``requests.RequestLoop``). The handle's methods that change weights or KV
(``replace_weight_leaves``, ``release_weight_leaves``, ``drop_kv_buffers``,
``rebuild_kv_buffers``, ...) run the model state's through :meth:`EngineHandle.call`, so they
may be called from any thread. Test hooks are apart, in ``EngineHandle.testing``
(``testing.EngineTesting``): ``inject_failure`` makes an engine fail as an engine bug would.

Modules: each is named, with what it holds, in docs/design.md ("Layout"). The supported
sglang-jax release is ``rollout.versions.ENGINE``.
"""

from .buffers import device_buffers, device_nbytes
from .handle import EngineHandle, interrupts_deferred
from .inflight import SwapRecord
from .lora import in_slot
from .multistep import DecodeChunkStats
from .patches import engine_version, install_workarounds
from .profile import Step, StepSplit, StepTimes, profile_steps, stubbed_device
from .sessions import SessionStats
from .tpu_interpret import tpu_interpret_mode
from .types import (
    DEFAULT_WATCHDOG_TIMEOUT_S,
    EngineError,
    EngineOptions,
    ForwardMemory,
    GenerateOutput,
)
from .workarounds import DISABLE_ENV, WORKAROUNDS, disabled_workarounds, workaround_enabled

__all__ = [
    "DEFAULT_WATCHDOG_TIMEOUT_S",
    "DISABLE_ENV",
    "DecodeChunkStats",
    "WORKAROUNDS",
    "EngineError",
    "EngineHandle",
    "SessionStats",
    "EngineOptions",
    "ForwardMemory",
    "GenerateOutput",
    "Step",
    "StepSplit",
    "StepTimes",
    "SwapRecord",
    "device_buffers",
    "device_nbytes",
    "disabled_workarounds",
    "engine_version",
    "interrupts_deferred",
    "in_slot",
    "install_workarounds",
    "profile_steps",
    "stubbed_device",
    "tpu_interpret_mode",
    "workaround_enabled",
]
