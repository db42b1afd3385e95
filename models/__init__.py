"""Per-architecture model code: tiny random model dirs (tests, examples), Flax trainer models,
HF loading and mapping tables to sglang-jax."""

from .tiny import TinyModelSpec, random_hf_weights, write_tiny_model

__all__ = ["TinyModelSpec", "random_hf_weights", "write_tiny_model"]
