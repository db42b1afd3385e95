"""Per-architecture model code: Flax trainer models (MLLM-JAX layout), mapping tables to HF and
sglang-jax, and tiny random model dirs for tests and examples."""

from .logprobs import completion_log_probs, sampled_token_log_probs, sampling_log_probs
from .mapping import Condition, EngineTransform, ParamMapping, expand_mappings
from .qwen_flax import Llama3RopeScaling, QwenConfig, QwenForCausalLM, greedy_decode, rope_inv_freq
from .registry import FAMILIES, MAPPINGS, Family, family_for, flax_model_for, mappings_for
from .tiny import TinyModelSpec, random_hf_weights, tiny_llama3_spec, tiny_random_llama_spec, write_tiny_model

__all__ = [
    "FAMILIES",
    "MAPPINGS",
    "Condition",
    "EngineTransform",
    "Family",
    "Llama3RopeScaling",
    "ParamMapping",
    "QwenConfig",
    "QwenForCausalLM",
    "TinyModelSpec",
    "completion_log_probs",
    "expand_mappings",
    "family_for",
    "flax_model_for",
    "greedy_decode",
    "mappings_for",
    "random_hf_weights",
    "rope_inv_freq",
    "sampled_token_log_probs",
    "sampling_log_probs",
    "tiny_llama3_spec",
    "tiny_random_llama_spec",
    "write_tiny_model",
]
