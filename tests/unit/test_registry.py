"""models/registry.py: the families, their mapping tables, and the configs refused before anything
starts."""

import json
import threading

import jax
import numpy as np
import pytest

from models import (
    FAMILIES,
    Condition,
    DecoderConfig,
    TinyModelSpec,
    TinyMoeSpec,
    mappings_for,
    tiny_random_llama_spec,
    write_tiny_model,
)
from rollout import RolloutWorker
from tests.helpers import CASES, flax_model, tiny_worker_config
from trainer_bridge import flatten_params


def test_every_family_has_a_contract_case():
    assert set(FAMILIES) <= {case.family for case in CASES}


UNSUPPORTED = [
    ({"model_type": "mistral"}, r"model_type 'mistral' is not supported; supported: \['llama', 'qwen2', 'qwen3'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling type 'yarn' is not supported for llama"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling type 'linear' is not supported"),
    ({"attention_bias": True}, r"attention_bias=True is not supported for llama"),
    ({"head_dim": 5, "num_attention_heads": 4, "hidden_size": 20}, r"head_dim 5 is odd"),
]


@pytest.mark.parametrize("change, message", UNSUPPORTED, ids=["model_type", "yarn", "linear", "bias", "odd-head-dim"])
def test_unsupported_configs_are_refused_before_anything_starts(tmp_path, change, message):
    model_dir = write_tiny_model(tmp_path, tiny_random_llama_spec(vocab_size=320), with_tokenizer=False)
    config_file = model_dir / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match=message) as error:
        RolloutWorker(tiny_worker_config(model_dir))
    assert str(config_file) in str(error.value)
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("sglang-jax")]


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
