"""bench/op_profile.py: self times of a profiler trace's operations, and a real trace read back."""

import random

import jax
import jax.numpy as jnp
import pytest

from bench.op_profile import EXECUTOR, self_times, traced_ops


def _event(tid, name, ts, dur, module=None):
    event = {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur}
    if module:
        event["args"] = {"hlo_module": module, "hlo_op": name, "_src": "thunk_executor.cc"}
    return event


def test_self_time_is_the_duration_less_the_enclosed_operations_on_each_thread():
    events = [
        # Thread 1: the executor (160 us) ran a while loop (100 us) whose body ran fusion.1 (it
        # starts with the loop: enclosed, not a sibling), then fusion.2 starting where fusion.1
        # ends, with a dot in it; then fusion.1 again after the loop, and a zero-length copy.
        _event(1, EXECUTOR, 0, 160),
        _event(1, "while.3", 10, 100, "jit_step"),
        _event(1, "fusion.1", 10, 30, "jit_step"),
        _event(1, "fusion.2", 40, 40, "jit_step"),
        _event(1, "dot.4", 50, 25, "jit_step"),
        _event(1, "fusion.1", 120, 20, "jit_step"),
        _event(1, "copy.5", 140, 0, "jit_step"),
        # Thread 2 (no thread-name metadata: a program cheap enough to run on the calling
        # thread): another program's fusion.1, inside a dispatch that is not read.
        _event(2, "PjitFunction(other)", 0, 900),
        _event(2, "fusion.1", 5, 7, "jit_other"),
        # Waits and the executor's end markers are not work.
        _event(1, EXECUTOR + " (wait for completion)", 200, 500),
        _event(3, "SlinkyThreadPool::Await", 0, 300),
        _event(1, "end: fusion.2", 80, 1),
    ]
    random.Random(0).shuffle(events)  # a trace's events come in any order
    ops = self_times(events)
    assert ops.self_s == pytest.approx(
        {
            EXECUTOR: 40e-6,
            "jit_step/while.3": 30e-6,
            "jit_step/fusion.1": 50e-6,
            "jit_step/fusion.2": 15e-6,
            "jit_step/dot.4": 25e-6,
            "jit_step/copy.5": 0.0,
            "jit_other/fusion.1": 7e-6,
        }
    )
    assert ops.total_s == pytest.approx(167e-6)
    assert [(name, count) for name, _, count in ops.top(2)] == [("jit_step/fusion.1", 2), (EXECUTOR, 1)]
    # A long stretch less a short one: what the extra work cost, name by name.
    extra = ops.minus(self_times([_event(1, "fusion.1", 0, 20, "jit_step")]))
    assert extra.self_s["jit_step/fusion.1"] == pytest.approx(30e-6) and extra.counts["jit_step/fusion.1"] == 1
    assert extra.self_s["jit_step/dot.4"] == pytest.approx(25e-6)


def test_a_traced_program_shows_its_loop_and_its_body():
    @jax.jit
    def step(x):
        return jax.lax.fori_loop(0, 8, lambda i, y: jnp.tanh(y @ y) + 1.0, x)

    x = jnp.ones((64, 64)) / 64
    step(x).block_until_ready()  # compiled before the trace
    with traced_ops() as ops:
        step(x).block_until_ready()
    names = sorted(ops.self_s)
    assert any(name.startswith("jit_step/while") for name in names), names
    assert sum(count for name, count in ops.counts.items() if name.startswith("jit_step/")) > 8, ops.counts
    assert ops.total_s > 0 and all(seconds >= 0 for seconds in ops.self_s.values())


def test_a_trace_without_compiled_programs_is_an_error():
    with pytest.raises(RuntimeError, match="no operation of a compiled program"):
        with traced_ops():
            pass


def test_a_devices_kernels_are_counted_whole_by_kernel_name():
    """A GPU stream's kernels can overlap (one starts before the one before it ends): none
    encloses another. They are named by program and kernel, the host's events as before."""
    device = {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}
    host = {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}

    def kernel(name, ts, dur, module="jit_chunk"):
        return {"ph": "X", "pid": 7, "tid": 14, "name": name, "ts": ts, "dur": dur, "args": {"hlo_module": module}}

    events = [
        device,
        host,
        kernel("wrapped_concatenate", 0, 30),
        kernel("gemm", 25, 20),  # starts before the concatenate ends
        kernel("gemm", 60, 20),
        {"ph": "X", "pid": 7, "tid": 14, "name": "MemcpyD2H", "ts": 90, "dur": 2},
        _event(3, "fusion.1", 0, 10, "jit_step"),
    ]
    ops = self_times(events)
    assert ops.self_s == pytest.approx(
        {"jit_chunk/wrapped_concatenate": 30e-6, "jit_chunk/gemm": 40e-6, "MemcpyD2H": 2e-6, "jit_step/fusion.1": 10e-6}
    )
    assert ops.counts["jit_chunk/gemm"] == 2
