"""rollout/engine/profile.py: the split of an engine's profiled steps."""

import pytest

from rollout.engine import Step, StepTimes


def test_step_split_takes_every_part_over_the_same_steps():
    """A step's wall time ends at the next forward's start, so the last step has none: its
    forward and sampler must be left out of the means too (the prefill-heavy split once
    reported a negative host time)."""
    times = StepTimes([Step("extend", 0.0, 0.5, 0.1), Step("extend", 1.0, 0.9, 0.1), Step("decode", 2.0, 0.2, 0.1)])
    extend = times.split("extend")
    assert (extend.steps, extend.wall_s) == (2, 1.0)
    assert extend.forward_s == pytest.approx(0.7) and extend.host_s == pytest.approx(0.2)
    assert times.split("decode") is None and times.count("decode") == 1
