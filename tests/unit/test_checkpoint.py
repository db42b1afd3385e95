"""trainer_bridge/checkpoint.py: a trainer's resume restores a checkpoint onto its own shardings."""

import asyncio
import gc

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


def test_a_numpy_target_restores_the_params(params, qwen2_dir, tmp_path):
    """load_hf_params' tree as the target had failed with AttributeError ('numpy.ndarray' object
    has no attribute 'sharding')."""
    path = orbax_save(tmp_path / "numpy-target", params)
    restored = restore_params(path, load_hf_params(qwen2_dir))
    for (key, got), want in zip(flatten_params(restored).items(), flatten_params(params).values()):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=key)


def test_a_resume_refuses_integers_saved_where_the_trainer_has_weights(params, tmp_path):
    flat = flatten_params(params)
    key = "model.layers_0.mlp.up_proj.kernel"
    path = orbax_save(tmp_path / "integer", unflatten_params(flat | {key: np.ones(flat[key].shape, np.int32)}))
    with pytest.raises(CheckpointError, match=rf"'{key}' has dtype int32, expected float32"):
        restore_params(path, params)


def train_state(params) -> dict:
    """What the RL examples save: the params beside the optimizer's state (tuples and lists,
    which no param tree has) and the step."""
    moments = jax.tree_util.tree_map(np.zeros_like, params)
    return {"params": params, "opt_state": ({"mu": moments}, [np.int32(3)]), "step": np.int32(3)}


@pytest.mark.parametrize("variables", [False, True], ids=["params", "flax-variables"])
def test_a_train_states_params_are_restored_alone_as_the_target_is_wrapped(params, tmp_path, variables):
    """It failed with "param tree node 'opt_state' is a list" (a TypeError). A flax TrainState
    made of variables holds {'params': {'params': ...}}."""
    path = orbax_save(tmp_path / "state", train_state({"params": params} if variables else params))
    bare = restore_params(path, params)
    wrapped = restore_params(path, {"params": params})
    assert set(wrapped) == {"params"}
    for restored in (bare, wrapped["params"]):
        for (key, got), want in zip(flatten_params(restored).items(), flatten_params(params).values()):
            assert isinstance(got, jax.Array), key
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=key)


@pytest.mark.parametrize("beside", [{}, {"step": np.int32(1)}], ids=["params-alone", "in-a-train-state"])
def test_a_tree_saved_with_dotted_keys_is_read_as_saved(tmp_path, beside):
    """Keys holding a '.' (a tree saved flat, as sync_params takes one): the restore's target
    is nested as the checkpoint nests them. A partial restore had handed such a leaf back as
    the target's own stand-in, and a whole one failed with orbax's 100-line tree diff."""
    w = jax.device_put(np.arange(3, dtype=np.float32))
    path = orbax_save(tmp_path / "dotted", {"params": {"a.b": w, "c": {"d.e": w + 1}}, **beside})
    restored = restore_params(path, {"a": {"b": w}, "c.d": {"e": w}})
    np.testing.assert_array_equal(restored["a"]["b"], np.arange(3))
    np.testing.assert_array_equal(restored["c.d"]["e"], np.arange(3) + 1)


@pytest.mark.parametrize(
    "options,names",
    [
        ({}, ["1", "2"]),
        ({"step_format_fixed_length": 8}, ["00000001", "00000002"]),
        ({"step_prefix": "step"}, ["step_1", "step_2"]),
    ],
    ids=["plain", "zero-padded", "prefixed"],
)
def test_a_managers_steps_are_found_however_it_names_them(params, tmp_path, options, names):
    """A zero-padded name was looked for as "2", a prefixed one not at all."""
    import orbax.checkpoint as ocp

    from trainer_bridge.checkpoint import resolve_checkpoint

    root = tmp_path / "run"
    small = {"w": jax.device_put(np.arange(4, dtype=np.float32))}
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(**options)) as manager:
        for step in (1, 2):
            manager.save(step, args=ocp.args.StandardSave(jax.tree_util.tree_map(lambda x: x * step, small)))
        manager.wait_until_finished()
    (root / "tensorboard_5").mkdir()  # a run's other folder, no step of the manager's
    assert sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "tensorboard_5") == names
    assert resolve_checkpoint(root).parent.name == names[1]
    assert resolve_checkpoint(root, step=1).parent.name == names[0]
    restored = restore_params(root, small, step=1)
    np.testing.assert_array_equal(np.asarray(restored["w"]), small["w"])
    with pytest.raises(CheckpointError, match=r"has no step 3; it has steps \[1, 2\]"):
        resolve_checkpoint(root, step=3)


def test_a_managers_item_named_params_is_the_params(params, tmp_path):
    import orbax.checkpoint as ocp

    from trainer_bridge.checkpoint import resolve_checkpoint

    root = tmp_path / "run"
    small = {"w": jax.device_put(np.arange(4, dtype=np.float32))}
    with ocp.CheckpointManager(root) as manager:
        manager.save(5, args=ocp.args.Composite(params=ocp.args.StandardSave(small)))
        manager.wait_until_finished()
    assert resolve_checkpoint(root) == root / "5" / "params"


def test_a_managers_step_under_another_item_name_is_refused_naming_its_items(tmp_path):
    """A step whose items are named otherwise (MaxText's ``items``): it had said the step did not
    hold a tree of arrays."""
    import orbax.checkpoint as ocp

    from trainer_bridge.checkpoint import resolve_checkpoint

    root = tmp_path / "run"
    small = {"w": jax.device_put(np.arange(4, dtype=np.float32))}
    with ocp.CheckpointManager(root) as manager:
        manager.save(3, args=ocp.args.Composite(items=ocp.args.StandardSave(small)))
        manager.wait_until_finished()
    with pytest.raises(CheckpointError, match=r"holds the items \['items'\], none named 'default' or 'params'"):
        resolve_checkpoint(root)
    np.testing.assert_array_equal(restore_params(root / "3" / "items", small)["w"], small["w"])


def test_an_empty_latest_step_is_passed_over_with_a_warning(tmp_path, caplog):
    import orbax.checkpoint as ocp

    from trainer_bridge.checkpoint import resolve_checkpoint

    root = tmp_path / "run"
    with ocp.CheckpointManager(root) as manager:
        manager.save(10, args=ocp.args.StandardSave({"w": jax.device_put(np.ones(2, np.float32))}))
        manager.wait_until_finished()
    (root / "12").mkdir()  # a save cut off before it wrote anything
    with caplog.at_level("WARNING", logger="trainer_bridge.checkpoint"):
        assert resolve_checkpoint(root).parent.name == "10"
    assert "the directory of step 12 is empty; reading step 10" in caplog.text
    with pytest.raises(CheckpointError):
        restore_params(root, {"w": np.ones(2, np.float32)}, step=12)  # asked for, it is read


def _unfinished_futures() -> set[int]:
    """The asyncio futures alive in this process and not done, by id."""
    return {id(f) for f in gc.get_objects() if isinstance(f, asyncio.Future) and not f.done()}


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_failed_restore_leaves_nothing_behind(tmp_path, capfd, caplog):
    """A checkpoint whose data is truncated: the caller gets CheckpointError, and nothing more.
    orbax closed its event loop under the reads still in flight when the first one failed; later
    (at a gc, at exit) they wrote "Event loop is closed" tracebacks, asyncio's "_GatheringFuture
    exception was never retrieved" and "Exception ignored in <coroutine ...>", each with orbax's
    TensorStore spec, in whatever the caller did next."""
    rng = np.random.default_rng(0)
    tree = {f"w{i}": rng.standard_normal((256, 256)).astype(np.float32) for i in range(16)}
    path = orbax_save(tmp_path / "corrupt", tree)
    data_files = [p for p in path.rglob("*") if p.is_file() and p.stat().st_size > 100_000]
    assert data_files
    for file in data_files:
        with open(file, "r+b") as f:
            f.truncate(file.stat().st_size // 3)
    capfd.readouterr()
    before = _unfinished_futures()
    with pytest.raises(CheckpointError, match="cannot restore checkpoint"):
        restore_params(path, tree)
    left = _unfinished_futures() - before
    gc.collect()
    assert not left, f"{len(left)} asyncio futures of the restore left unfinished"
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    err = capfd.readouterr().err  # what the leftovers wrote (other threads may write other things)
    assert not [m for m in ("Event loop is closed", "Exception ignored", "TensorStore", "Traceback") if m in err], err
