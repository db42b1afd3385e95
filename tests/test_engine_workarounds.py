"""Each sglang-jax 0.0.2 workaround in rollout/patches.py, pinned by a test that fails
without it (the workaround names are the keys of ``WORKAROUNDS``)."""

import asyncio
import logging
import os
import random
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout import EngineError, RolloutWorker
from rollout.engine import patches
from tests.helpers import tiny_worker_config

PROMPTS = [[5, 17, 42, 8], [100, 3]]


def test_every_workaround_is_documented():
    assert set(patches.WORKAROUNDS) == {
        "duplicate-pytree-registration",
        "min-p-operands",
        "sampler-rng",
        "process-kill-on-error",
        "idle-busy-spin",
        "process-global-side-effects",
        "untied-head-dtype",
        "detokenizer-output-ids",
        "shared-hf-config",
        "flush-cache",
        "native-attention-memory",  # pinned in tests/test_attention.py
    }


def test_duplicate_pytree_registration_import():
    patches.install_workarounds()
    assert "sgl_jax.srt.layers.attention.native_backend" in sys.modules


def test_min_p_filter_takes_both_operand_forms():
    probs = jnp.array([[0.5, 0.3, 0.15, 0.05]])
    min_ps = jnp.array([0.2])
    expected = [[0.5, 0.3, 0.15, 0.0]]
    np.testing.assert_allclose(patches._apply_min_p_filter((probs, min_ps)), expected)
    np.testing.assert_allclose(patches._apply_min_p_filter((probs, min_ps, False)), expected)


def test_keyed_categorical_draws_from_the_given_distribution():
    """The engine's own seeded sampler takes a softmax of probabilities off TPU, which pulls
    every distribution towards uniform; the replacement must follow the probabilities."""
    probs = jnp.array([0.6, 0.25, 0.1, 0.05], dtype=jnp.float32)
    rows = 4000
    operands = (
        jnp.tile(probs, (rows, 1)),
        jnp.arange(rows, dtype=jnp.int32),
        jnp.full((rows,), 7, dtype=jnp.int32),
        None,
    )
    draws = np.asarray(jax.jit(patches._keyed_categorical)(operands)).reshape(-1)
    freq = np.bincount(draws, minlength=4) / rows
    np.testing.assert_allclose(freq, probs, atol=0.03)
    again = np.asarray(jax.jit(patches._keyed_categorical)(operands)).reshape(-1)
    np.testing.assert_array_equal(draws, again)


def test_process_global_state_is_preserved(qwen2_dir, monkeypatch):
    root = logging.getLogger()
    handler = logging.NullHandler()
    monkeypatch.setattr(root, "handlers", [handler])
    monkeypatch.setattr(root, "level", logging.WARNING)
    np.random.seed(123)
    random.seed(123)
    expected_np, expected_random = np.random.random(3), random.random()
    np.random.seed(123)
    random.seed(123)
    policy = asyncio.get_event_loop_policy()
    sigquit, sigterm = signal.getsignal(signal.SIGQUIT), signal.getsignal(signal.SIGTERM)

    with RolloutWorker(tiny_worker_config(qwen2_dir)) as worker:
        worker.generate(PROMPTS, temperature=1.0, max_new_tokens=4)
        assert root.level == logging.WARNING and root.handlers == [handler]
        np.testing.assert_array_equal(np.random.random(3), expected_np)
        assert random.random() == expected_random
        assert asyncio.get_event_loop_policy() is policy
        assert signal.getsignal(signal.SIGQUIT) is sigquit
        assert signal.getsignal(signal.SIGTERM) is sigterm


def test_untied_head_computes_in_the_model_dtype(qwen2_untied_dir):
    with RolloutWorker(tiny_worker_config(qwen2_untied_dir)) as worker:
        specs = {s.path: s for s in worker.engine.leaf_specs()}
        assert specs["lm_head.embedding"].dtype == np.float32
        greedy = worker.generate(PROMPTS, temperature=0.0, max_new_tokens=6)
        assert all(len(c) > 0 for c in greedy.completions)


def test_second_tensor_parallel_engine_on_the_same_model(qwen2_dir):
    outputs = []
    for _ in range(2):
        with RolloutWorker(tiny_worker_config(qwen2_dir, tp_size=2)) as worker:
            outputs.append(worker.generate(PROMPTS, temperature=0.0, max_new_tokens=6).completions)
    assert outputs[0] == outputs[1]


@pytest.fixture(scope="module")
def doomed_worker(qwen2_dir):
    """A worker whose engine thread the last test of this module makes fail."""
    worker = RolloutWorker(tiny_worker_config(qwen2_dir))
    yield worker
    worker.close()


def test_flush_prefix_cache_keeps_greedy_output(doomed_worker):
    engine = doomed_worker.engine
    before = doomed_worker.generate(PROMPTS, temperature=0.0, max_new_tokens=8)
    engine.call(engine.flush_prefix_cache)
    after = doomed_worker.generate(PROMPTS, temperature=0.0, max_new_tokens=8)
    assert after.completions == before.completions


def test_error_in_a_scheduler_call_reaches_the_caller_and_engine_serves_on(doomed_worker):
    with pytest.raises(ZeroDivisionError):
        doomed_worker.engine.call(lambda: 1 / 0)
    assert doomed_worker.generate(PROMPTS, temperature=0.0, max_new_tokens=2).size == 2


def test_engine_thread_error_is_an_exception_not_a_dead_process(doomed_worker):
    engine = doomed_worker.engine
    scheduler = engine._scheduler

    def broken_run_batch(batch):
        raise RuntimeError("injected forward failure")

    engine.call(lambda: setattr(scheduler, "run_batch", broken_run_batch))
    with pytest.raises(EngineError, match="injected forward failure"):
        doomed_worker.generate(PROMPTS, temperature=0.0, max_new_tokens=4)
    # The process (this pytest run) is alive, and the dead engine fails fast from now on.
    assert os.getpid() > 0
    assert not engine.alive
    with pytest.raises(EngineError, match="engine thread failed"):
        doomed_worker.generate(PROMPTS, temperature=0.0, max_new_tokens=4)
    with pytest.raises(EngineError):
        engine.call(lambda: None)
