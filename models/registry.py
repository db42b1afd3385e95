"""The model families the trainer and the engine share, by HF ``model_type``.

A family is data: its mapping table (trainer <-> HF <-> engine names, ``models/<family>.py``),
the Flax trainer model that has exactly the trainer paths of that table, and the config
features both sides agree on (RoPE scaling types). A new family gets an entry here, beside its
table, its Flax model and its tiny builder (docs/models.md, "Adding a model family").
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from . import llama, qwen2, qwen3, qwen3_moe
from .decoder_flax import CausalLM, DecoderConfig, Llama3RopeScaling
from .hf_config import with_hf_defaults
from .mapping import ParamMapping, expand_mappings
from .qwen3_moe_flax import Qwen3MoeConfig

# RoPE scaling types a family's Flax model and the engine compute alike; None/"default" is plain
# RoPE. 0.0.2's Qwen2, Qwen3 and Qwen3-MoE attentions build their RotaryEmbedding without the
# config's rope_scaling (the engine would run plain RoPE where the trainer scales); its Llama
# passes it to get_rope (with the "llama3-rope-scaling" workaround).
PLAIN_ROPE = frozenset({"default"})
LLAMA_ROPE_TYPES = frozenset({"default", "llama3"})

# Keys whose only value both sides compute, where a config.json sets them: the Flax models run
# SiLU MLPs, rotate whole heads the neox way (0.0.2's Llama honours rope_is_neox_style, an
# sglang key) and attend to every earlier token.
SHARED_VALUES = {
    "hidden_act": ("silu",),
    "partial_rotary_factor": (1, 1.0),
    "rope_is_neox_style": (True,),
    "use_sliding_window": (False,),
}


def _expand(table, get) -> list[ParamMapping]:
    return expand_mappings(table, num_layers=int(get("num_hidden_layers")), tied=bool(get("tie_word_embeddings")))


def _decoder_flax(config: dict, dtype: str):
    return CausalLM(DecoderConfig.from_hf(config, dtype=dtype))


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: everything the worker needs to know about it, as data."""

    model_type: str  # HF config.json "model_type"
    mapping: tuple[ParamMapping, ...]
    # (HF config dict, dtype) -> the Flax trainer model (params in the MLLM-JAX layout).
    flax_model: Callable[[dict, str], object]
    rope_types: frozenset[str] = PLAIN_ROPE
    # (table, config getter) -> concrete entries; a family with layer-dependent entries
    # (dense and sparse layers) supplies its own.
    expand: Callable = _expand
    # config.json keys that must be false/absent (features the table and the model lack).
    unsupported_flags: tuple[str, ...] = ()
    # (config getter) -> None, or ValueError for values the family cannot serve.
    check: Callable | None = None
    # Mixture of experts: (config getter) -> the layers that route tokens to experts, whose
    # choices the engine can record and the Flax model replay (``routed_experts``); None: none.
    expert_layers: Callable | None = None


def _qwen3_moe_expand(table, get) -> list[ParamMapping]:
    return expand_mappings(
        table,
        num_layers=int(get("num_hidden_layers")),
        tied=bool(get("tie_word_embeddings")),
        sparse_layers=qwen3_moe.sparse_layers(get),
    )


def _qwen3_moe_flax(config: dict, dtype: str):
    return CausalLM(Qwen3MoeConfig.from_hf(config, dtype=dtype))


FAMILIES: dict[str, Family] = {
    "qwen2": Family("qwen2", qwen2.MAPPING, _decoder_flax),
    "qwen3": Family("qwen3", qwen3.MAPPING, _decoder_flax, unsupported_flags=("attention_bias",)),
    "llama": Family(
        "llama",
        llama.MAPPING,
        _decoder_flax,
        rope_types=LLAMA_ROPE_TYPES,
        unsupported_flags=("attention_bias", "mlp_bias"),
    ),
    qwen3_moe.MODEL_TYPE: Family(
        qwen3_moe.MODEL_TYPE,
        qwen3_moe.MAPPING,
        _qwen3_moe_flax,
        expand=_qwen3_moe_expand,
        unsupported_flags=("attention_bias",),
        check=qwen3_moe.check_config,
        expert_layers=qwen3_moe.sparse_layers,
    ),
}


def _getter(hf_config):
    """``get(key, default=None)`` of an HF config: a dict (a parsed config.json, read with
    transformers' defaults for the keys it omits) or a PretrainedConfig."""
    if isinstance(hf_config, dict):
        return with_hf_defaults(hf_config).get
    return lambda key, default=None: getattr(hf_config, key, default)


# The sizes every family's table is built from, and those only its model needs (a real config has
# them; a mapping table can be expanded without).
_SIZES = ("num_hidden_layers", "num_attention_heads", "hidden_size")
_MODEL_SIZES = ("vocab_size", "intermediate_size")


def family_for(hf_config, where: str = "config", tp_size: int = 1) -> Family:
    """The family of an HF config (dict or PretrainedConfig), after checking that the trainer
    model and the engine both support what it asks for, its heads split over ``tp_size``
    tensor-parallel devices (the attention heads evenly, the KV heads evenly or each repeated on
    ``tp_size / num_key_value_heads`` devices). ValueError naming the field otherwise."""
    get = _getter(hf_config)
    model_type = get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    _check_rope_scaling(get, family, where)
    for flag in family.unsupported_flags:
        if get(flag):
            raise ValueError(f"{where}: {flag}={get(flag)!r} is not supported for {model_type}")
    for key, values in SHARED_VALUES.items():
        if get(key) is not None and get(key) not in values:
            raise ValueError(f"{where}: {key}={get(key)!r} is not supported (the trainer model computes {values[0]!r})")
    if family.check is not None:
        try:
            family.check(get)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    for field in (*_SIZES, *(field for field in _MODEL_SIZES if get(field) is not None)):
        value = get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {field} must be a positive integer, got {value!r}")
    heads = int(get("num_attention_heads"))
    kv_heads = get("num_key_value_heads") or heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"{where}: num_key_value_heads must be a positive integer dividing num_attention_heads={heads}, "
            f"got {kv_heads!r}"
        )
    if heads % tp_size:
        raise ValueError(f"{where}: tp_size={tp_size} does not divide num_attention_heads={heads}")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"{where}: tp_size={tp_size} and num_key_value_heads={kv_heads}: the engine splits KV heads evenly "
            "over the devices, or repeats each on tp_size / num_key_value_heads of them; neither divides the other"
        )
    head_dim = get("head_dim") or int(get("hidden_size")) // heads
    if int(head_dim) % 2:
        raise ValueError(f"{where}: head_dim {head_dim} is odd; rotary embeddings need an even head_dim")
    return family


def _check_rope_scaling(get, family: Family, where: str) -> None:
    scaling = get("rope_scaling")
    if not scaling:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in family.rope_types:
        raise ValueError(
            f"{where}: rope_scaling type {kind!r} is not supported for {family.model_type}; "
            f"supported: none, {', '.join(sorted(family.rope_types))}"
        )
    if kind != "llama3":
        return
    try:
        llama3 = Llama3RopeScaling.from_hf(scaling)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    # 0.0.2's Llama layer puts a top-level original_max_position_embeddings into rope_scaling;
    # transformers and the trainer model read the one inside.
    top_level = get("original_max_position_embeddings")
    if top_level is not None and top_level != llama3.original_max_position_embeddings:
        raise ValueError(
            f"{where}: original_max_position_embeddings={top_level!r} differs from rope_scaling's "
            f"{llama3.original_max_position_embeddings}: the engine would scale RoPE by the first, the trainer "
            "model (as transformers) by the second"
        )


def mappings_for(hf_config, where: str = "config") -> list[ParamMapping]:
    """Concrete mapping entries for a model, from its HF config (dict or PretrainedConfig);
    ValueError naming ``where`` and the field for one no family serves."""
    family = family_for(hf_config, where)
    return family.expand(family.mapping, _getter(hf_config))


def flax_model_for(hf_config: dict, dtype: str = "float32"):
    """The Flax trainer model of an HF config dict (``config.json`` parsed)."""
    return family_for(hf_config).flax_model(hf_config, dtype)


def check_routing_recordable(model_path: str, what: str = "WorkerConfig.record_routing") -> None:
    """ValueError, starting with ``what``, unless a local model directory has layers with
    routed experts (a hub id passes)."""
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        expert_layers = family_for(config, where=str(config_file)).expert_layers
        if expert_layers is None:
            raise ValueError(
                f"{what}: {config_file} is a {config.get('model_type')} model, which routes no tokens to experts"
            )
        if not expert_layers(config.get):
            raise ValueError(
                f"{what}: no layer of {config_file} routes tokens to experts "
                "(num_experts, mlp_only_layers and decoder_sparse_step leave every layer dense)"
            )
