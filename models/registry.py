"""Which mapping table serves which HF ``model_type``."""

from . import qwen2, qwen3
from .mapping import ParamMapping, expand_mappings

MAPPINGS: dict[str, tuple[ParamMapping, ...]] = {
    "qwen2": qwen2.MAPPING,
    "qwen3": qwen3.MAPPING,
}


def mappings_for(hf_config) -> list[ParamMapping]:
    """Concrete mapping entries for a model, from its HF config (dict or PretrainedConfig)."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda k, d=None: getattr(hf_config, k, d)
    model_type = get("model_type")
    if model_type not in MAPPINGS:
        raise ValueError(f"no mapping table for model_type {model_type!r}; known: {sorted(MAPPINGS)}")
    return expand_mappings(
        MAPPINGS[model_type],
        num_layers=int(get("num_hidden_layers")),
        tied=bool(get("tie_word_embeddings", True)),
    )
