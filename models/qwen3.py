"""Qwen3: qk-norm, no attention biases. Trainer <-> HF <-> sglang-jax 0.0.2 names."""

from . import llama
from .mapping import ParamMapping

MAPPING = llama.MAPPING + tuple(
    ParamMapping(
        f"model.layers_{{layer}}.self_attn.{norm}.scale",
        f"transformer.layers.{{layer}}.self_attn.{norm}.scale",
        f"model.layers.{{layer}}.self_attn.{norm}.weight",
    )
    for norm in ("q_norm", "k_norm")
)
