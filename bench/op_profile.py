"""XLA's time per operation in a stretch of a process, read from a JAX profiler trace.

    with traced_ops() as ops:
        ...  # the calls to profile
    for name, self_s, count in ops.top(15):
        ...

``jax.profiler`` traces the stretch (Python tracer off) and writes it as a Perfetto JSON trace as
well, which is read here, so nothing beyond jax is needed (no xprof, no TensorBoard). Two kinds of
event are read, on whichever thread ran them (XLA's pools, or the calling thread for a program
cheap enough to run inline): each operation of a compiled program (a fusion, a dot, a while loop,
a conditional), named ``<program>/<HLO name>`` from the event's ``hlo_module`` and ``hlo_op``, and
the thunk executor's own work between them (``ThunkExecutor::Execute``). The host's dispatches and
waits are left out (``rollout.engine.stubbed_device`` measures the host's share). Events nest: a
while loop's body runs inside it and the operations inside the executor, so each is given its self
time, its duration less that of the events read that it encloses. Self times are CPU time summed
over threads: with several of XLA's threads at work their sum can pass the stretch's wall time.
Read an operation against its program's optimized HLO
(``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``).

An accelerator's kernels and copies (the events of a ``/device:...`` process) are read apart:
named ``<program>/<kernel>``, each counted whole. A stream's events can overlap (a kernel starts
before the one before it ends), so nothing there is taken as enclosing anything.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gzip
import json
import tempfile
from pathlib import Path

import jax

EXECUTOR = "ThunkExecutor::Execute"
DEVICE_PROCESS = "/device:"


@dataclasses.dataclass
class OpTimes:
    """Self seconds and event counts by name; filled when the ``traced_ops`` block ends."""

    self_s: dict[str, float] = dataclasses.field(default_factory=dict)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)

    def top(self, n: int) -> list[tuple[str, float, int]]:
        """The ``n`` names of the largest self time: (name, self seconds, events)."""
        ranked = sorted(self.self_s.items(), key=lambda item: -item[1])[:n]
        return [(name, seconds, self.counts[name]) for name, seconds in ranked]

    @property
    def total_s(self) -> float:
        return sum(self.self_s.values())

    def minus(self, other: OpTimes) -> OpTimes:
        """This stretch less ``other`` (e.g. a long call less a short one: what the long one's
        extra steps cost), name by name."""
        names = self.self_s.keys() | other.self_s.keys()
        return OpTimes(
            {name: self.self_s.get(name, 0.0) - other.self_s.get(name, 0.0) for name in names},
            {name: self.counts.get(name, 0) - other.counts.get(name, 0) for name in names},
        )


def _operation(event: dict) -> str | None:
    """The name an event is counted under, or None if it is neither an operation of a compiled
    program nor the executor's own work (waits included)."""
    if event.get("ph") != "X" or "dur" not in event:
        return None
    args = event.get("args") or {}
    if "hlo_module" in args:
        return f"{args['hlo_module']}/{args.get('hlo_op', event['name'])}"
    name = event["name"]
    if name.startswith(EXECUTOR) and "wait" not in name.lower():
        return name
    return None


def self_times(events: list[dict]) -> OpTimes:
    """The self time of each operation of a Chrome/Perfetto trace's events (microseconds; see
    the module's docstring for which are read), summed by name: an event's duration less that of
    the events read that it encloses on its thread; a device's events whole."""
    devices = {
        event.get("pid")
        for event in events
        if event.get("ph") == "M"
        and event.get("name") == "process_name"
        and str((event.get("args") or {}).get("name", "")).startswith(DEVICE_PROCESS)
    }
    by_thread = collections.defaultdict(list)
    self_us: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for event in events:
        if event.get("pid") in devices:
            if event.get("ph") == "X" and "dur" in event:
                module = (event.get("args") or {}).get("hlo_module")
                name = f"{module}/{event['name']}" if module else event["name"]
                self_us[name] += event["dur"]
                counts[name] += 1
            continue
        name = _operation(event)
        if name is not None:
            by_thread[event.get("pid"), event.get("tid")].append((event["ts"], event["dur"], name))
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e[0], -e[1]))  # an enclosing event before what it encloses
        open_events: list[tuple] = []  # the events enclosing the one being read, outermost first
        for start, duration, name in thread_events:
            while open_events and open_events[-1][0] + open_events[-1][1] <= start:
                open_events.pop()
            if open_events:
                self_us[open_events[-1][2]] -= duration
            self_us[name] += duration
            counts[name] += 1
            open_events.append((start, duration, name))
    return OpTimes({name: us / 1e6 for name, us in self_us.items()}, dict(counts))


@contextlib.contextmanager
def perfetto_trace(log_dir: str | Path):
    """Trace the block with ``jax.profiler`` (the runtime's and XLA's events, no Python tracer)
    into ``log_dir``; yields a list that holds the Perfetto trace file's path when the block ends."""
    found: list[Path] = []
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(str(log_dir), create_perfetto_trace=True, profiler_options=options)
    try:
        yield found
    finally:
        jax.profiler.stop_trace()
        found.extend(Path(log_dir).rglob("perfetto_trace.json.gz"))


def trace_events(trace_file: Path) -> list[dict]:
    with gzip.open(trace_file) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


@contextlib.contextmanager
def traced_ops():
    """Trace the block with ``jax.profiler``; the yielded :class:`OpTimes` is filled at its end.
    Raises ``RuntimeError`` if the trace holds no operation of a compiled program."""
    ops = OpTimes()
    with tempfile.TemporaryDirectory() as log_dir:
        with perfetto_trace(log_dir) as found:
            yield ops
        (trace_file,) = found
        events = trace_events(trace_file)
    filled = self_times(events)
    if not any(name != EXECUTOR for name in filled.self_s):
        raise RuntimeError(f"the trace of {len(events)} events holds no operation of a compiled program")
    ops.self_s, ops.counts = filled.self_s, filled.counts
