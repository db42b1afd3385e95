"""The device memory behind an array, read without racing the engine's thread (which donates
its KV buffers to every forward). No sgl_jax import."""

from __future__ import annotations

import math

import jax


def device_buffers(array: jax.Array) -> dict[tuple[int, int], int]:
    """The device buffers behind an array: (device id, buffer address) -> bytes; none once it
    is deleted, also while this runs (donated to a forward on the engine's thread, which the
    array may not say yet: jax 0.12 then raised "called on deleted or donated buffer")."""
    try:
        try:
            return {
                (shard.device.id, shard.data.unsafe_buffer_pointer()): int(shard.data.nbytes)
                for shard in array.addressable_shards
            }
        except ValueError:
            # jax 0.12 cannot list the shards of an array that jax.device_put made of a
            # one-device array across processes with one device each: its one local piece is
            # the array itself.
            if len(array.sharding.addressable_devices) != 1:
                raise
            (device,) = array.sharding.addressable_devices
            return {(device.id, array.unsafe_buffer_pointer()): device_nbytes(array)}
    except RuntimeError as exc:  # jax.errors.JaxRuntimeError is one
        if array.is_deleted() or "deleted" in str(exc):
            return {}
        raise


def device_nbytes(array: jax.Array) -> int:
    """Bytes an array occupies summed over its devices (replicas count once per device), from
    its shape and sharding: the same whether a forward on another thread has just donated it
    (the KV buffers, every forward) or not."""
    shard = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
    return shard * len(array.sharding.addressable_devices)
