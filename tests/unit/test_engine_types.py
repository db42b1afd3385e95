"""rollout/engine/types.py: EngineOptions checks its devices."""

import jax
import pytest

from tests.helpers import tiny_options


def test_devices_must_match_tp_size_and_be_distinct(qwen2_dir):
    devices = jax.devices()
    with pytest.raises(ValueError, match="has 2 devices .* but tp_size is 1"):
        tiny_options(qwen2_dir, devices[:2], tp_size=1)
    with pytest.raises(ValueError, match="lists a device twice: 1,1"):
        tiny_options(qwen2_dir, (devices[1], devices[1]))
    with pytest.raises(ValueError, match="non-empty sequence of jax.Device"):
        tiny_options(qwen2_dir, (0, 1), tp_size=2)
