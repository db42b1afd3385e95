"""trainer_bridge/hf.py: HF safetensors loaded in the trainer's layout."""

import numpy as np
import pytest
from safetensors.numpy import load_file

from trainer_bridge import flatten_params, load_hf_params


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
