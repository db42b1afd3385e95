"""Several sglang-jax engines in one process, each on its own devices (4 fake CPU devices):
placement, greedy agreement with one engine on all devices, real concurrency (overlapping
forward passes), thread-safe start-up, per-engine failures, and close() joining every thread."""

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

from rollout import SamplingParams
from rollout.engine import EngineError, EngineHandle, runtime, sessions
from tests.helpers import tiny_options

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11]]
# (sampling params, per-row seeds [prompts, n]) as EngineHandle.generate takes them.
GREEDY = (SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True), np.zeros((len(PROMPTS), 1), np.int64))
# Long enough that forward passes of engines driven at the same time overlap.
LONG = (SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True), np.arange(12).reshape(12, 1))
GREEDY_ONE = ([[5, 17]], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True), np.zeros((1, 1), np.int64))
LONG_PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(5 + i)] for i in range(12)]


def start_from_threads(options_list) -> list[EngineHandle]:
    """Start one engine per thread, all at once (none from the main thread)."""
    engines, errors = [None] * len(options_list), []

    def start(i):
        try:
            engines[i] = EngineHandle(options_list[i])
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(options_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for engine in engines:
            if engine is not None:
                engine.close()
        raise errors[0]
    return engines


def generate_in_threads(engines, prompts, params) -> list:
    """One thread per engine, all generating at once; returns each engine's output ids."""
    results, errors = [None] * len(engines), []

    def run(i):
        try:
            results[i] = [out.output_ids for out in engines[i].generate(prompts, *params)]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a concurrent generate hung"
    if errors:
        raise errors[0]
    return results


@contextlib.contextmanager
def meeting_in_a_forward(engines):
    """Each engine's next forward call waits, inside it, for every other engine's: engines whose
    schedulers cannot be inside a forward at the same time (a lock around them, one thread for
    all) fail it (the barrier breaks after 120 s and the forwards raise), rather than passing or
    failing by how the threads happened to be scheduled. A lock inside the forward would pass."""
    barrier = threading.Barrier(len(engines), timeout=120)
    met = []
    runners = [engine.testing.model_runner for engine in engines]
    for runner in runners:

        def meeting(*args, _forward=runner.forward, _runner=runner, **kwargs):
            if _runner not in met:
                met.append(_runner)
                barrier.wait()
            return _forward(*args, **kwargs)

        runner.forward = meeting
    try:
        yield
    finally:
        for runner in runners:
            del runner.forward
    assert len(met) == len(engines), "every engine ran a forward"


def device_ids(array) -> set[int]:
    return {d.id for d in array.devices()}


@pytest.fixture(scope="module")
def reference(qwen2_dir):
    """One engine on all four devices (the default mesh)."""
    engine = EngineHandle(tiny_options(qwen2_dir, tp_size=2))
    try:
        return [out.output_ids for out in engine.generate(PROMPTS, *GREEDY)]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def pair(qwen2_dir):
    """Two tensor-parallel engines on devices [0, 1] and [2, 3], started from two threads."""
    devices = jax.devices()
    engines = start_from_threads(
        [tiny_options(qwen2_dir, devices[2 * i : 2 * i + 2], name=f"engine {i}") for i in range(2)]
    )
    yield engines
    for engine in engines:
        engine.close()


@pytest.fixture(scope="module")
def quad(qwen2_dir):
    """Four single-device engines, on devices 0, 1, 2 and 3."""
    engines = start_from_threads([tiny_options(qwen2_dir, (d,), name=f"engine {d.id}") for d in jax.devices()])
    yield engines
    for engine in engines:
        engine.close()


def test_pair_first_generates_run_concurrently_and_match_one_engine(pair, reference):
    # The first generate on each engine (it compiles), from one thread per engine at once: the
    # two are inside a forward at the same time.
    with meeting_in_a_forward(pair):
        sampled = generate_in_threads(pair, LONG_PROMPTS, LONG)
    assert all(engine.busy_intervals() for engine in pair), "each engine recorded its forward passes"
    # Same seeds on two engines with the same weights: the same samples.
    assert sampled[0] == sampled[1]
    assert generate_in_threads(pair, PROMPTS, GREEDY) == [reference, reference]


def test_pair_keeps_every_array_on_its_devices(pair):
    devices = jax.devices()
    for i, engine in enumerate(pair):
        own = {2 * i, 2 * i + 1}
        assert engine.name == f"engine {i} (devices {2 * i},{2 * i + 1})"
        assert [d.id for d in engine.mesh.devices.flat] == sorted(own)
        assert engine.mesh.shape == {"data": 1, "tensor": 2, "expert": 1}
        specs = engine.leaf_specs()
        leaves = engine.weight_leaves()
        assert any(s.path.startswith("rng.") for s in specs), "auto load has rng leaves"
        for spec, leaf in zip(specs, leaves):
            assert device_ids(leaf) <= own, f"{engine.name}: {spec.path} on {device_ids(leaf)}"
            assert leaf.committed or device_ids(leaf) == {2 * i}, spec.path
        sharded = [leaf for leaf in leaves if leaf.ndim == 2]
        assert all(device_ids(leaf) == own for leaf in sharded)
        kv = engine.kv_buffers()
        assert kv and all(device_ids(buf) == own for buf in kv)
        assert all(buf.sharding.mesh.devices.flat[0] == devices[2 * i] for buf in kv)


def test_four_single_device_engines(quad, reference):
    with meeting_in_a_forward(quad):  # all four inside a forward at once
        greedy = generate_in_threads(quad, PROMPTS, GREEDY)
    assert greedy == [reference] * 4
    for engine in quad:
        (device,) = engine.mesh.devices.flat
        assert engine.name == f"engine {device.id} (devices {device.id})"
        for leaf in engine.weight_leaves() + engine.kv_buffers():
            assert device_ids(leaf) == {device.id}


def test_a_bf16_engine_precompiles_and_runs_under_the_default_matmul_precision(qwen2_dir, monkeypatch):
    """0.0.2's GPU start-up sets 'highest' (simulated on CPU inside ModelRunner.initialize, where
    0.0.2 does it); for bf16 weights the precompile and the scheduler thread run under the
    precision the process had, so nothing compiled at start-up is compiled again."""
    from sgl_jax.srt.managers.tp_worker import ModelWorker
    from sgl_jax.srt.model_executor.model_runner import ModelRunner

    load_model, run_precompile, seen = ModelRunner.load_model, ModelWorker.run_precompile, []

    def load_model_like_on_gpu(self):
        jax.config.update("jax_default_matmul_precision", "highest")
        load_model(self)

    def recorded_precompile(self, *args, **kwargs):
        seen.append(jax.config.jax_default_matmul_precision)
        return run_precompile(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "load_model", load_model_like_on_gpu)
    monkeypatch.setattr(ModelWorker, "run_precompile", recorded_precompile)
    options = tiny_options(
        qwen2_dir, (jax.devices()[2],), dtype="bfloat16", precompile=True, precompile_bs_paddings=(4,)
    )
    engine = EngineHandle(options)
    try:
        assert seen == [None]
        assert engine.call(lambda: jax.config.jax_default_matmul_precision) is None
    finally:
        engine.close()
        jax.config.update("jax_default_matmul_precision", None)


def test_close_joins_every_thread_and_gpu_precision_stays_in_the_engine(qwen2_dir, monkeypatch):
    """On GPU, 0.0.2's ModelRunner sets 'highest' matmul precision process-wide during start-up;
    simulated here on CPU by a start-up hook that does what that branch does."""
    from sgl_jax.srt.model_executor.model_runner import ModelRunner

    initialize = ModelRunner.initialize

    def initialize_like_on_gpu(self):
        jax.config.update("jax_default_matmul_precision", "highest")
        initialize(self)

    monkeypatch.setattr(ModelRunner, "initialize", initialize_like_on_gpu)
    before = set(threading.enumerate())
    engine = EngineHandle(tiny_options(qwen2_dir, (jax.devices()[1],), name="engine 9"))
    try:
        assert jax.config.jax_default_matmul_precision is None
        assert engine.call(lambda: jax.config.jax_default_matmul_precision) == "highest"
        engine.generate(PROMPTS[:1], GREEDY[0], GREEDY[1][:1])
        started = [t.name for t in set(threading.enumerate()) - before]
    finally:  # closed whatever failed: an engine left running would be in later tests' counts
        engine.close()
    for role in runtime.ENGINE_THREAD_ROLES:
        assert f"sglang-jax::{role} engine 9 (devices 1)" in started
    # tqdm (model loading's progress bar) keeps one monitor thread per process, not per engine.
    left = [t.name for t in set(threading.enumerate()) - before if t.name != "tqdm_monitor"]
    assert left == []
    with pytest.raises(EngineError, match=r"engine 9 \(devices 1\): .*shut down"):
        engine.call(lambda: None)


def test_a_failing_engine_names_itself_and_the_others_serve_on(quad, reference):
    doomed = quad[3]
    doomed.testing.inject_failure(RuntimeError("injected forward failure"))
    with pytest.raises(EngineError, match=r"^engine 3 \(devices 3\): .*injected forward failure"):
        doomed.generate(PROMPTS, *GREEDY)
    assert not doomed.alive
    assert generate_in_threads(quad[:3], PROMPTS, GREEDY) == [reference] * 3
    with pytest.raises(EngineError, match=r"^engine 3 \(devices 3\)"):
        doomed.generate(PROMPTS, *GREEDY)
    assert np.all([engine.alive for engine in quad[:3]])


FAILED_START = textwrap.dedent(
    """
    import os

    import pytest

    from rollout.engine import EngineHandle, EngineOptions, install_workarounds


    @pytest.fixture(scope="module")
    def engine():
        install_workarounds()
        from sgl_jax.srt.model_executor.model_runner import ModelRunner

        def out_of_memory(self, total_device_memory):
            raise RuntimeError("Not enough memory (injected)")

        original = ModelRunner.profile_max_num_token
        ModelRunner.profile_max_num_token = out_of_memory
        try:
            # pytest keeps the error (and the half-built engine) to report it.
            yield EngineHandle(EngineOptions(os.environ["MODEL_DIR"], dtype="float32", max_total_tokens=256))
        finally:
            ModelRunner.profile_max_num_token = original


    def test_start_up_fails(engine):
        pass
    """
)


def test_a_failed_start_up_lets_the_process_exit(qwen2_dir, tmp_path):
    """Seen as a pytest run hanging after its last test (zmq_ctx_term in pytest's final
    gc.collect), so it is reproduced with pytest in a subprocess."""
    (tmp_path / "test_failed_start.py").write_text(FAILED_START)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        MODEL_DIR=str(qwen2_dir),
        PYTHONPATH=str(Path(__file__).parents[1]),
        PYTHONUNBUFFERED="1",
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, summary = [], threading.Event()

    def read():
        for line in process.stdout:
            lines.append(line)
            if "1 error in " in line:  # pytest's last line: the run is over, only the exit is left
                summary.set()
        summary.set()  # end of output: an early exit or crash fails below without the wait

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert summary.wait(timeout=120), "".join(lines)[-3000:]
        assert any("1 error in " in line for line in lines), "".join(lines)[-3000:]
        # The hang came after the summary: the exit is given a bound of its own, so the pinning
        # run (the workaround off) need not wait out a whole run's timeout.
        process.wait(timeout=15)
    finally:
        process.kill()
        reader.join(timeout=10)
        process.stdout.close()
    assert "RuntimeError: Not enough memory (injected)" in "".join(lines), "".join(lines)[-3000:]


def test_a_start_up_failing_after_the_engine_started_stops_it(qwen2_dir, monkeypatch):
    """A failure after sglang-jax's engine is up (here installing the session bookkeeping on
    its scheduler thread) closes it: its threads stop and a worker retried on the same devices
    starts, rather than leaving an engine holding them until the interpreter exits."""
    before = set(threading.enumerate())

    def install_fails(*args):
        raise RuntimeError("injected failure after start-up")

    monkeypatch.setattr(sessions, "install", install_fails)
    with pytest.raises(RuntimeError, match="injected failure after start-up"):
        EngineHandle(tiny_options(qwen2_dir))
    # (tqdm's monitor thread, which the weight loading's progress bar starts, is tqdm's.)
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive() and t.name != "tqdm_monitor"]
    assert left == []
    monkeypatch.undo()
    engine = EngineHandle(tiny_options(qwen2_dir))
    try:
        assert len(engine.generate(*GREEDY_ONE)[0].output_ids) == 2
    finally:
        engine.close()
