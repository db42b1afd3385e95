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

from .handle import open_engines
from .patches import install_workarounds, leave_token_logprobs, left_token_logprobs, logprobs_requested


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
def _steps_replaced(replace):
    """Every engine's ``ModelRunner.forward``, ``ModelRunner.sample`` and decode chunk
    (``multistep.run_chunk``) replaced until exit by the three that ``replace(forward, sample,
    run_chunk)`` makes from the ones in place."""
    install_workarounds()
    from sgl_jax.srt.model_executor.model_runner import ModelRunner

    from . import multistep

    with _profile_lock:
        originals = ModelRunner.forward, ModelRunner.sample, multistep.run_chunk
        ModelRunner.forward, ModelRunner.sample, multistep.run_chunk = replace(*originals)
        try:
            yield
        finally:
            ModelRunner.forward, ModelRunner.sample, multistep.run_chunk = originals


@contextlib.contextmanager
def profile_steps():
    """Yield a :class:`StepTimes` filled by every forward and sampling step until exit."""
    times = StepTimes()
    steps = threading.local()  # each engine's scheduler thread: its step in progress

    def timed(forward, sample, run_chunk):
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

        def timed_chunk(worker, mwb, metadata, plan, *args):
            step = Step("decode", time.perf_counter(), steps=int(plan.steps))
            times.steps.append(step)
            out = run_chunk(worker, mwb, metadata, plan, *args)
            jax.block_until_ready(out[0])
            step.forward_s = time.perf_counter() - step.start
            return out

        return timed_forward, timed_sample, timed_chunk

    with _steps_replaced(timed):
        yield times


@contextlib.contextmanager
def stubbed_device():
    """While open, every engine in this process takes its decode steps' device outputs from the
    first call of the same shape: a decode forward returns the logits its first forward of that
    batch width computed, the sampler that forward's sampled ids (and log-probs), and a decode
    chunk its first chunk's of that width and length, none of them running. What a decode step
    then costs is the host's work around the device's: the scheduler's Python, the batch's
    metadata built and put on the device, the sampled ids read. A lower bound on the host's
    share of a step, the part no faster chip removes: the calls stubbed are not dispatched
    either (a one-step forward's and sampler's jit dispatch, a chunk's batch, plan and loop
    dispatch), and the ids read are the same arrays each step.

    Prefills run as usual. For benchmarks only: the sampled ids repeat, and the KV of decoded
    tokens is not written although the prefix cache keeps their prefixes, so at exit every
    engine's prefix cache is flushed (once idle): a later prompt that extends a completion made
    here is prefilled, not served stale KV. Process-wide; open it outside
    :func:`profile_steps`, whose timing wrappers would otherwise see only each shape's first
    call."""
    outputs: dict = {}
    decoding = threading.local()  # the scheduler thread's step: whether its forward was stubbed

    def first_of_shape(key, compute):
        """``compute()``'s output the first time ``key`` is seen (with its compiles), then the
        same output (and none)."""
        if key in outputs:
            return outputs[key], 0
        out, misses = compute()
        outputs[key] = jax.block_until_ready(out)
        return out, misses

    def stubbed(forward, sample, run_chunk):
        def stub_forward(self, forward_batch, *args, **kwargs):
            decoding.active = forward_batch.forward_mode.is_decode()
            if not decoding.active:
                return forward(self, forward_batch, *args, **kwargs)
            key = ("forward", id(self), forward_batch.input_ids.shape)
            return first_of_shape(key, lambda: forward(self, forward_batch, *args, **kwargs))

        def stub_sample(self, logits_output, *args, **kwargs):
            if not getattr(decoding, "active", False):
                return sample(self, logits_output, *args, **kwargs)
            # The log-probs the scheduler asked for are left on the runner (patches.py): kept
            # with the ids and left there again.
            fetch = logprobs_requested(self)
            key = ("sample", id(self), logits_output.next_token_logits.shape, fetch)

            def first():
                ids = sample(self, logits_output, *args, **kwargs)
                return (ids, left_token_logprobs(self)), 0

            (ids, token_logprobs), _ = first_of_shape(key, first)
            if fetch:
                leave_token_logprobs(self, token_logprobs)
            return ids

        def stub_chunk(worker, mwb, metadata, plan, max_steps, *args):
            key = ("chunk", id(worker), len(mwb.seq_lens), int(plan.steps), max_steps)
            return first_of_shape(key, lambda: run_chunk(worker, mwb, metadata, plan, max_steps, *args))

        return stub_forward, stub_sample, stub_chunk

    try:
        with _steps_replaced(stubbed):
            yield
    finally:
        for engine in open_engines():
            if engine.alive:  # a stopped engine has no cache to serve from
                engine.testing.flush_prefix_cache()
