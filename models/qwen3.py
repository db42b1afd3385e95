"""Qwen3: qk-norm, no attention biases. Trainer <-> HF <-> sglang-jax 0.0.2 names."""

from .mapping import EngineTransform, ParamMapping
from .qwen2 import SHARED

T = EngineTransform

MAPPING = SHARED + tuple(
    ParamMapping(
        f"model.layers_{{layer}}.self_attn.{proj}.kernel",
        f"transformer.layers.{{layer}}.self_attn.{proj}.weight",
        f"model.layers.{{layer}}.self_attn.{proj}.weight",
        T.REPEAT_KV_HEADS if proj in ("k_proj", "v_proj") else T.IDENTITY,
        hf_transposed=True,
    )
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
) + tuple(
    ParamMapping(
        f"model.layers_{{layer}}.self_attn.{norm}.scale",
        f"transformer.layers.{{layer}}.self_attn.{norm}.scale",
        f"model.layers.{{layer}}.self_attn.{norm}.weight",
    )
    for norm in ("q_norm", "k_norm")
)
