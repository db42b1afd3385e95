"""models/registry.py: the families, their mapping tables, and the configs refused before anything
starts."""

import json
import threading

import jax
import numpy as np
import pytest

from models import (
    FAMILIES,
    HF_DEFAULTS,
    Condition,
    DecoderConfig,
    TinyModelSpec,
    TinyMoeSpec,
    family_for,
    flax_model_for,
    mappings_for,
    tiny_random_llama_spec,
    write_tiny_model,
)
from rollout import RolloutWorker
from rollout.config import check_model_family
from tests.helpers import CASES, flax_model, tiny_worker_config
from trainer_bridge import flatten_params


def test_every_family_has_a_contract_case():
    assert set(FAMILIES) <= {case.family for case in CASES}


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
UNSUPPORTED = [
    ({"model_type": "mistral"}, r"model_type 'mistral' is not supported; supported: \['llama', 'qwen2', 'qwen3'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling type 'yarn' is not supported for llama"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling type 'linear' is not supported"),
    ({"attention_bias": True}, r"attention_bias=True is not supported for llama"),
    ({"head_dim": 5, "num_attention_heads": 4, "hidden_size": 20}, r"head_dim 5 is odd"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_scaling \(llama3\) lacks 'low_freq_factor'"),
    (
        {"rope_scaling": LLAMA3_SCALING, "original_max_position_embeddings": 8},
        r"original_max_position_embeddings=8 differs from rope_scaling's 64",
    ),
    ({"num_key_value_heads": 3}, r"num_key_value_heads must be .* dividing num_attention_heads=4, got 3"),
    ({"vocab_size": 0}, r"vocab_size must be a positive integer, got 0"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is not supported"),
    ({"rope_is_neox_style": False}, r"rope_is_neox_style=False is not supported"),
    ({"use_sliding_window": True}, r"use_sliding_window=True is not supported"),
]
UNSUPPORTED_IDS = ["model_type", "yarn", "linear", "bias", "odd-head-dim", "llama3-keys", "llama3-original"]
UNSUPPORTED_IDS += ["kv-heads", "vocab", "gelu", "partial-rotary", "not-neox", "sliding-window"]


@pytest.mark.parametrize("change, message", UNSUPPORTED, ids=UNSUPPORTED_IDS)
def test_unsupported_configs_are_refused_before_anything_starts(tmp_path, change, message):
    model_dir = write_tiny_model(tmp_path, tiny_random_llama_spec(vocab_size=320), with_tokenizer=False)
    config_file = model_dir / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match=message) as error:
        RolloutWorker(tiny_worker_config(model_dir))
    assert str(config_file) in str(error.value)
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("sglang-jax")]


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_rope_scaling_the_engines_qwen_attention_ignores_is_refused(architecture):
    """0.0.2's Qwen2 and Qwen3 attentions build plain RoPE whatever rope_scaling says: a llama3
    scaling served there would not be the trainer model's (its tokens diverged)."""
    config = TinyModelSpec(architecture=architecture, rope_scaling=LLAMA3_SCALING).hf_config()
    with pytest.raises(ValueError, match=rf"rope_scaling type 'llama3' is not supported for {architecture}"):
        family_for(config)


TP_SPLITS = [(6, 3, 2, False), (12, 3, 4, False), (7, 7, 2, False), (4, 2, 4, True), (8, 4, 2, True), (4, 1, 4, True)]


@pytest.mark.parametrize("heads, kv_heads, tp_size, splits", TP_SPLITS)
def test_heads_the_engine_cannot_split_over_tp_size_are_refused_by_name(tmp_path, heads, kv_heads, tp_size, splits):
    """Attention heads split evenly; KV heads evenly or each repeated on tp_size / KV heads
    devices. 0.0.2 otherwise failed an assert naming no field, or started and failed its first
    generate (or every sync)."""
    spec = TinyModelSpec(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=16 * heads)
    model_dir = write_tiny_model(tmp_path, spec, with_tokenizer=False)
    if splits:
        check_model_family(str(model_dir), tp_size)
        return
    with pytest.raises(ValueError, match=rf"tp_size={tp_size} .*heads={kv_heads if heads % tp_size == 0 else heads}"):
        check_model_family(str(model_dir), tp_size)


@pytest.mark.parametrize("model_type", sorted(HF_DEFAULTS))
def test_the_defaults_table_is_transformers_own(model_type):
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    assert {key: getattr(defaults, key) for key in HF_DEFAULTS[model_type]} == HF_DEFAULTS[model_type]


def _hf_side(model_type: str, config: dict) -> dict:
    """What the engine reads from ``config``: transformers' config class, head_dim as 0.0.2's
    attentions take it (the config's, else hidden size over heads)."""
    from transformers import AutoConfig

    hf = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    fields = ("rope_theta", "rms_norm_eps", "tie_word_embeddings", "num_key_value_heads")
    return {name: getattr(hf, name) for name in fields} | {"head_dim": head_dim}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_config_json_that_omits_a_key_means_to_the_trainer_model_what_it_means_to_transformers(model_type):
    """The engine reads config.json through transformers' AutoConfig: an omitted rope_theta,
    tie_word_embeddings, num_key_value_heads or head_dim takes its config class's default, and
    the Flax model (and the mapping table's tied head) must take the same."""
    # 32 heads: by default Llama has 32 KV heads (one per head), Qwen2 and Qwen3 32 (a fixed
    # default: a Qwen config of 8 heads that omits them is refused), Qwen3-MoE 4.
    config = {"model_type": model_type, "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64}
    config |= {"num_hidden_layers": 2, "num_attention_heads": 32}
    if model_type == "qwen3_moe":
        config |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    model = flax_model_for(config).config
    trainer = {name: getattr(model, name) for name in ("rope_theta", "rms_norm_eps", "tie_word_embeddings")}
    trainer |= {"num_key_value_heads": model.num_key_value_heads, "head_dim": model.head_dim}
    assert trainer == _hf_side(model_type, config)
    untied = any(m.trainer == "lm_head.kernel" for m in mappings_for(config))
    assert untied is not model.tie_word_embeddings


def test_mapping_table_expands_router_and_experts_in_sparse_layers_only(moe_dir):
    spec = TinyMoeSpec()
    entries = {m.trainer: m for m in mappings_for(spec.hf_config())}
    assert entries["model.layers_1.mlp.gate_proj"].engine == "transformer.layers.1.mlp.wi_0"
    assert entries["model.layers_1.mlp.down_proj"].hf == "model.layers.1.mlp.experts.{expert}.down_proj.weight"
    assert entries["model.layers_1.mlp.gate.kernel"].engine == "transformer.layers.1.moe_gate.kernel"
    assert entries["model.layers_0.mlp.gate_proj.kernel"].condition is Condition.DENSE_LAYER
    assert entries["model.layers_0.self_attn.o_proj.kernel"].engine == "transformer.layers.0.self_attn.c_proj.weight"
    assert "model.layers_0.mlp.gate.kernel" not in entries and "model.layers_1.mlp.up_proj.kernel" not in entries
    # Exactly the leaves of the Flax model.
    model = flax_model(moe_dir)
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 4), np.int32))["params"]
    assert set(flatten_params(shapes)) == set(entries)


def test_biases_a_familys_decoder_lacks_are_refused(tmp_path):
    """Qwen3's decoder has no q/k/v biases (Qwen2's has): a Qwen3 config asking for them is
    refused before anything starts, and by the Flax model."""
    model_dir = write_tiny_model(tmp_path, TinyModelSpec(architecture="qwen3"), with_tokenizer=False)
    config_file = model_dir / "config.json"
    config = {**json.loads(config_file.read_text()), "attention_bias": True}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="attention_bias=True is not supported for qwen3"):
        RolloutWorker(tiny_worker_config(model_dir))
    with pytest.raises(ValueError, match="qwen3 with attention_bias or mlp_bias is not supported"):
        DecoderConfig.from_hf(config)
    assert DecoderConfig.from_hf({**config, "model_type": "qwen2"}).attention_bias


UNSUPPORTED_MOE = [
    (
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        r"rope_scaling type 'llama3' is not supported for qwen3_moe",
    ),
    ({"attention_bias": True}, r"attention_bias=True is not supported for qwen3_moe"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in 1\.\.num_experts=8"),
]


@pytest.mark.parametrize("change, message", UNSUPPORTED_MOE, ids=["rope-scaling", "attention-bias", "top-k"])
def test_unsupported_moe_configs_are_refused_before_anything_starts(moe_dir, tmp_path, change, message):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({**json.loads((moe_dir / "config.json").read_text()), **change}))
    with pytest.raises(ValueError, match=message):
        RolloutWorker(tiny_worker_config(tmp_path, load_format="dummy"))
