"""rollout/engine/moe.py: the engine's Qwen3-MoE model, importable here."""


def test_the_engine_knows_qwen3_moe():
    """Pins WORKAROUNDS "moe-jax-import" (jax 0.12 cannot import 0.0.2's Qwen3-MoE module)."""
    from rollout.engine import install_workarounds

    install_workarounds()
    from sgl_jax.srt.models.registry import ModelRegistry

    assert "Qwen3MoeForCausalLM" in ModelRegistry.get_supported_archs()
