"""models/decoder_flax.py: the trainer's RoPE frequencies are the engine's."""

import numpy as np

from models import Llama3RopeScaling, rope_inv_freq, tiny_llama3_spec


def test_llama3_frequencies_are_the_engines(tmp_path):
    """The trainer's llama3 RoPE frequencies against the engine's own Llama3RotaryEmbedding
    (built as the engine builds it, with the workarounds installed)."""
    from rollout.engine import install_workarounds

    install_workarounds()
    from sgl_jax.srt.layers.embeddings import get_rope

    scaling = tiny_llama3_spec().rope_scaling
    rope = get_rope(64, 64, 1024, 10000.0, True, dict(scaling), dtype=np.float32)
    ours = rope_inv_freq(64, 10000.0, Llama3RopeScaling.from_hf(scaling))
    np.testing.assert_allclose(rope._inv_freq_np, ours, rtol=1e-6)
    assert not np.allclose(ours, rope_inv_freq(64, 10000.0)), "the scaling must change some frequencies"
