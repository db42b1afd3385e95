"""Qwen2 / Qwen2.5: q/k/v biases, no qk-norm. Trainer <-> HF <-> sglang-jax 0.0.2 names."""

from .mapping import Condition, EngineTransform, ParamMapping

T = EngineTransform

_ATTENTION = tuple(
    ParamMapping(
        trainer=f"model.layers_{{layer}}.self_attn.{proj}.{kind}",
        engine=f"transformer.layers.{{layer}}.self_attn.{proj}.{'weight' if kind == 'kernel' else 'bias'}",
        hf=f"model.layers.{{layer}}.self_attn.{proj}.{'weight' if kind == 'kernel' else 'bias'}",
        engine_transform=T.REPEAT_KV_HEADS if proj in ("k_proj", "v_proj") else T.IDENTITY,
        hf_transposed=kind == "kernel",
    )
    for proj in ("q_proj", "k_proj", "v_proj")
    for kind in ("kernel", "bias")
) + (
    ParamMapping(
        "model.layers_{layer}.self_attn.o_proj.kernel",
        "transformer.layers.{layer}.self_attn.o_proj.weight",
        "model.layers.{layer}.self_attn.o_proj.weight",
        hf_transposed=True,
    ),
)

SHARED = (
    ParamMapping("model.embed_tokens.embedding", "transformer.embed_tokens.embedding", "model.embed_tokens.weight"),
    ParamMapping(
        "model.layers_{layer}.input_layernorm.scale",
        "transformer.layers.{layer}.input_layernorm.scale",
        "model.layers.{layer}.input_layernorm.weight",
    ),
    ParamMapping(
        "model.layers_{layer}.post_attention_layernorm.scale",
        "transformer.layers.{layer}.post_attention_layernorm.scale",
        "model.layers.{layer}.post_attention_layernorm.weight",
    ),
    *(
        ParamMapping(
            f"model.layers_{{layer}}.mlp.{proj}.kernel",
            f"transformer.layers.{{layer}}.mlp.{proj}.weight",
            f"model.layers.{{layer}}.mlp.{proj}.weight",
            hf_transposed=True,
        )
        for proj in ("gate_proj", "up_proj", "down_proj")
    ),
    ParamMapping("model.norm.scale", "transformer.norm.scale", "model.norm.weight"),
    # The engine keeps an untied head as an embedding table [V, H].
    ParamMapping("lm_head.kernel", "lm_head.embedding", "lm_head.weight", T.TRANSPOSE, True, Condition.UNTIED),
)

MAPPING = SHARED + _ATTENTION
