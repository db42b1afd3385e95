"""Per-architecture model code: Flax trainer models (MLLM-JAX layout), mapping tables to HF and
sglang-jax, and tiny random model dirs for tests and examples."""

from .decoder_flax import CausalLM, DecoderConfig, Llama3RopeScaling, greedy_decode, rope_inv_freq
from .hf_config import HF_DEFAULTS, with_hf_defaults
from .logprobs import (
    completion_log_probs,
    engine_sampling_params,
    sampled_token_log_probs,
    sampling_log_probs,
    table_logits,
)
from .mapping import Condition, EngineTransform, ParamMapping, expand_mappings
from .moe import replay_route, route
from .qwen3_moe_flax import Qwen3MoeConfig, router_choices
from .registry import FAMILIES, Family, family_for, flax_model_for, mappings_for
from .tiny import TinyModelSpec, random_hf_weights, tiny_llama3_spec, tiny_random_llama_spec, write_tiny_model
from .tiny_moe import TinyMoeSpec

__all__ = [
    "FAMILIES",
    "HF_DEFAULTS",
    "Condition",
    "EngineTransform",
    "Family",
    "Llama3RopeScaling",
    "ParamMapping",
    "Qwen3MoeConfig",
    "DecoderConfig",
    "CausalLM",
    "TinyModelSpec",
    "TinyMoeSpec",
    "completion_log_probs",
    "engine_sampling_params",
    "expand_mappings",
    "family_for",
    "flax_model_for",
    "greedy_decode",
    "mappings_for",
    "random_hf_weights",
    "rope_inv_freq",
    "replay_route",
    "route",
    "router_choices",
    "sampled_token_log_probs",
    "sampling_log_probs",
    "table_logits",
    "tiny_llama3_spec",
    "tiny_random_llama_spec",
    "with_hf_defaults",
    "write_tiny_model",
]
