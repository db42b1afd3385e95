"""Per-architecture model code: Flax trainer models (MLLM-JAX layout), mapping tables to HF and
sglang-jax, and tiny random model dirs for tests and examples."""

from .logprobs import completion_log_probs, sampled_token_log_probs, sampling_log_probs
from .mapping import Condition, EngineTransform, ParamMapping, expand_mappings
from .moe import route
from .qwen3_moe_flax import Qwen3MoeConfig
from .qwen_flax import QwenConfig, QwenForCausalLM, greedy_decode
from .registry import MAPPINGS, TRAINER_CONFIGS, mappings_for, trainer_config
from .tiny import TinyModelSpec, random_hf_weights, write_tiny_model
from .tiny_moe import TinyMoeSpec

__all__ = [
    "MAPPINGS",
    "Condition",
    "EngineTransform",
    "ParamMapping",
    "Qwen3MoeConfig",
    "QwenConfig",
    "QwenForCausalLM",
    "TRAINER_CONFIGS",
    "TinyModelSpec",
    "TinyMoeSpec",
    "completion_log_probs",
    "expand_mappings",
    "greedy_decode",
    "mappings_for",
    "random_hf_weights",
    "route",
    "sampled_token_log_probs",
    "sampling_log_probs",
    "trainer_config",
    "write_tiny_model",
]
