"""Weights rewritten in place must be read as what they now hold: an XLA bug, its flag and a probe.

An RL loop rewrites the policy's buffers in place: the train step donates the params, so the new
params live at the addresses of the old ones, and the engine serves those very buffers (zero-copy
sync), as does the trainer's own jitted forward. XLA's CPU backend in jaxlib 0.8 runs large
enough f32 dots through XNNPACK, which packs a dot's weight operand once and reuses the packed
copy while the operand's address stays the same: after a donated update every compiled function
that had packed the old values goes on computing with them. Seen: the engine's log-probs drift
from the trainer's from the second train step on (max |Δ log p| 0.30 at the second GRPO step of
the tiny demo, 0.99 at the fifth), and the trainer's own jitted log-probs are just as stale. No error, no
recompile; a fresh copy of the same values is read correctly. Seen on an AVX2-only AMD EPYC, not on
an Intel Xeon with AVX-512 and AMX: the flag goes on for every CPU of the affected releases, and the
probe decides whether a process without it may serve.

:func:`disable_xnnpack_dots` adds ``--xla_cpu_use_xnnpack=false`` to ``XLA_FLAGS`` for the
affected jaxlib releases; ``import rollout`` calls it, and XLA reads its flags once, when JAX
creates its CPU backend. A process that created the backend before importing ``rollout`` keeps
the bug, so :func:`check_in_place_updates` runs a donated update and a dot on the worker's
platform and refuses to serve where the dot reads the old values. The XLA flag only touches the
CPU backend; the probe runs on whatever platform the worker uses.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os

from .engine.workarounds import workaround_enabled
from .errors import PlatformError
from .versions import installed_version

logger = logging.getLogger(__name__)

WORKAROUND = "xla-stale-packed-weights"
XNNPACK_OFF = "--xla_cpu_use_xnnpack=false"
# jaxlib releases whose XLA:CPU reads stale packed weights (tests/test_in_place_updates.py
# measures the bug in a process without the flag).
AFFECTED_JAXLIB = ">=0.8.0,<0.8.2"


def jaxlib_affected(version: str | None = None) -> bool:
    from packaging.specifiers import SpecifierSet

    version = version or installed_version("jaxlib")
    return version is not None and SpecifierSet(AFFECTED_JAXLIB).contains(version, prereleases=True)


def disable_xnnpack_dots() -> bool:
    """Add :data:`XNNPACK_OFF` to ``XLA_FLAGS`` on an affected jaxlib, unless the flags already
    say what to do with XNNPACK (an explicit choice is left alone; the probe judges it).
    Returns whether the flag was added. Takes effect only if JAX has not created its CPU
    backend yet."""
    flags = os.environ.get("XLA_FLAGS", "")
    if not workaround_enabled(WORKAROUND) or not jaxlib_affected() or "xla_cpu_use_xnnpack" in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {XNNPACK_OFF}".strip()
    return True


def check_in_place_updates(platform: str) -> None:
    """Raise :class:`PlatformError` if ``platform`` reads a weight rewritten in place (donated)
    as its old values."""
    if reads_stale_weights(platform):
        raise PlatformError(
            f"XLA on {platform} reads weights rewritten in place as their old values (jaxlib "
            f"{installed_version('jaxlib')}: XNNPACK's packed weights are reused while the buffer's "
            "address stays the same, and a train step that donates its params keeps the addresses): "
            "the engine would not serve the trainer's params, nor would the trainer's own jitted "
            f"functions see them. Set XLA_FLAGS={XNNPACK_OFF} before JAX creates its CPU backend "
            "(importing rollout before the first JAX computation does it)"
        )


@functools.cache
def reads_stale_weights(platform: str) -> bool:
    """Whether a jitted dot on ``platform`` still computes with a weight's old values after a
    donated update wrote new ones at the same address. Runs on a thread of its own (as the
    attention probes do): the caller may be tracing under a mesh."""
    import jax

    device = jax.local_devices(backend=platform)[0]
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        stale, same_address = pool.submit(_dot_after_donated_update, device).result()
    if not same_address:
        logger.info("%s did not update a donated weight in place: nothing for the stale-weights probe to see", platform)
    return stale


def _dot_after_donated_update(device) -> tuple[bool, bool]:
    import jax
    import numpy as np

    # 64 rows against a 512 x 512 weight: XLA:CPU 0.8 packs the weights of dots this size
    # (seen: 64 x 512 against 512 x 256 or 1024 x 1024; not 8 rows, nor a contraction of 256).
    x = jax.device_put(jax.random.normal(jax.random.key(0), (64, 512)), device)
    weight = jax.device_put(jax.random.normal(jax.random.key(1), (512, 512)), device)
    dot = jax.jit(lambda x, w: x @ w)
    before = np.asarray(dot(x, weight))
    address = weight.unsafe_buffer_pointer()
    # Doubling is exact, so the dot of the new weight is exactly twice the old one's.
    weight = jax.jit(lambda w: w * 2.0, donate_argnums=0)(weight)
    after = np.asarray(dot(x, weight))
    return not np.allclose(after, 2.0 * before, rtol=1e-5, atol=1e-5), weight.unsafe_buffer_pointer() == address
