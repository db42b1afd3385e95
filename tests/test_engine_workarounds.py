"""Each sglang-jax 0.0.2 workaround in rollout/engine/ (registered in workarounds.py), pinned by a test that fails
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
from packaging.version import Version

from models import CausalLM, DecoderConfig, greedy_decode
from rollout import EngineError, RolloutWorker, in_place_updates
from rollout.engine import patches
from tests.helpers import (
    NOT_SWITCHABLE,
    PINNING_TESTS,
    REPO,
    child_env,
    cpu_reads_stale_weights_without_the_flag,
    tiny_worker_config,
)
from trainer_bridge import load_hf_params

PROMPTS = [[5, 17, 42, 8], [100, 3]]


def run_pytest(nodes, disabled=""):
    """Pytest in a fresh process (a workaround is installed once per process)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodes]
    return subprocess.run(
        command, cwd=REPO, env=child_env(disabled), capture_output=True, text=True, timeout=600, check=False
    )


# One fresh process per workaround (a workaround is installed once per process): the slowest
# tests of the suite, run in one environment of `make test` (the Makefile deselects the marker
# in the other).
@pytest.mark.pinning
@pytest.mark.parametrize("name", sorted(set(PINNING_TESTS) - set(NOT_SWITCHABLE)))
def test_pinning_test_fails_without_its_workaround(name):
    result = run_pytest([PINNING_TESTS[name]], disabled=name)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    if name == in_place_updates.WORKAROUND and not cpu_reads_stale_weights_without_the_flag():
        # This CPU reads weights rewritten in place correctly even without the flag, and the
        # probe says so: then the engine must serve the trainer's params without it too, or the
        # probe misses a stale read the worker would serve. (Where the probe reads stale
        # weights the worker refuses to start, and the pinned test fails below.)
        assert result.returncode == 0 and "1 passed" in result.stdout, (
            f"the probe reads fresh weights here, but {PINNING_TESTS[name]}:\n{output}"
        )
        return
    # 1: the test failed; negative: the process was killed by a signal (the bug itself).
    # Not 2-5 (interrupted, internal or usage error, nothing collected): those prove nothing.
    assert result.returncode == 1 or result.returncode < 0, (
        f"{PINNING_TESTS[name]} with {name} disabled exited {result.returncode}:\n{output}"
    )


def test_keyed_draw_draws_from_the_given_distribution():
    """The engine's own seeded sampler takes a softmax of probabilities off TPU, which pulls
    every distribution towards uniform; the replacement must follow the probabilities."""
    probs = jnp.array([0.6, 0.25, 0.1, 0.05], dtype=jnp.float32)
    rows = 4000
    operands = (
        jnp.log(jnp.tile(probs, (rows, 1))),
        jnp.ones(rows),
        jnp.full(rows, 2**30, jnp.int32),
        jnp.ones(rows),
        jnp.zeros(rows),
        jnp.arange(rows, dtype=jnp.int32),
        jnp.full((rows,), 7, dtype=jnp.int32),
        None,
    )
    draws, log_probs, kept = map(np.asarray, jax.jit(patches._draw_with_logprobs)(operands))
    assert (kept == 4).all()  # nothing filtered: the whole vocabulary
    freq = np.bincount(draws, minlength=4) / rows
    np.testing.assert_allclose(freq, probs, atol=0.03)
    np.testing.assert_allclose(log_probs, np.log(np.asarray(probs))[draws], atol=1e-6)
    again = np.asarray(jax.jit(patches._draw_with_logprobs)(operands)[0])
    np.testing.assert_array_equal(draws, again)


def test_sampler_returns_log_probs_without_the_engines_crashing_path(qwen3_dir):
    """0.0.2's return_logprob kills the scheduler thread; the replacement sampler returns every
    drawn token's log-prob, min-p filtering (which crashed off TPU) included."""
    with RolloutWorker(tiny_worker_config(qwen3_dir)) as worker:
        kwargs = dict(max_new_tokens=6, ignore_eos=True, return_logprobs=True)
        sampled = worker.generate(PROMPTS, n=2, temperature=0.8, **kwargs)
        mask = sampled.completion_mask
        assert np.isfinite(sampled.logprobs).all() and (sampled.logprobs[mask] < 0).all()
        # Min-p 1 keeps only the most likely token: greedy tokens, drawn with probability 1.
        min_p = worker.generate(PROMPTS, temperature=0.8, min_p=1.0, **kwargs)
        greedy = worker.generate(PROMPTS, temperature=0.0, **kwargs)
        assert min_p.completions == greedy.completions
        np.testing.assert_array_equal(min_p.logprobs, 0.0)
        assert worker.engine.alive


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
        CausalLM(DecoderConfig.from_hf(qwen2_untied_dir)), load_hf_params(qwen2_untied_dir), LONG_PROMPTS, 24
    )
    with RolloutWorker(tiny_worker_config(qwen2_untied_dir, precompile=True)) as worker:
        specs = {s.path: s for s in worker.engine.leaf_specs()}
        assert specs["lm_head.embedding"].dtype == np.float32
        # float32 logits: greedy decoding agrees with the float32 Flax model token for token,
        # and sampled log-probs to float32 rounding (a head computed in bfloat16 is ~1e-3 off).
        greedy = worker.generate(LONG_PROMPTS, temperature=0.0, max_new_tokens=24, ignore_eos=True)
        assert greedy.completions == reference
        # The head was set before the forward was precompiled (set after, it recompiled it here).
        assert greedy.compiles == 0
        report = worker.check_consistency(load_hf_params(qwen2_untied_dir), LONG_PROMPTS, max_new_tokens=8, atol=1e-4)
        assert report.max_abs_diff < 1e-4


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
    expected = greedy_decode(CausalLM(DecoderConfig.from_hf(qwen2_dir)), scaled, prompt, 12)
    # Every weight times 1.5 (elementwise, so the engine's layout does not matter).
    new_leaves = [x * 1.5 if jnp.issubdtype(x.dtype, jnp.floating) else x for x in engine.weight_leaves()]
    engine.replace_weight_leaves(new_leaves, flush_prefix_cache=False)
    stale = doomed_worker.generate(prompt, **kwargs).completions
    assert stale != expected, "the cached prefix was reused (else this test shows nothing)"
    engine.testing.flush_prefix_cache()
    assert doomed_worker.generate(prompt, **kwargs).completions == expected


def test_error_in_a_scheduler_call_reaches_the_caller_and_engine_serves_on(doomed_worker):
    with pytest.raises(ZeroDivisionError):
        doomed_worker.engine.call(lambda: 1 / 0)
    assert doomed_worker.generate(PROMPTS, temperature=0.0, max_new_tokens=2).size == 2


def test_engine_thread_error_is_an_exception_not_a_dead_process(doomed_worker):
    engine = doomed_worker.engine
    engine.testing.inject_failure(RuntimeError("injected forward failure"))
    with pytest.raises(EngineError, match="injected forward failure"):
        doomed_worker.generate(PROMPTS, temperature=0.0, max_new_tokens=4)
    # This process survived (the engine's own handler sends it SIGQUIT); the dead engine fails
    # fast from now on.
    assert not engine.alive
    with pytest.raises(EngineError, match="engine thread failed"):
        doomed_worker.generate(PROMPTS, temperature=0.0, max_new_tokens=4)
    with pytest.raises(EngineError):
        engine.call(lambda: None)


# Starts a worker with the flax-eager-sharding workaround taken out.
_WITHOUT_EAGER_SHARDING_WORKAROUND = """
import contextlib, sys
from rollout.engine import handle
handle.variables_sharded_lazily = contextlib.nullcontext
from rollout import RolloutWorker
from tests.helpers import tiny_worker_config
RolloutWorker(tiny_worker_config(sys.argv[1])).close()
"""


def test_flax_eager_sharding_is_off_only_while_the_engine_builds(qwen2_dir):
    import flax

    default = flax.config.flax_always_shard_variable
    with patches.variables_sharded_lazily():
        assert flax.config.flax_always_shard_variable is False
    assert flax.config.flax_always_shard_variable == default
    with RolloutWorker(tiny_worker_config(qwen2_dir)):
        assert flax.config.flax_always_shard_variable == default
    if Version(flax.__version__) < Version("0.12.1"):
        return  # the bug came with flax 0.12.1: nothing fails without the workaround here
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_EAGER_SHARDING_WORKAROUND, str(qwen2_dir)],
        cwd=Path(__file__).parents[1],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "An auto mesh context or metadata is required" in result.stderr
