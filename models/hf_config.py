"""What a ``config.json`` that omits a key means, by ``model_type``: transformers' defaults.

The engine reads ``config.json`` through transformers' ``AutoConfig``, so a key the file omits
takes the default of the family's config class (``LlamaConfig``, ``Qwen2Config``, ...). The
trainer's Flax models and the mapping tables read the file as a dict: they take the same
defaults from here, or the two sides build different models from one file (an old Llama config
without ``rope_theta`` ran RoPE at 10000 in the engine and 1e6 in the trainer).
``tests/unit/test_registry.py`` pins this table against transformers' classes.

Keys whose default is derived are not here: Llama's ``num_key_value_heads`` (its attention
heads; the Qwen classes' are fixed: 32, Qwen3-MoE's 4) and ``head_dim`` (hidden size over heads;
Qwen3's is fixed: 128).
"""

from __future__ import annotations

_SHARED = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu"}

HF_DEFAULTS: dict[str, dict] = {
    "llama": dict(_SHARED),
    "qwen2": {**_SHARED, "num_key_value_heads": 32},
    "qwen3": {**_SHARED, "num_key_value_heads": 32, "head_dim": 128},
    "qwen3_moe": {**_SHARED, "num_key_value_heads": 4, "norm_topk_prob": False},
}


def with_hf_defaults(config: dict) -> dict:
    """``config`` (a parsed ``config.json``) with the keys it omits filled in as transformers fills
    them for its ``model_type`` (a type not in the table: unchanged). A key set to null stays null,
    as it does in transformers."""
    return {**HF_DEFAULTS.get(config.get("model_type"), {}), **config}
