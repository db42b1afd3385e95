"""Each sglang-jax 0.0.2 workaround in rollout/engine/patches.py, pinned by a test that fails
without it (the workaround names are the keys of ``WORKAROUNDS``)."""

import asyncio
import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import QwenConfig, QwenForCausalLM, greedy_decode
from rollout import EngineError, RolloutWorker
from rollout.engine import patches
from tests.helpers import tiny_worker_config
from trainer_bridge import load_hf_params

PROMPTS = [[5, 17, 42, 8], [100, 3]]
REPO = Path(__file__).resolve().parents[1]

# The test that fails without each workaround (run with ROLLOUT_DISABLE_WORKAROUNDS=<name>).
# A new entry of WORKAROUNDS needs one here.
PINNING_TESTS = {
    "duplicate-pytree-registration": "tests/test_engine_workarounds.py::test_duplicate_pytree_registration_import",
    "min-p-operands": "tests/test_sampling_filters.py::test_min_p_drops_tokens_below_a_fraction_of_the_most_likely",
    "sampler-rng": "tests/test_sampling_filters.py::test_temperature_sampling_follows_the_softmax",
    "process-kill-on-error": "tests/test_engine_workarounds.py::test_engine_thread_error_is_an_exception_not_a_dead_process",
    "idle-busy-spin": "tests/test_generate.py::test_worker_idles_quietly",
    "process-global-side-effects": "tests/test_engine_workarounds.py::test_process_global_state_is_preserved",
    "untied-head-dtype": "tests/test_engine_workarounds.py::test_untied_head_computes_in_the_model_dtype",
    "detokenizer-output-ids": "tests/test_generate.py::test_eos_stop_keeps_the_eos_token",
    "shared-hf-config": "tests/test_engine_workarounds.py::test_second_tensor_parallel_engine_on_the_same_model",
    "flush-cache": "tests/test_engine_workarounds.py::test_flush_prefix_cache_drops_kv_of_the_old_weights",
}


def run_pytest(nodes, disabled=""):
    """Pytest in a fresh process (a workaround is installed once per process)."""
    env = dict(os.environ, **{patches.DISABLE_ENV: disabled})
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodes]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_every_workaround_has_a_pinning_test():
    assert sorted(PINNING_TESTS) == sorted(patches.WORKAROUNDS), "each workaround needs a pinning test"
    for node in PINNING_TESTS.values():
        file, name = node.split("::")
        assert f"def {name}(" in (REPO / file).read_text(), f"{node} does not exist"


def test_unknown_disabled_workaround_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(patches.DISABLE_ENV, "flush-cache, no-such-fix")
    with pytest.raises(ValueError, match=r"ROLLOUT_DISABLE_WORKAROUNDS names unknown workaround\(s\) \['no-such-fix'\]"):
        patches.disabled_workarounds()
    monkeypatch.setenv(patches.DISABLE_ENV, "flush-cache, sampler-rng")
    assert patches.disabled_workarounds() == {"flush-cache", "sampler-rng"}
    assert not patches.workaround_enabled("flush-cache") and patches.workaround_enabled("min-p-operands")


def in_file_order(node):
    file, name = node.split("::")
    return file, (REPO / file).read_text().index(f"def {name}(")


def test_pinning_tests_pass_with_every_workaround():
    # In file order: tests sharing a module fixture rely on it (doomed_worker's engine dies last).
    result = run_pytest(sorted(set(PINNING_TESTS.values()), key=in_file_order))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(PINNING_TESTS))
def test_pinning_test_fails_without_its_workaround(name):
    result = run_pytest([PINNING_TESTS[name]], disabled=name)
    # 1: the test failed; negative: the process was killed by a signal (the bug itself).
    # Not 2-5 (interrupted, internal or usage error, nothing collected): those prove nothing.
    assert result.returncode == 1 or result.returncode < 0, (
        f"{PINNING_TESTS[name]} with {name} disabled exited {result.returncode}:\n"
        + result.stdout[-3000:] + result.stderr[-3000:]
    )


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


LONG_PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11], [1], [64, 65, 66], [300, 2, 4], [9] * 7, [12, 34]]


def test_untied_head_computes_in_the_model_dtype(qwen2_untied_dir):
    reference = greedy_decode(
        QwenForCausalLM(QwenConfig.from_hf(qwen2_untied_dir)), load_hf_params(qwen2_untied_dir), LONG_PROMPTS, 24
    )
    with RolloutWorker(tiny_worker_config(qwen2_untied_dir)) as worker:
        specs = {s.path: s for s in worker.engine.leaf_specs()}
        assert specs["lm_head.embedding"].dtype == np.float32
        # float32 logits: greedy decoding agrees with the float32 Flax model token for token.
        greedy = worker.generate(LONG_PROMPTS, temperature=0.0, max_new_tokens=24, ignore_eos=True)
        assert greedy.completions == reference


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


def test_flush_prefix_cache_drops_kv_of_the_old_weights(doomed_worker, qwen2_dir):
    """Weights swapped under a warm prefix cache: without a flush the prompt's cached KV (from
    the old weights) is reused and the output is wrong; after the flush it is right."""
    engine = doomed_worker.engine
    prompt = [[5, 17, 42, 8, 100, 3, 250, 251, 252, 7, 9, 11, 64, 65, 66, 300]]
    kwargs = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    doomed_worker.generate(prompt, **kwargs)  # caches the prompt's KV under the HF weights
    scaled = jax.tree_util.tree_map(lambda x: x * 1.5, load_hf_params(qwen2_dir))
    expected = greedy_decode(QwenForCausalLM(QwenConfig.from_hf(qwen2_dir)), scaled, prompt, 12)
    # Every weight times 1.5 (elementwise, so the engine's layout does not matter).
    new_leaves = [x * 1.5 if jnp.issubdtype(x.dtype, jnp.floating) else x for x in engine.weight_leaves()]
    engine.call(lambda: engine.replace_weight_leaves(new_leaves))
    stale = doomed_worker.generate(prompt, **kwargs).completions
    assert stale != expected, "the cached prefix was reused (else this test shows nothing)"
    engine.call(engine.flush_prefix_cache)
    assert doomed_worker.generate(prompt, **kwargs).completions == expected


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
    # This process survived (the engine's own handler sends it SIGQUIT); the dead engine fails
    # fast from now on.
    assert not engine.alive
    with pytest.raises(EngineError, match="engine thread failed"):
        doomed_worker.generate(PROMPTS, temperature=0.0, max_new_tokens=4)
    with pytest.raises(EngineError):
        engine.call(lambda: None)
