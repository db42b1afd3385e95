"""Llama (2, 3, 3.1-3.3 with llama3 RoPE scaling): no attention biases, no qk-norm, tied or
untied head, GQA. Trainer <-> HF <-> sglang-jax 0.0.2 names (the engine's Llama uses the same
leaf names as its Qwen models)."""

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
)
