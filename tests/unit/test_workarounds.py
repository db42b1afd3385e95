"""rollout/engine/workarounds.py: the registry of sglang-jax 0.0.2 workarounds, each with a pinning
test (tests/helpers.py PINNING_TESTS; tests/test_engine_workarounds.py runs each with its
workaround disabled), and ROLLOUT_DISABLE_WORKAROUNDS."""

import pytest

from rollout.engine import workarounds
from tests.helpers import NOT_SWITCHABLE, PINNING_TESTS, REPO


def test_every_workaround_has_a_pinning_test():
    assert sorted(PINNING_TESTS) == sorted(workarounds.WORKAROUNDS), "each workaround needs a pinning test"
    assert set(NOT_SWITCHABLE) <= set(PINNING_TESTS)
    for node in PINNING_TESTS.values():
        file, name = node.split("::")
        assert f"def {name.split('[')[0]}(" in (REPO / file).read_text(), f"{node} does not exist"


def test_unknown_disabled_workaround_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(workarounds.DISABLE_ENV, "flush-cache, no-such-fix")
    with pytest.raises(
        ValueError, match=r"ROLLOUT_DISABLE_WORKAROUNDS names unknown workaround\(s\) \['no-such-fix'\]"
    ):
        workarounds.disabled_workarounds()
    monkeypatch.setenv(workarounds.DISABLE_ENV, "flush-cache, sampler")
    assert workarounds.disabled_workarounds() == {"flush-cache", "sampler"}
    assert not workarounds.workaround_enabled("flush-cache") and workarounds.workaround_enabled("idle-busy-spin")
