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
