"""rollout/engine/patches.py without an engine: patched sglang-jax functions called directly."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from models import table_logits
from rollout.engine import patches, start_up


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


def test_a_16_bit_engine_runs_its_matmuls_under_the_default_precision():
    """0.0.2's GPU start-up leaves 'highest' set process-wide (simulated here); the engine thread
    of a bf16 model runs under JAX's default, a float32 model's keeps 'highest'."""
    from types import SimpleNamespace

    from rollout.engine import runtime

    def scheduler_of(dtype):
        runner = SimpleNamespace(dtype=dtype)
        return SimpleNamespace(tp_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))

    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        assert runtime._engine_matmul_precision(scheduler_of(jnp.bfloat16)) is None
        assert runtime._engine_matmul_precision(scheduler_of(jnp.float32)) == "highest"
    finally:
        jax.config.update("jax_default_matmul_precision", None)
