"""Per-architecture model code: Flax trainer models (MLLM-JAX layout), mapping tables to HF and
sglang-jax, and tiny random model dirs for tests and examples."""

from .logprobs import completion_log_probs, sampled_token_log_probs, sampling_log_probs
from .mapping import Condition, EngineTransform, ParamMapping, expand_mappings
from .qwen_flax import QwenConfig, QwenForCausalLM, greedy_decode
from .registry import MAPPINGS, mappings_for
from .tiny import TinyModelSpec, random_hf_weights, write_tiny_model

__all__ = [
    "MAPPINGS",
    "Condition",
    "EngineTransform",
    "ParamMapping",
    "QwenConfig",
    "QwenForCausalLM",
    "TinyModelSpec",
    "completion_log_probs",
    "expand_mappings",
    "greedy_decode",
    "mappings_for",
    "random_hf_weights",
    "sampled_token_log_probs",
    "sampling_log_probs",
    "write_tiny_model",
]
