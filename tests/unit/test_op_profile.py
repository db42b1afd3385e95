"""bench/op_profile.py: self times of a profiler trace's operations, and a real trace read back."""

import jax
import jax.numpy as jnp
import pytest

from bench.op_profile import XLA_THREADS, self_times, traced_ops


def _thread(tid, name):
    return {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}


def _op(tid, name, ts, dur):
    return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_self_time_is_the_duration_less_the_nested_events_on_xla_threads_without_waits():
    events = [
        _thread(1, f"{XLA_THREADS}Eigen/7"),
        _thread(2, "python"),
        # A while loop (100 us) whose body ran two fusions, the second with a dot nested in it;
        # the executor's own work around the loop (160 us in all).
        _op(1, "ThunkExecutor::Execute", 0, 160),
        _op(1, "while.3", 10, 100),
        _op(1, "fusion.1", 10, 30),  # starts with its parent: nested, not a sibling
        _op(1, "fusion.2", 50, 40),
        _op(1, "dot.4", 60, 25),
        _op(1, "fusion.1", 120, 20),  # after the loop: a second event of the same name
        _op(1, "ThunkExecutor::Execute (wait for completion)", 200, 500),
        _op(2, "PjitFunction(step)", 0, 900),  # the host's dispatch: not an XLA thread
    ]
    ops = self_times(events)
    assert ops.self_s == pytest.approx(
        {"ThunkExecutor::Execute": 40e-6, "while.3": 30e-6, "fusion.1": 50e-6, "fusion.2": 15e-6, "dot.4": 25e-6}
    )
    assert ops.counts["fusion.1"] == 2 and ops.total_s == pytest.approx(160e-6)
    assert [(name, count) for name, _, count in ops.top(2)] == [("fusion.1", 2), ("ThunkExecutor::Execute", 1)]


def test_a_traced_program_shows_its_operations():
    @jax.jit
    def step(x):
        return jax.lax.fori_loop(0, 8, lambda i, y: jnp.tanh(y @ y) + 1.0, x)

    x = jnp.ones((64, 64)) / 64
    step(x).block_until_ready()  # compiled before the trace
    with traced_ops() as ops:
        step(x).block_until_ready()
    assert ops.total_s > 0
    assert any(name.startswith("while") for name in ops.self_s), sorted(ops.self_s)
    assert all(seconds >= 0 for seconds in ops.self_s.values())
