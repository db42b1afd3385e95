"""Hot-loading: orbax checkpoints (single and CheckpointManager), HF safetensors dirs,
bad input that leaves the worker serving, the phase log."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file, save_file

from rollout import RolloutWorker
from tests.helpers import orbax_save, tiny_worker_config
from trainer_bridge import CheckpointError, SyncError, flatten_params, load_hf_params, unflatten_params

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11]]


@pytest.fixture(scope="module")
def worker(qwen2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "phases.jsonl"
    config = tiny_worker_config(qwen2_dir, load_format="dummy", tp_size=2, phase_log=str(log))
    with RolloutWorker(config) as w:
        yield w


@pytest.fixture(scope="module")
def params(qwen2_dir):
    return jax.tree_util.tree_map(jax.device_put, load_hf_params(qwen2_dir))


@pytest.fixture(scope="module")
def scaled(params):
    return jax.tree_util.tree_map(lambda x: x * 1.05, params)


def greedy(worker):
    return worker.generate(PROMPTS, temperature=0.0, max_new_tokens=10, ignore_eos=True).completions


def test_orbax_checkpoint_equals_a_direct_sync(worker, params, tmp_path):
    worker.sync_params(params)
    expected = greedy(worker)
    worker.sync_params(jax.tree_util.tree_map(lambda x: x * 0.5, params))
    assert greedy(worker) != expected
    report = worker.load_checkpoint(orbax_save(tmp_path / "ckpt", params))
    assert greedy(worker) == expected
    # Leaves with no transform were restored straight into the engine's layout and aliased.
    assert report.leaves_aliased > 0
    assert report.leaves_copied == sum(m.engine_transform.value != "identity" for m in worker.mappings)


def test_wrapped_params_tree_and_a_train_states_params(worker, params, tmp_path):
    worker.sync_params(params)
    expected = greedy(worker)
    worker.sync_params(jax.tree_util.tree_map(lambda x: x * 0.5, params))
    worker.load_checkpoint(orbax_save(tmp_path / "wrapped", {"params": params}))
    assert greedy(worker) == expected
    # A train state (the RL examples' checkpoints): its params alone are read (a TypeError, once).
    worker.sync_params(jax.tree_util.tree_map(lambda x: x * 0.5, params))
    moments = jax.tree_util.tree_map(jax.numpy.zeros_like, params)
    state = {"params": params, "opt_state": ({"mu": moments}, [np.int32(3)]), "step": np.int32(3)}
    worker.load_checkpoint(orbax_save(tmp_path / "state", state))
    assert greedy(worker) == expected


def test_checkpoint_manager_step_selection(worker, params, scaled, tmp_path):
    worker.sync_params(params)
    first = greedy(worker)
    worker.sync_params(scaled)
    second = greedy(worker)
    assert first != second
    manager = ocp.CheckpointManager(tmp_path / "run")
    manager.save(1, args=ocp.args.StandardSave(params))
    manager.save(2, args=ocp.args.StandardSave(scaled))
    manager.wait_until_finished()
    worker.load_checkpoint(tmp_path / "run", step=1)
    assert greedy(worker) == first
    worker.load_checkpoint(tmp_path / "run")
    assert greedy(worker) == second
    with pytest.raises(CheckpointError, match=r"has no step 7; it has steps \[1, 2\]"):
        worker.load_checkpoint(tmp_path / "run", step=7)


def assert_still_serving(worker, expected, version):
    assert worker.weight_version == version
    assert greedy(worker) == expected


def test_bad_checkpoints_leave_the_worker_serving(worker, params, qwen3_dir, tmp_path):
    worker.sync_params(params)
    expected, version = greedy(worker), worker.weight_version

    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        worker.load_checkpoint(tmp_path / "does-not-exist")
    assert_still_serving(worker, expected, version)

    other = orbax_save(tmp_path / "qwen3", load_hf_params(qwen3_dir))
    with pytest.raises(
        SyncError,
        match=r"does not match the model: missing \d+ expected path\(s\): model\.layers_0\.self_attn\.k_proj\.bias, ",
    ):
        worker.load_checkpoint(other)
    assert_still_serving(worker, expected, version)
    # An extra leaf alone is named alone (it read "missing 0 expected path(s) []; 1 unexpected ...").
    extra = orbax_save(tmp_path / "extra", {**params, "value_head": {"kernel": np.ones((4, 1), np.float32)}})
    with pytest.raises(SyncError, match=r"does not match the model: 1 unexpected path\(s\): value_head\.kernel$"):
        worker.load_checkpoint(extra)
    assert_still_serving(worker, expected, version)

    flat = flatten_params(params)
    flat["model.layers_1.mlp.down_proj.kernel"] = flat["model.layers_1.mlp.down_proj.kernel"][:256]
    wrong_shape = orbax_save(tmp_path / "shape", unflatten_params(flat))
    with pytest.raises(
        SyncError, match=r"'model\.layers_1\.mlp\.down_proj\.kernel' has shape \(256, 256\), expected \(512, 256\)"
    ):
        worker.load_checkpoint(wrong_shape)
    assert_still_serving(worker, expected, version)

    flat = flatten_params(params)
    kernel = "model.layers_0.self_attn.q_proj.kernel"
    flat[kernel] = np.ones(flat[kernel].shape, np.int32)  # a restore would cast it silently
    integer = orbax_save(tmp_path / "integer", unflatten_params(flat))
    with pytest.raises(
        SyncError, match=r"'model\.layers_0\.self_attn\.q_proj\.kernel' has dtype int32, expected a floating dtype"
    ):
        worker.load_checkpoint(integer)
    assert_still_serving(worker, expected, version)

    # orbax restores it as the engine's float32: finite in the checkpoint, inf once read.
    flat = {k: np.asarray(v) for k, v in flatten_params(params).items()}
    flat["model.norm.scale"] = np.full(flat["model.norm.scale"].shape, 1e300)
    overflowing = orbax_save(tmp_path / "overflow", unflatten_params(flat))
    with pytest.raises(
        SyncError,
        match=r"in: model\.norm\.scale \(model\.norm\.scale restored into the engine's float32 from the "
        r"checkpoint's float64: values beyond float32's range \(\|x\| > 3\.40282e\+38\) are inf there\)$",
    ):
        worker.load_checkpoint(overflowing)
    assert_still_serving(worker, expected, version)
    # A NaN of the checkpoint's own is named as such, not as the cast's overflow.
    flat["model.norm.scale"] = np.full(flat["model.norm.scale"].shape, np.nan)
    nan = orbax_save(tmp_path / "nan", unflatten_params(flat))
    with pytest.raises(SyncError, match=r"non-finite values \(nan/inf\) in: model\.norm\.scale$"):
        worker.load_checkpoint(nan)
    assert_still_serving(worker, expected, version)

    with pytest.raises(CheckpointError, match="step must be an int, got '1'"):
        worker.load_checkpoint(integer, step="1")
    with pytest.raises(CheckpointError, match="is a file; load_hf takes the model's directory"):
        worker.load_hf(qwen3_dir / "config.json")
    assert_still_serving(worker, expected, version)

    corrupt = orbax_save(tmp_path / "corrupt", params)
    data_files = [p for p in Path(corrupt).rglob("*") if p.is_file() and p.stat().st_size > 10_000]
    assert data_files
    for file in data_files:
        with open(file, "r+b") as f:
            f.truncate(file.stat().st_size // 3)
    with pytest.raises(CheckpointError, match=f"cannot restore checkpoint {corrupt}") as failure:
        worker.load_checkpoint(corrupt)
    # orbax's words and the read that failed (its array named), not the 60-line TensorStore spec.
    assert 'Error reading "' in str(failure.value) and "TensorStore(" not in str(failure.value)
    assert_still_serving(worker, expected, version)


def write_sharded_copy(src: Path, dst: Path) -> Path:
    """The same model as an HF sharded checkpoint: two files and an index json."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, dst / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_load_hf_sharded_and_bad_files(worker, qwen2_dir, params, scaled, tmp_path):
    worker.sync_params(params)
    expected = greedy(worker)
    worker.sync_params(scaled)
    worker.load_hf(write_sharded_copy(Path(qwen2_dir), tmp_path / "sharded"))
    assert greedy(worker) == expected
    version = worker.weight_version

    truncated = write_sharded_copy(Path(qwen2_dir), tmp_path / "truncated")
    victim = truncated / "model-00002-of-00002.safetensors"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        worker.load_hf(truncated)
    assert_still_serving(worker, expected, version)

    # A tensor the engine's leaf does not fit: named as the files hold it, not only by the
    # trainer's path in the trainer's transposed layout.
    misshapen = Path(shutil.copytree(qwen2_dir, tmp_path / "misshapen"))
    tensors = load_file(str(misshapen / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-8]
    save_file(tensors, misshapen / "model.safetensors")
    named = (
        r"misshapen: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' in model\.safetensors, stored \[out, in\] "
        r"\(the trainer's \[in, out\] transposed\): 'model\.layers_1\.mlp\.up_proj\.kernel' has shape "
        r"\(256, 504\), expected \(256, 512\)"
    )
    with pytest.raises(SyncError, match=named) as refused:
        worker.load_hf(misshapen)
    assert refused.value.path == "model.layers_1.mlp.up_proj.kernel"
    assert_still_serving(worker, expected, version)

    # A NaN likewise: it had been named by the trainer's path alone.
    tensors = load_file(str(Path(qwen2_dir) / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * float("nan")
    nan = Path(shutil.copytree(qwen2_dir, tmp_path / "nan"))
    save_file(tensors, nan / "model.safetensors")
    with pytest.raises(SyncError, match=r"model\.norm\.scale: tensor 'model\.norm\.weight' in model\.safetensors\)$"):
        worker.load_hf(nan)
    assert_still_serving(worker, expected, version)

    with pytest.raises(FileNotFoundError, match="missing-dir"):
        worker.load_hf(tmp_path / "missing-dir")
    assert_still_serving(worker, expected, version)
    (tmp_path / "no-weights").mkdir()  # named for its weights, before the forward check reads its config
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file in .*no-weights"):
        worker.load_hf(tmp_path / "no-weights")
    assert_still_serving(worker, expected, version)

    # Weights of the same shapes made for another forward (they were served under this one's).
    other = write_sharded_copy(Path(qwen2_dir), tmp_path / "other-forward")
    config = json.loads((other / "config.json").read_text())
    config.update(rope_theta=config.get("rope_theta", 10000.0) * 2, rms_norm_eps=1e-3)
    (other / "config.json").write_text(json.dumps(config))
    differ = r"sets the forward otherwise .*rms_norm_eps 0\.001 \(served: .*rope_theta"
    with pytest.raises(CheckpointError, match=differ):
        worker.load_hf(other)
    assert_still_serving(worker, expected, version)


def test_phase_log_records_the_lifecycle(worker, params):
    report = worker.sync_params(params)
    kv_bytes = worker.memory().kv_bytes
    dropped_report = worker.drop_kv()
    greedy(worker)  # rebuilds the KV cache, then generates
    lines = [json.loads(line) for line in Path(worker.config.phase_log).read_text().splitlines()]
    phases = [line["phase"] for line in lines]
    assert phases[0] == "engine_ready"
    assert phases[-4:] == ["weights_synced", "kv_dropped", "kv_rebuilt", "generate"]
    synced, dropped, rebuilt, generated = lines[-4:]
    # Each record carries the figures of its own event, not defaults.
    assert synced["version"] == report.version and synced["bytes_copied"] == report.bytes_copied
    assert synced["kv_bytes"] == kv_bytes > 0 and synced["weight_bytes"] == worker.memory().weight_bytes
    assert dropped["bytes"] == dropped_report.bytes == kv_bytes and dropped["kv_bytes"] == 0
    assert rebuilt["bytes"] == kv_bytes and rebuilt["kv_bytes"] == kv_bytes
    assert generated["rows"] == len(PROMPTS)
    # live_bytes counts every live array: dropping the KV cache lowers it by at least the pool.
    assert synced["live_bytes"] - dropped["live_bytes"] >= kv_bytes
    assert all(line["live_bytes"] == sum(line["live_bytes_per_device"].values()) for line in lines)
    # A log that cannot be written fails no call: the sync's change stands, the batch comes back.
    log = Path(worker.config.phase_log)
    moved = log.parent.rename(log.parent.with_name("moved-away"))
    try:
        assert worker.sync_params(params).version == report.version + 1 == worker.weight_version
        assert len(greedy(worker)) == len(PROMPTS)
    finally:
        moved.rename(log.parent)
