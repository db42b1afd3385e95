"""trainer_bridge/hf.py: HF safetensors loaded in the trainer's layout."""

import json
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from trainer_bridge import CheckpointError, flatten_params, load_hf_params
from trainer_bridge.hf import hf_source


@pytest.fixture(scope="module")
def params(moe_dir):
    return load_hf_params(moe_dir)


def test_hf_experts_are_stacked_in_trainer_layout(moe_dir, params):
    hf = load_file(str(moe_dir / "model.safetensors"))
    flat = flatten_params(params)
    for expert in (0, 5):
        prefix = f"model.layers.1.mlp.experts.{expert}."
        np.testing.assert_array_equal(flat["model.layers_1.mlp.gate_proj"][expert], hf[prefix + "gate_proj.weight"].T)
        np.testing.assert_array_equal(flat["model.layers_1.mlp.down_proj"][expert], hf[prefix + "down_proj.weight"].T)
    assert flat["model.layers_1.mlp.up_proj"].shape == (8, 256, 128)
    np.testing.assert_array_equal(flat["model.layers_1.mlp.gate.kernel"], hf["model.layers.1.mlp.gate.weight"].T)


def _copy(model_dir, tmp_path):
    return Path(shutil.copytree(model_dir, tmp_path / "copy"))


@pytest.mark.parametrize(
    "index, message",
    [
        ([], r"is not a valid safetensors index: TypeError"),
        ({"weight_map": ["model.safetensors"]}, r"'weight_map' must map tensor names to file names"),
        ({"weight_map": {"model.norm.weight": 5}}, r"tensor 'model\.norm\.weight' maps to 5; expected a file name"),
        (  # read outside the directory
            {"weight_map": {"model.norm.weight": "../other/model.safetensors"}},
            r"maps to '\.\./other/model\.safetensors'; expected a file name in",
        ),
        ({"weight_map": {"model.norm.weight": "/etc/model.safetensors"}}, r"maps to '/etc/model\.safetensors'"),
    ],
    ids=["list", "map-a-list", "file-an-int", "dot-dot", "absolute"],
)
def test_a_malformed_index_is_named(qwen2_dir, tmp_path, index, message):
    model_dir = _copy(qwen2_dir, tmp_path)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json.*" + message):
        load_hf_params(model_dir)


def test_a_tensor_in_two_files_without_an_index_is_refused(qwen2_dir, tmp_path):
    model_dir = _copy(qwen2_dir, tmp_path)
    tensors = load_file(str(model_dir / "model.safetensors"))
    save_file({"model.norm.weight": tensors["model.norm.weight"] * 3}, model_dir / "zz-override.safetensors")
    both = r"tensor 'model\.norm\.weight' is in both model\.safetensors and zz-override\.safetensors"
    with pytest.raises(CheckpointError, match=both):
        load_hf_params(model_dir)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: {k: v for k, v in c.items() if k != "num_hidden_layers"}, "num_hidden_layers must be a positive"),
        (lambda c: {**c, "hidden_size": "64"}, r"hidden_size must be a positive integer, got '64'"),
        (lambda c: {**c, "model_type": "gpt2"}, r"model_type 'gpt2' is not supported"),
        (lambda c: [c], r"is not a JSON object"),
    ],
    ids=["no-layers", "size-a-string", "unknown-family", "a-list"],
)
def test_a_config_no_family_serves_is_named(qwen2_dir, tmp_path, edit, message):
    model_dir = _copy(qwen2_dir, tmp_path)
    config = model_dir / "config.json"
    config.write_text(json.dumps(edit(json.loads(config.read_text()))))
    with pytest.raises(CheckpointError, match=re.escape(str(config)) + ".*" + message):
        load_hf_params(model_dir)


def test_experts_of_different_shapes_are_named(moe_dir, tmp_path):
    model_dir = _copy(moe_dir, tmp_path)
    tensors = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(name)}' has shape \(255, 128\), expert 0's has"):
        load_hf_params(model_dir)


@pytest.mark.parametrize("dtype, stored", [(np.int8, "I8"), (np.uint8, "U8"), ("float8_e4m3fn", "F8_E4M3")])
def test_weights_stored_quantized_are_refused_naming_the_file_and_tensor(qwen2_dir, tmp_path, dtype, stored):
    """An int8 (bitsandbytes) or float8 (Qwen3-*-FP8) weight had been cast to float32 as it
    came, its scales ignored: codes up to 127 served as weights (a float8 one failed in numpy,
    naming no dtype)."""
    model_dir = _copy(qwen2_dir, tmp_path)
    tensors = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].astype(jnp.dtype(dtype))
    save_file(tensors, model_dir / "model.safetensors")
    where = (
        rf"model\.safetensors: tensor '{re.escape(name)}' \(for 'model\.layers_1\.mlp\.up_proj\.kernel'\) is stored as"
    )
    for as_dtype in (np.float32, None):
        with pytest.raises(CheckpointError, match=where + rf" {stored}, not a float dtype \(quantized values\?\)"):
            load_hf_params(model_dir, dtype=as_dtype)


def test_a_quantized_config_is_refused(qwen2_dir, tmp_path):
    model_dir = _copy(qwen2_dir, tmp_path)
    config = model_dir / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match=re.escape(str(config)) + r": a quantized checkpoint .*'fp8'"):
        load_hf_params(model_dir)


def test_hf_source_names_a_trainer_leaf_as_the_files_hold_it(qwen2_dir, moe_dir):
    assert hf_source(qwen2_dir, "model.layers_1.mlp.up_proj.kernel") == (
        "tensor 'model.layers.1.mlp.up_proj.weight' in model.safetensors, stored [out, in] (the trainer's [in, out] "
        "transposed)"
    )
    assert hf_source(qwen2_dir, "model.norm.scale") == "tensor 'model.norm.weight' in model.safetensors"
    assert hf_source(moe_dir, "model.layers_1.mlp.down_proj") == (
        "tensors 'model.layers.1.mlp.experts.*.down_proj.weight' (one per expert), stored [out, in] (the trainer's "
        "[in, out] transposed)"
    )
    assert hf_source(qwen2_dir, "model.no_such.kernel") is None
