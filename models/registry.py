"""Which mapping table and which Flax trainer config serve which HF ``model_type``."""

from pathlib import Path

from . import qwen2, qwen3, qwen3_moe
from .mapping import ParamMapping, expand_mappings
from .qwen3_moe_flax import Qwen3MoeConfig
from .qwen_flax import QwenConfig, read_hf_config

MAPPINGS: dict[str, tuple[ParamMapping, ...]] = {
    "qwen2": qwen2.MAPPING,
    "qwen3": qwen3.MAPPING,
    qwen3_moe.MODEL_TYPE: qwen3_moe.MAPPING,
}


def mappings_for(hf_config) -> list[ParamMapping]:
    """Concrete mapping entries for a model, from its HF config (dict or PretrainedConfig)."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda k, d=None: getattr(hf_config, k, d)
    model_type = get("model_type")
    if model_type not in MAPPINGS:
        raise ValueError(f"no mapping table for model_type {model_type!r}; known: {sorted(MAPPINGS)}")
    sparse = frozenset()
    if model_type == qwen3_moe.MODEL_TYPE:
        qwen3_moe.check_config(get)
        sparse = qwen3_moe.sparse_layers(get)
    return expand_mappings(
        MAPPINGS[model_type],
        num_layers=int(get("num_hidden_layers")),
        tied=bool(get("tie_word_embeddings", True)),
        sparse_layers=sparse,
    )


TRAINER_CONFIGS: dict[str, type[QwenConfig]] = {
    "qwen2": QwenConfig,
    "qwen3": QwenConfig,
    qwen3_moe.MODEL_TYPE: Qwen3MoeConfig,
}


def trainer_config(source: str | Path | dict, dtype: str = "float32") -> QwenConfig:
    """The Flax trainer model's config (``QwenForCausalLM(config)``) for an HF ``config.json``
    (a model dir, the file, or its parsed dict)."""
    source = read_hf_config(source)
    model_type = source.get("model_type")
    if model_type not in TRAINER_CONFIGS:
        raise ValueError(f"no Flax trainer model for model_type {model_type!r}; known: {sorted(TRAINER_CONFIGS)}")
    return TRAINER_CONFIGS[model_type].from_hf(source, dtype=dtype)
