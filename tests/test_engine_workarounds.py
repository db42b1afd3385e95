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

from models import QwenConfig, QwenForCausalLM, greedy_decode, table_logits
from rollout import EngineError, RolloutWorker, in_place_updates
from rollout.engine import patches, workarounds
from tests.helpers import tiny_worker_config
from trainer_bridge import load_hf_params

PROMPTS = [[5, 17, 42, 8], [100, 3]]
REPO = Path(__file__).resolve().parents[1]

# The test that fails without each workaround (run with ROLLOUT_DISABLE_WORKAROUNDS=<name>).
# A new entry of WORKAROUNDS needs one here.
PINNING_TESTS = {
    "duplicate-pytree-registration": "tests/test_engine_workarounds.py::test_duplicate_pytree_registration_import",
    "sampler": "tests/test_sampling_filters.py::test_temperature_sampling_follows_the_softmax",
    "process-kill-on-error": "tests/test_engine_workarounds.py::test_engine_thread_error_is_an_exception_not_a_dead_process",
    "idle-busy-spin": "tests/test_generate.py::test_worker_idles_quietly",
    "process-global-side-effects": "tests/test_engine_workarounds.py::test_process_global_state_is_preserved",
    "untied-head-dtype": "tests/test_engine_workarounds.py::test_untied_head_computes_in_the_model_dtype",
    "detokenizer-output-ids": "tests/test_generate.py::test_eos_stop_keeps_the_eos_token",
    "shared-hf-config": "tests/test_engine_workarounds.py::test_second_tensor_parallel_engine_on_the_same_model",
    "one-request-per-sample": "tests/test_generate.py::test_n_samples_per_prompt_are_independent_and_prompt_major",
    "flush-cache": "tests/test_engine_workarounds.py::test_flush_prefix_cache_drops_kv_of_the_old_weights",
    "engine-devices": "tests/test_multi_engine.py::test_pair_keeps_every_array_on_its_devices",
    "device-memory-scope": "tests/test_multi_engine.py::test_device_memory_is_measured_on_the_engines_devices_without_clearing_caches",
    "concurrent-start-up": "tests/test_multi_engine.py::test_start_ups_take_turns",
    "gpu-matmul-precision": "tests/test_multi_engine.py::test_close_joins_every_thread_and_gpu_precision_stays_in_the_engine",
    "failed-start-sockets": "tests/test_multi_engine.py::test_a_failed_start_up_lets_the_process_exit",
    "native-attention-memory": "tests/test_attention.py::test_engine_forward_memory_does_not_follow_padding_limits",
    "kv-pool-conversions": "tests/test_attention.py::test_bf16_kv_pool_is_not_converted_per_forward",
    "bf16-logits": "tests/test_engine_workarounds.py::test_bfloat16_engine_logits_are_float32",
    "flax-eager-sharding": "tests/test_engine_workarounds.py::test_flax_eager_sharding_is_off_only_while_the_engine_builds",
    "failure-signal-handler": "tests/test_faults.py::test_the_engines_forwards_leave_the_sigterm_handler_alone",
    "llama3-rope-scaling": "tests/test_families.py::test_llama3_rope_scaling_gives_the_trainers_positions",
    "head-dim-padding": "tests/test_families.py::test_head_dim_64_boots_from_safetensors_and_generates_the_flax_tokens",
    "moe-forward": "tests/test_qwen3_moe.py::test_engine_serves_the_flax_models_tokens_from_safetensors",
    "moe-jax-import": "tests/test_qwen3_moe.py::test_the_engine_knows_qwen3_moe",
    "moe-expert-shapes": "tests/test_qwen3_moe.py::test_tensor_parallel_dummy_engine_holds_every_expert",
    "moe-sparse-step": "tests/test_qwen3_moe.py::test_decoder_sparse_step_and_unnormalized_routing",
    "xla-stale-packed-weights": "tests/test_in_place_updates.py::test_the_engine_serves_the_trainers_params_after_donated_updates[qwen2-tp1]",
}
# Workarounds that are part of how an engine runs here and cannot be switched off on their own;
# their pinning tests check the behaviour directly.
NOT_SWITCHABLE = {
    "concurrent-start-up": "the start-up lock also tells each engine's threads which engine they serve",
    "gpu-matmul-precision": "GPU only; its test simulates the engine's GPU branch on CPU",
    "moe-jax-import": "only jax >= 0.12 needs it; it is always on",
}


def run_pytest(nodes, disabled=""):
    """Pytest in a fresh process (a workaround is installed once per process)."""
    env = dict(os.environ, **{workarounds.DISABLE_ENV: disabled})
    if in_place_updates.WORKAROUND in disabled:
        # This process's import of rollout added the flag to XLA_FLAGS: the child would inherit it.
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(in_place_updates.XNNPACK_OFF, "").strip()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodes]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_every_workaround_has_a_pinning_test():
    assert sorted(PINNING_TESTS) == sorted(workarounds.WORKAROUNDS), "each workaround needs a pinning test"
    assert set(NOT_SWITCHABLE) <= set(PINNING_TESTS)
    for node in PINNING_TESTS.values():
        file, name = node.split("::")
        assert f"def {name.split('[')[0]}(" in (REPO / file).read_text(), f"{node} does not exist"


def test_unknown_disabled_workaround_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(workarounds.DISABLE_ENV, "flush-cache, no-such-fix")
    with pytest.raises(ValueError, match=r"ROLLOUT_DISABLE_WORKAROUNDS names unknown workaround\(s\) \['no-such-fix'\]"):
        workarounds.disabled_workarounds()
    monkeypatch.setenv(workarounds.DISABLE_ENV, "flush-cache, sampler")
    assert workarounds.disabled_workarounds() == {"flush-cache", "sampler"}
    assert not workarounds.workaround_enabled("flush-cache") and workarounds.workaround_enabled("idle-busy-spin")


# One fresh process per workaround (a workaround is installed once per process): the slowest
# tests of the suite, run in one environment of `make test` (the Makefile deselects the marker
# in the other).
@pytest.mark.pinning
@pytest.mark.parametrize("name", sorted(set(PINNING_TESTS) - set(NOT_SWITCHABLE)))
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
        QwenForCausalLM(QwenConfig.from_hf(qwen2_untied_dir)), load_hf_params(qwen2_untied_dir), LONG_PROMPTS, 24
    )
    with RolloutWorker(tiny_worker_config(qwen2_untied_dir)) as worker:
        specs = {s.path: s for s in worker.engine.leaf_specs()}
        assert specs["lm_head.embedding"].dtype == np.float32
        # float32 logits: greedy decoding agrees with the float32 Flax model token for token,
        # and sampled log-probs to float32 rounding (a head computed in bfloat16 is ~1e-3 off).
        greedy = worker.generate(LONG_PROMPTS, temperature=0.0, max_new_tokens=24, ignore_eos=True)
        assert greedy.completions == reference
        report = worker.check_consistency(load_hf_params(qwen2_untied_dir), LONG_PROMPTS, max_new_tokens=8, atol=1e-4)
        assert report.max_abs_diff < 1e-4


def test_bfloat16_engine_logits_are_float32():
    """The engine's logits processor on a bfloat16 head: the trainer's float32 logits, not logits
    rounded to bfloat16."""
    patches.install_workarounds()
    from flax import nnx
    from sgl_jax.srt.layers.embeddings import ParallelLMHead
    from sgl_jax.srt.layers.logits_processor import LogitsProcessor

    vocab = 1000
    with patches.variables_sharded_lazily():
        head = ParallelLMHead(vocab + 24, 64, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    hidden = jax.random.normal(jax.random.key(1), (4, 64), jnp.bfloat16) * 8
    logits = LogitsProcessor(vocab, mesh=None)._get_logits(hidden, head)
    assert logits.dtype == jnp.float32 and logits.shape == (4, vocab)
    expected = table_logits(hidden, head.embedding.value)[:, :vocab]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=1e-6, atol=1e-6)
    rounded = np.asarray(logits.astype(jnp.bfloat16).astype(jnp.float32))
    assert np.mean(rounded != np.asarray(logits)) > 0.9


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
    engine.replace_weight_leaves(new_leaves, flush_prefix_cache=False)
    stale = doomed_worker.generate(prompt, **kwargs).completions
    assert stale != expected, "the cached prefix was reused (else this test shows nothing)"
    engine.flush_prefix_cache()
    assert doomed_worker.generate(prompt, **kwargs).completions == expected


def test_error_in_a_scheduler_call_reaches_the_caller_and_engine_serves_on(doomed_worker):
    with pytest.raises(ZeroDivisionError):
        doomed_worker.engine.call(lambda: 1 / 0)
    assert doomed_worker.generate(PROMPTS, temperature=0.0, max_new_tokens=2).size == 2


def test_engine_thread_error_is_an_exception_not_a_dead_process(doomed_worker):
    engine = doomed_worker.engine
    engine.inject_failure(RuntimeError("injected forward failure"))
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
