"""rollout/engine/patches.py without an engine: patched sglang-jax functions called directly."""

import functools
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import table_logits
from rollout.engine import patches, programs, start_up


def test_duplicate_pytree_registration_import():
    patches.install_workarounds()
    assert "sgl_jax.srt.layers.attention.native_backend" in sys.modules


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


def test_device_memory_is_measured_on_the_engines_devices_without_clearing_caches(monkeypatch):
    from sgl_jax.srt.model_executor import model_runner

    patches.install_workarounds()

    class FakeGpu:
        platform = "gpu"

        def __init__(self, free):
            self.free = free

        def memory_stats(self):
            return {"bytes_limit": 10_000, "bytes_in_use": 10_000 - self.free}

    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
    monkeypatch.setattr(jax, "local_devices", lambda: [FakeGpu(1000), FakeGpu(3000), FakeGpu(5000)])
    assert model_runner.get_available_device_memory("gpu") == 1000
    # During an engine's start-up: that engine's devices only.
    monkeypatch.setattr(start_up, "_start_up", start_up.StartUp("engine 1", (FakeGpu(3000), FakeGpu(5000))))
    assert model_runner.get_available_device_memory("gpu") == 3000
    assert cleared == []


def _host_sampling(top_ks, top_ps=None, min_ps=None, all_greedy=False):
    """A stand-in for a SamplingMetadata whose batch's parameters the host kept."""
    rows = len(top_ks)
    metadata = types.SimpleNamespace()
    metadata.__dict__[patches._HOST_SAMPLING] = (
        np.asarray(top_ks, np.int32),
        np.asarray([1.0] * rows if top_ps is None else top_ps, np.float32),
        np.asarray([0.0] * rows if min_ps is None else min_ps, np.float32),
        all_greedy,
    )
    return metadata


def test_a_batch_runs_the_draw_its_host_parameters_name():
    vocab, everything = 50, 2**30
    kind = patches.draw_kind
    assert kind(_host_sampling([1, 1], all_greedy=True), vocab) == "greedy"
    assert kind(_host_sampling([everything, 1]), vocab) == "sample"  # a greedy row beside a sampled one
    assert kind(_host_sampling([vocab, everything]), vocab) == "sample"  # a top-k that keeps every token
    assert kind(_host_sampling([1, everything], top_ps=[0.5, 1.0]), vocab) == "sample"  # greedy: no top-p
    assert kind(_host_sampling([everything, vocab - 1]), vocab) == "filter"
    assert kind(_host_sampling([everything], top_ps=[0.9]), vocab) == "filter"
    assert kind(_host_sampling([everything], min_ps=[0.1]), vocab) == "filter"
    assert kind(types.SimpleNamespace(), vocab) is None  # no host copy: chosen on the device


def test_each_draw_gives_what_the_device_chosen_draw_gives():
    """Per batch, the program of the draw the host names returns what the one program that
    chose on the device returns (greedy rows beside sampled and filtering ones included)."""
    rows, vocab = 6, 300
    logits = jax.random.normal(jax.random.key(0), (rows, vocab)) * 3
    everything = 2**30
    batches = {
        "greedy": ([1] * rows, [1.0] * rows, True),
        "sample": ([everything, 1, everything, everything, 1, everything], [1.0, 0.5, 1.0, 1.0, 1.0, 1.0], False),
        "filter": ([everything, 1, 20, everything, everything, 5], [1.0, 1.0, 1.0, 0.7, 1.0, 1.0], False),
    }
    # One program for the three batches (same shapes), as the engine's sampler was.
    chosen_on_the_device = jax.jit(
        lambda ops, greedy: jax.lax.cond(greedy, patches._greedy_with_logprobs, patches._draw_with_logprobs, ops)
    )
    for name, (top_ks, top_ps, all_greedy) in batches.items():
        assert patches.draw_kind(_host_sampling(top_ks, top_ps, all_greedy=all_greedy), vocab) == name
        operands = (
            logits,
            jnp.full((rows, 1), 0.7),
            jnp.asarray(top_ks, jnp.int32),
            jnp.asarray(top_ps, jnp.float32),
            jnp.zeros(rows),
            jnp.arange(rows, dtype=jnp.int32) * 7,
            jnp.full(rows, 3, jnp.int32),
            None,
        )
        chosen = chosen_on_the_device(operands, jnp.asarray(all_greedy))
        named = jax.jit(patches._DRAWS[name])(operands)
        for a, b in zip(chosen, named):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("temperature", [0.03, 1e-4, 1e-5, 2e-6])
def test_log_probs_stay_exact_at_small_temperatures(temperature):
    """Scaled scores reach 1e6 at small temperatures: a drawn token's log-prob is its distance
    to the max before scaling, never its scaled score less a scaled log-mass (whose rounding
    gave the max log-probs of +0.06 at 2e-6)."""
    rows, vocab = 6, 300
    logits = jax.random.normal(jax.random.key(1), (rows, vocab)) * 3
    reference = jax.nn.log_softmax(np.asarray(logits, np.float64) / temperature, axis=-1)
    everything = 2**30
    for name, top_ks in {"greedy": [1] * rows, "sample": [everything] * rows, "filter": [everything, 20] * 3}.items():
        operands = (
            logits,
            jnp.full((rows, 1), 1.0 if name == "greedy" else temperature),
            jnp.asarray(top_ks, jnp.int32),
            jnp.ones(rows),
            jnp.zeros(rows),
            jnp.arange(rows, dtype=jnp.int32) * 7,
            jnp.full(rows, 3, jnp.int32),
            None,
        )
        ids, logprobs, _ = jax.jit(patches._DRAWS[name])(operands)
        logprobs = np.asarray(logprobs)
        assert (logprobs <= 0).all(), (name, logprobs)
        if name != "greedy":  # greedy rows report the temperature-1 log-prob
            expected = np.take_along_axis(np.asarray(reference), np.asarray(ids)[:, None], axis=-1)[:, 0]
            np.testing.assert_allclose(logprobs, expected, atol=1e-5, err_msg=name)


class _Runner:
    """0.0.2's ModelRunner.initialize_jit in miniature: a jitted forward, called through a
    wrapper that reads it from its closure; its mesh's devices say they are GPUs."""

    mesh = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="gpu")]))

    def initialize_jit(self):
        @functools.partial(jax.jit, donate_argnames=["token_to_kv_pool"], static_argnames=["model_state_def"])
        def jitted_run_model(model_state_def, x, token_to_kv_pool):
            return x * model_state_def, token_to_kv_pool + 1

        def run_model_wrapper(x, pool):
            return jitted_run_model(2.0, x, pool)

        self.jitted_run_model = run_model_wrapper


def test_the_engines_forward_is_jitted_again_under_the_engine_compile_options(monkeypatch):
    """Workaround gpu-dot-merger: on a GPU the forward the engine calls is jitted again with
    0.0.2's own arguments (the pool donated, the state's treedef static) under the option that
    keeps sibling dots apart, the option reaches XLA's compile (an invalid value fails it, naming
    the option), and the forward computes what it did."""
    runner = _Runner()
    patches._jit_forward_under_engine_options(_Runner.initialize_jit)(runner)
    forward = runner.jitted_run_model.__closure__[0].cell_contents
    assert forward.compiler_options == {"xla_gpu_dot_merger_threshold_mb": 0}
    lowered = forward.lower(2.0, jnp.arange(3.0), jnp.zeros(2))
    assert [arg.donated for arg in jax.tree.leaves(lowered.args_info)] == [False, True]
    out, pool = runner.jitted_run_model(jnp.arange(3.0), jnp.zeros(2))
    np.testing.assert_array_equal(out, [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(pool, [1.0, 1.0])
    assert programs.engine_compiler_options("cpu") == {} and programs.engine_compiler_options("tpu") == {}

    monkeypatch.setattr(patches, "engine_compiler_options", lambda platform: {"xla_gpu_dot_merger_threshold_mb": "x"})
    broken = _Runner()
    patches._jit_forward_under_engine_options(_Runner.initialize_jit)(broken)
    with pytest.raises(Exception, match="xla_gpu_dot_merger_threshold_mb"):
        broken.jitted_run_model(jnp.arange(3.0), jnp.zeros(2))


@pytest.mark.parametrize(
    "config_eos, generation_eos, expected",
    [(0, [0, 2], {0, 2}), (0, None, {0}), (5, 7, {5, 7}), ([3, 4], None, {3, 4}), (None, None, set())],
)
def test_eos_ids_are_a_set_whatever_their_value(config_eos, generation_eos, expected):
    """The ids the engine stops at: an EOS id of 0 was kept as the int 0 (a start-up TypeError
    with a generation config's ids, a failure at the first token without)."""
    patches.install_workarounds()
    from sgl_jax.srt.configs.model_config import ModelConfig

    model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(eos_token_id=config_eos),
        hf_generation_config=types.SimpleNamespace(eos_token_id=generation_eos) if generation_eos is not None else None,
    )
    assert ModelConfig.get_hf_eos_token_id(model_config) == expected


def test_a_failure_part_way_through_the_patches_is_not_followed_by_a_second_install():
    """Installing again would patch twice what came before the failure (the native attention
    once took its own patched call for the engine's)."""
    program = """
import pytest
from rollout.engine import EngineError, patches

def broken():
    raise RuntimeError("a patch failed")

patches._patch_logits = broken
with pytest.raises(RuntimeError, match="a patch failed"):
    patches.install_workarounds()
with pytest.raises(EngineError, match="failed earlier in this process .*a patch failed.*half applied"):
    patches.install_workarounds()
print("refused")
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "refused", result.stderr[-2000:]
