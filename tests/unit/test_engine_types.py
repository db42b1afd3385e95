"""rollout/engine/types.py and buffers.py: EngineOptions checks its devices; an array's bytes and
buffers, also once donated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rollout.engine.buffers import device_buffers, device_nbytes
from tests.helpers import tiny_options


def test_devices_must_match_tp_size_and_be_distinct(qwen2_dir):
    devices = jax.devices()
    with pytest.raises(ValueError, match="has 2 devices .* but tp_size is 1"):
        tiny_options(qwen2_dir, devices[:2], tp_size=1)
    with pytest.raises(ValueError, match="lists a device twice: 1,1"):
        tiny_options(qwen2_dir, (devices[1], devices[1]))
    with pytest.raises(ValueError, match="non-empty sequence of jax.Device"):
        tiny_options(qwen2_dir, (0, 1), tp_size=2)


def test_an_arrays_bytes_count_each_devices_shard_and_survive_its_donation():
    """A KV buffer is donated to every forward on the engine's thread while /admin/memory reads
    it from another: its bytes come from its shape and sharding, and a deleted array has no
    buffers (reading them raised "Array has been deleted", a 500 under load)."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    split = jax.device_put(jnp.zeros((8, 6), jnp.bfloat16), NamedSharding(mesh, PartitionSpec(None, "tensor")))
    # Split over 'tensor', replicated over 'data': each of the 4 devices holds 8 x 3 bfloat16.
    assert device_nbytes(split) == sum(device_buffers(split).values()) == 4 * 8 * 3 * 2
    assert len(device_buffers(split)) == 4
    split.delete()
    assert device_nbytes(split) == 4 * 8 * 3 * 2 and device_buffers(split) == {}
    kv = jnp.zeros((8, 6))
    jax.jit(lambda x: x + 1, donate_argnums=0)(kv)
    assert device_nbytes(kv) == 8 * 6 * 4 and device_buffers(kv) == {}
