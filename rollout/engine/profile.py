"""Where an engine's steps spend their time: the model forward, the sampler, and the host.

``profile_steps()`` times every engine's ``ModelRunner.forward`` and ``ModelRunner.sample`` in
this process while it is open, each until its outputs are ready, by forward mode (``decode``,
``extend``), and each step's wall time (from its forward's start to the next forward's start,
all the scheduler's host work included). A decode chunk (``EngineOptions.decode_steps``) is one
entry of its steps' count: its loop's forwards and sampling together as ``forward_s``, and its
wall time until the next dispatch (chunks being dispatched ahead, that covers the scheduler's
steps of the chunk before it: over a call the means are per step); waited for as it starts, so
that a profile serializes the chunks the engine overlaps with its host work. The engine already
waits for the sampled ids at the end of each step, so waiting for the forward's outputs too
hides no work: the host's share of a step is what remains of its wall time. Process-wide, for
one engine at a time (several engines' steps would interleave), and meant for benchmarks
(``bench.generate_bench``), not for serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import jax

from .patches import install_workarounds


@dataclasses.dataclass
class Step:
    mode: str  # "decode" or "extend"
    start: float  # perf_counter at its forward's start
    forward_s: float = 0.0
    sample_s: float = 0.0
    steps: int = 1  # decode steps it ran (a decode chunk's count)


@dataclasses.dataclass(frozen=True)
class StepSplit:
    """Mean seconds per step of one mode, over the same steps for every part."""

    steps: int
    wall_s: float
    forward_s: float
    sample_s: float

    @property
    def host_s(self) -> float:
        return self.wall_s - self.forward_s - self.sample_s


@dataclasses.dataclass
class StepTimes:
    """Every step seen, in order."""

    steps: list[Step] = dataclasses.field(default_factory=list)

    def count(self, mode: str) -> int:
        return sum(step.mode == mode for step in self.steps)

    def split(self, mode: str) -> StepSplit | None:
        """Means over the ``mode`` steps followed by another step (a step's wall time ends at the
        next forward's start; the last step has none), or None if there is no such step."""
        timed = [(a, b.start - a.start) for a, b in zip(self.steps, self.steps[1:]) if a.mode == mode]
        if not timed:
            return None
        n = sum(step.steps for step, _ in timed)
        return StepSplit(
            steps=n,
            wall_s=sum(wall for _, wall in timed) / n,
            forward_s=sum(step.forward_s for step, _ in timed) / n,
            sample_s=sum(step.sample_s for step, _ in timed) / n,
        )


_profile_lock = threading.RLock()  # nested profiles on one thread wrap each other


@contextlib.contextmanager
def profile_steps():
    """Yield a :class:`StepTimes` filled by every forward and sampling step until exit."""
    install_workarounds()
    from sgl_jax.srt.model_executor.model_runner import ModelRunner

    from . import multistep

    times = StepTimes()
    with _profile_lock:
        forward, sample = ModelRunner.forward, ModelRunner.sample
        steps = threading.local()  # each engine's scheduler thread: its step in progress

        def timed_forward(self, forward_batch, *args, **kwargs):
            mode = "decode" if forward_batch.forward_mode.is_decode() else "extend"
            steps.current = step = Step(mode, time.perf_counter())
            times.steps.append(step)
            out = jax.block_until_ready(forward(self, forward_batch, *args, **kwargs))
            step.forward_s = time.perf_counter() - step.start
            return out

        def timed_sample(self, *args, **kwargs):
            start = time.perf_counter()
            out = jax.block_until_ready(sample(self, *args, **kwargs))
            step = getattr(steps, "current", None)
            if step is not None:
                step.sample_s += time.perf_counter() - start
            return out

        run_chunk = multistep.run_chunk

        def timed_chunk(worker, mwb, metadata, plan, max_steps):
            step = Step("decode", time.perf_counter(), steps=plan[0])
            times.steps.append(step)
            out = run_chunk(worker, mwb, metadata, plan, max_steps)
            jax.block_until_ready(out[0])
            step.forward_s = time.perf_counter() - step.start
            return out

        ModelRunner.forward, ModelRunner.sample = timed_forward, timed_sample
        multistep.run_chunk = timed_chunk
        try:
            yield times
        finally:
            ModelRunner.forward, ModelRunner.sample = forward, sample
            multistep.run_chunk = run_chunk
