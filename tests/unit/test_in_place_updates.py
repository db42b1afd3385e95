"""rollout/in_place_updates.py: the XLA CPU stale-weights probe, the flag that avoids it, the
affected releases and its error."""

import os

import jax

from rollout import PlatformError
from rollout.engine import workarounds
from rollout.in_place_updates import XNNPACK_OFF, jaxlib_affected, reads_stale_weights


def test_the_probe_reads_the_updated_weights_here():
    """In this process (rollout imported first, as the suite does) the probe finds no stale read."""
    assert not reads_stale_weights(jax.devices()[0].platform)


def test_the_flag_is_added_once_and_an_explicit_choice_is_kept(monkeypatch):
    from rollout.in_place_updates import disable_xnnpack_dots

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    monkeypatch.delenv(workarounds.DISABLE_ENV, raising=False)
    added = disable_xnnpack_dots()
    assert added == jaxlib_affected()
    expected = "--xla_force_host_platform_device_count=4" + (f" {XNNPACK_OFF}" if added else "")
    assert os.environ["XLA_FLAGS"] == expected
    assert not disable_xnnpack_dots() and os.environ["XLA_FLAGS"] == expected
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_xnnpack=true")
    assert not disable_xnnpack_dots() and os.environ["XLA_FLAGS"] == "--xla_cpu_use_xnnpack=true"


def test_affected_releases():
    assert jaxlib_affected("0.8.0") and jaxlib_affected("0.8.1")
    assert not jaxlib_affected("0.7.2") and not jaxlib_affected("0.8.2") and not jaxlib_affected("0.12.0.1")


def test_platform_error_is_a_rollout_error():
    from rollout import RolloutError

    assert issubclass(PlatformError, RolloutError) and issubclass(PlatformError, RuntimeError)
