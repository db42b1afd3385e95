"""XLA's time per operation in a stretch of a process, read from a JAX profiler trace.

    with traced_ops() as ops:
        ...  # the calls to profile
    for name, self_s, count in ops.top(15):
        ...

``jax.profiler`` traces the stretch (Python tracer off) and writes it as a Perfetto JSON trace as
well, which is read here, so nothing beyond jax is needed (no xprof, no TensorBoard). Only the
threads that run compiled programs are read (XLA's, named ``tf_XLA...``): there every complete
event is an operation (a fusion, a dot, a while loop, a conditional: its HLO name) or the thunk
executor's own work between them (``ThunkExecutor::Execute``); the host's dispatches and waits
are on the Python threads (``rollout.engine.stubbed_device`` measures the host's share). Events
nest: a while loop's body runs inside it and the operations inside the executor, so each is
given its self time, its duration less its children's; events that wait (named so) are idle
time and left out. An HLO name is unique within its program only: profile one program's steady
state (a decode step) and read the names against its optimized HLO
(``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``).
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


# The threads of XLA's CPU client that run compiled programs (its execute and compute pools).
XLA_THREADS = "tf_XLA"


def self_times(events: list[dict], thread_prefix: str = XLA_THREADS) -> OpTimes:
    """The self time of each complete event (``"ph": "X"``, microseconds) of a Chrome/Perfetto
    trace on the threads whose name starts with ``thread_prefix``, summed by name: an event's
    duration less that of the events nested in it on its thread. Waits are left out."""
    thread_names = {
        (e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    by_thread = collections.defaultdict(list)
    for event in events:
        thread = event.get("pid"), event.get("tid")
        if event.get("ph") == "X" and "dur" in event and thread_names.get(thread, "").startswith(thread_prefix):
            by_thread[thread].append(event)
    self_us: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_events: list[dict] = []  # the enclosing events of the one being read, outermost first
        for event in thread_events:
            while open_events and open_events[-1]["ts"] + open_events[-1]["dur"] <= event["ts"]:
                open_events.pop()
            if open_events:
                self_us[open_events[-1]["name"]] -= event["dur"]
            self_us[event["name"]] += event["dur"]
            counts[event["name"]] += 1
            open_events.append(event)
    busy = {name: us / 1e6 for name, us in self_us.items() if "wait" not in name.lower()}
    return OpTimes(busy, {name: counts[name] for name in busy})


@contextlib.contextmanager
def traced_ops():
    """Trace the block with ``jax.profiler``; the yielded :class:`OpTimes` is filled at its end."""
    ops = OpTimes()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # the runtime's and XLA's events only
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir, create_perfetto_trace=True, profiler_options=options)
        try:
            yield ops
        finally:
            jax.profiler.stop_trace()
        (trace_file,) = Path(log_dir).rglob("perfetto_trace.json.gz")
        with gzip.open(trace_file) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    filled = self_times(events)
    ops.self_s, ops.counts = filled.self_s, filled.counts
