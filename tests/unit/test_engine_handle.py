"""rollout/engine/handle.py: the platform choices made when a config leaves them open."""

import pytest

from rollout.engine.handle import default_attention_backend


@pytest.mark.parametrize(
    ("device", "backend"), [("tpu", "fa"), ("gpu", "native"), ("cuda", "native"), ("cpu", "native")]
)
def test_attention_backend_is_chosen_by_platform(device, backend):
    assert default_attention_backend(device) == backend
