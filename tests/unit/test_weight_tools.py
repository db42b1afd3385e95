"""rollout/weight_tools.py: the weights checksum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout.weight_tools import weights_checksum


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_checksum_is_exact_and_independent_of_placement(dtype):
    values = jax.random.normal(jax.random.key(0), (8, 16)).astype(dtype)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    sharded = jax.device_put(values, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b")))
    single = jax.device_put(values, jax.devices()[3])
    paths = ["w", "v"]
    reference = weights_checksum(paths, [single, single])
    assert weights_checksum(paths, [sharded, single]) == reference
    one_ulp = values.at[3, 5].set(jnp.nextafter(values[3, 5], jnp.inf))
    assert weights_checksum(paths, [one_ulp, single]) != reference
    assert weights_checksum(["v", "w"], [single, single]) != reference  # the leaf order counts
