"""Where an engine's steps spend their time: the model forward, the sampler, and the host.

``profile_steps()`` times every engine's ``ModelRunner.forward`` and ``ModelRunner.sample`` in
this process while it is open, each until its outputs are ready, by forward mode (``decode``,
``extend``), and each step's wall time (from its forward's start to the next forward's start,
all the scheduler's host work included). The engine already waits for the sampled ids at the
end of each step, so waiting for the forward's outputs too hides no work: the host's share of a
step is what remains of its wall time. Process-wide and meant for benchmarks (``bench.generate_bench``), not for serving.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time

import jax

from .patches import install_workarounds


@dataclasses.dataclass
class StepTimes:
    """Seconds and counts per forward mode, summed over the steps seen."""

    forward_s: dict[str, float] = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
    sample_s: dict[str, float] = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
    steps: dict[str, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
    # (mode, forward start) of every step in order, for the wall times
    starts: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    def mean_step_s(self, mode: str) -> float:
        """Mean wall seconds of the ``mode`` steps followed by another step (NaN if none)."""
        walls = [b[1] - a[1] for a, b in zip(self.starts, self.starts[1:]) if a[0] == mode]
        return sum(walls) / len(walls) if walls else float("nan")


_profile_lock = threading.RLock()  # nested profiles on one thread wrap each other


@contextlib.contextmanager
def profile_steps():
    """Yield a :class:`StepTimes` filled by every forward and sampling step until exit."""
    install_workarounds()
    from sgl_jax.srt.model_executor.model_runner import ModelRunner

    times = StepTimes()
    with _profile_lock:
        forward, sample = ModelRunner.forward, ModelRunner.sample
        modes = threading.local()

        def timed_forward(self, forward_batch, *args, **kwargs):
            modes.current = "decode" if forward_batch.forward_mode.is_decode() else "extend"
            start = time.perf_counter()
            times.starts.append((modes.current, start))
            out = jax.block_until_ready(forward(self, forward_batch, *args, **kwargs))
            times.forward_s[modes.current] += time.perf_counter() - start
            times.steps[modes.current] += 1
            return out

        def timed_sample(self, *args, **kwargs):
            start = time.perf_counter()
            out = jax.block_until_ready(sample(self, *args, **kwargs))
            times.sample_s[getattr(modes, "current", "decode")] += time.perf_counter() - start
            return out

        ModelRunner.forward, ModelRunner.sample = timed_forward, timed_sample
        try:
            yield times
        finally:
            ModelRunner.forward, ModelRunner.sample = forward, sample
