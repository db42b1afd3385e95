"""trainer_bridge/checkpoint.py: a trainer's resume restores a checkpoint onto its own shardings."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.helpers import orbax_save
from trainer_bridge import CheckpointError, flatten_params, load_hf_params, restore_params, unflatten_params


@pytest.fixture(scope="module")
def params(qwen2_dir):
    return jax.tree_util.tree_map(jax.device_put, load_hf_params(qwen2_dir))


def test_trainer_resume_restores_onto_trainer_shardings(params, tmp_path):
    path = orbax_save(tmp_path / "resume", params)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, P("fsdp") if x.shape[0] % 4 == 0 else P())
        ),
        params,
    )
    restored = restore_params(path, target)
    for (key, got), want, spec in zip(
        flatten_params(restored).items(), flatten_params(params).values(), flatten_params(target).values()
    ):
        assert got.sharding == spec.sharding, key
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=key)


def test_a_resume_refuses_integers_saved_where_the_trainer_has_weights(params, tmp_path):
    flat = flatten_params(params)
    key = "model.layers_0.mlp.up_proj.kernel"
    path = orbax_save(tmp_path / "integer", unflatten_params(flat | {key: np.ones(flat[key].shape, np.int32)}))
    with pytest.raises(CheckpointError, match=rf"'{key}' has dtype int32, expected float32"):
        restore_params(path, params)
