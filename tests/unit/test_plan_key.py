"""trainer_bridge.sync.plan_key: a sync plan serves the spellings of one placement (a jitted train
step's ``P()`` for ``param_shardings()``' ``P(None, None)``), never another placement."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_bridge.sync import plan_key


def _key(sharding):
    return plan_key({"w": jax.device_put(np.arange(8.0, dtype=np.float32).reshape(4, 2), sharding)})


def test_the_spellings_of_one_placement_share_a_plan():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    assert _key(NamedSharding(mesh, P())) == _key(NamedSharding(mesh, P(None, None)))
    by_rows = [_key(NamedSharding(mesh, spec)) for spec in (P("x"), P("x", None), P(("x",), None))]
    assert by_rows[0] == by_rows[1] == by_rows[2]
    assert by_rows[0] != _key(NamedSharding(mesh, P(None, "x")))


def test_a_sharding_that_permutes_the_devices_or_holds_partial_sums_has_a_plan_of_its_own():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    # The same spec over the mesh's devices in another order: each device holds other rows.
    permuted = NamedSharding(mesh, P("x", None), _logical_device_ids=(1, 0))
    assert _key(permuted) != _key(NamedSharding(mesh, P("x", None)))
    value = jax.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh, P()))
    for partial in ({"reduced": {"x"}}, {"unreduced": {"x"}}):
        sharding = NamedSharding(mesh, P(None, **partial))
        with jax.set_mesh(mesh):
            leaf = jax.jit(lambda t: t * 1, out_shardings=sharding)(value)
        assert plan_key({"w": leaf}) != _key(NamedSharding(mesh, P())), partial


def test_mesh_axes_of_size_one_split_nothing():
    """At tp=1 ``param_shardings()`` gives ``P(None, 'tensor')`` over a 1-device axis, which a
    jitted train step returns as ``P()``; a MoE's ``P(None, ('data', 'tensor'))`` with one data
    device comes back as ``P(None, 'tensor')``."""
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    assert _key(NamedSharding(one, P(None, "tensor"))) == _key(NamedSharding(one, P()))
    two = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "tensor"))
    assert _key(NamedSharding(two, P(None, ("data", "tensor")))) == _key(NamedSharding(two, P(None, "tensor")))
    assert _key(NamedSharding(two, P(None, "tensor"))) != _key(NamedSharding(two, P()))
