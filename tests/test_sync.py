"""sync_params: parity with the Flax trainer model, zero copy, no recompiles, validation."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import CausalLM, DecoderConfig, greedy_decode
from rollout import InvalidRequest, RolloutWorker
from tests.helpers import tiny_worker_config
from trainer_bridge import LoraConfig, SyncError, flatten_params, load_hf_params, non_finite_leaves, unflatten_params

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11], [1], [64, 65, 66], [300, 2, 4], [9] * 7, [12, 34]]
REPO = Path(__file__).resolve().parents[1]


def engine_placed(worker, flat):
    """The trainer tree placed exactly as the engine places each leaf (the aliasable case)."""
    specs = {leaf.path: leaf for leaf in worker.leaves}
    return {m.trainer: jax.device_put(flat[m.trainer], specs[m.engine].sharding) for m in worker.mappings}


def expected_engine_leaf(entry, trainer, engine_shape, head_dim):
    x = np.asarray(trainer)
    if entry.engine_transform.value == "transpose":
        x = x.T
    if entry.engine_transform.value == "repeat_kv_heads" and x.shape[-1] != engine_shape[-1]:
        heads = x.shape[-1] // head_dim
        repeat = engine_shape[-1] // x.shape[-1]
        x = np.repeat(x.reshape(*x.shape[:-1], heads, head_dim), repeat, axis=-2).reshape(engine_shape)
    return x


@pytest.mark.parametrize(
    "model_fixture, tp_size",
    [("qwen2_dir", 2), ("qwen2_untied_dir", 1), ("qwen3_dir", 1)],
    ids=["qwen2-tied-bias-gqa-tp2", "qwen2-untied", "qwen3-qknorm-mha"],
)
def test_synced_engine_matches_flax_greedy_decode(request, model_fixture, tp_size):
    model_dir = request.getfixturevalue(model_fixture)
    params = load_hf_params(model_dir)
    reference = greedy_decode(CausalLM(DecoderConfig.from_hf(model_dir)), params, PROMPTS, 32)
    config = tiny_worker_config(model_dir, load_format="dummy", tp_size=tp_size)
    with RolloutWorker(config) as worker:
        before = worker.generate(PROMPTS, temperature=0.0, max_new_tokens=32, ignore_eos=True)
        assert before.completions != reference, "dummy weights must not already give the answer"
        report = worker.sync_params(params)
        batch = worker.generate(PROMPTS, temperature=0.0, max_new_tokens=32, ignore_eos=True)
        assert batch.weight_version == report.version == 1
        assert batch.completions == reference
        # Host (numpy) params: every engine leaf was written, and the report counts those bytes.
        flat = flatten_params(params)
        leaves = worker.engine.weight_leaves()
        by_path = {leaf.path: leaf for leaf in worker.leaves}
        written = [leaves[by_path[m.engine].index] for m in worker.mappings]
        assert (report.leaves_copied, report.leaves_aliased, report.bytes_aliased) == (len(written), 0, 0)
        assert report.bytes_copied == sum(x.nbytes for x in written)
        # The engine's leaves are exactly the transformed trainer leaves.
        for entry in worker.mappings:
            spec = by_path[entry.engine]
            expected = expected_engine_leaf(entry, flat[entry.trainer], spec.shape, worker.head_dim)
            np.testing.assert_array_equal(np.asarray(leaves[spec.index]), expected, err_msg=entry.trainer)


@pytest.fixture(scope="module")
def tp_worker(qwen2_dir):
    """A dummy-booted tensor-parallel engine (tp=2 on 4 devices: KV heads are repeated)."""
    with RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy", tp_size=2)) as worker:
        yield worker


@pytest.fixture(scope="module")
def hf_flat(qwen2_dir):
    return flatten_params(load_hf_params(qwen2_dir))


def greedy(worker):
    return worker.generate(PROMPTS[:4], temperature=0.0, max_new_tokens=12, ignore_eos=True)


def test_aliasable_tree_moves_zero_bytes_and_shares_buffers(tp_worker, hf_flat):
    placed = engine_placed(tp_worker, hf_flat)
    report = tp_worker.sync_params(unflatten_params(placed))
    # k/v projections must be head-repeated for tp=2 > 1 KV head: those 4 leaves per layer copy.
    repeated = [m for m in tp_worker.mappings if m.engine_transform.value == "repeat_kv_heads"]
    assert report.leaves_copied == len(repeated) > 0
    assert report.leaves_relabeled == 0
    leaves = tp_worker.engine.weight_leaves()
    by_path = {leaf.path: leaf for leaf in tp_worker.leaves}
    # Bytes counted from the arrays themselves: the trainer's for aliased leaves, the engine's
    # (KV heads repeated: twice the trainer's) for copied ones.
    assert report.bytes_aliased == sum(placed[m.trainer].nbytes for m in tp_worker.mappings if m not in repeated)
    assert report.bytes_copied == sum(leaves[by_path[m.engine].index].nbytes for m in repeated)
    assert report.bytes_copied == 2 * sum(placed[m.trainer].nbytes for m in repeated)
    for entry in tp_worker.mappings:
        if entry in repeated:
            continue
        engine_leaf = leaves[by_path[entry.engine].index]
        assert engine_leaf is placed[entry.trainer]
        pointers = [s.data.unsafe_buffer_pointer() for s in engine_leaf.addressable_shards]
        assert pointers == [s.data.unsafe_buffer_pointer() for s in placed[entry.trainer].addressable_shards]


def test_no_recompilation_after_sync(tp_worker, hf_flat):
    def sampled():
        return tp_worker.generate(PROMPTS[:4], temperature=1.0, max_new_tokens=12, ignore_eos=True)

    # Both calls' programs compiled before the first sync (the sampler's draw compiles on first
    # use: alone, this module would otherwise count it).
    greedy(tp_worker)
    sampled()
    scaled = {k: v * 1.01 for k, v in hf_flat.items()}
    for tree in (scaled, hf_flat, engine_placed(tp_worker, hf_flat)):
        tp_worker.sync_params(unflatten_params(tree))
        assert sampled().compiles == 0
        assert greedy(tp_worker).compiles == 0


def test_same_layout_other_mesh_is_relabeled_without_copy(tp_worker, hf_flat):
    """A trainer mesh with its own axis names but the engine's device layout: zero copy."""
    engine_mesh = tp_worker.engine.mesh
    trainer_mesh = Mesh(
        engine_mesh.devices.reshape(engine_mesh.shape["data"], engine_mesh.shape["tensor"]), ("fsdp", "model")
    )
    specs = {leaf.path: leaf for leaf in tp_worker.leaves}
    rename = {"data": "fsdp", "tensor": "model", None: None}
    placed = {}
    for m in tp_worker.mappings:
        spec = specs[m.engine].sharding.spec
        trainer_spec = P(*(rename[a] for a in spec)) if spec else P()
        placed[m.trainer] = jax.device_put(hf_flat[m.trainer], NamedSharding(trainer_mesh, trainer_spec))
    report = tp_worker.sync_params(unflatten_params(placed))
    relabeled = len(tp_worker.mappings) - report.leaves_copied
    assert report.leaves_relabeled == relabeled > 0 and report.leaves_aliased == relabeled
    leaves = tp_worker.engine.weight_leaves()
    entry = next(m for m in tp_worker.mappings if m.trainer.endswith("mlp.up_proj.kernel"))
    engine_leaf = leaves[specs[entry.engine].index]
    assert engine_leaf.sharding == specs[entry.engine].sharding
    assert {s.data.unsafe_buffer_pointer() for s in engine_leaf.addressable_shards} == {
        s.data.unsafe_buffer_pointer() for s in placed[entry.trainer].addressable_shards
    }
    assert greedy(tp_worker).compiles == 0


def test_mismatched_sharding_is_resharded_correctly(tp_worker, hf_flat, qwen2_dir):
    reference = greedy_decode(CausalLM(DecoderConfig.from_hf(qwen2_dir)), unflatten_params(hf_flat), PROMPTS[:4], 12)
    devices = np.array(jax.devices())
    row_mesh = Mesh(devices, ("rows",))
    # Shard every matrix by rows over 4 devices: the engine wants columns over 2 (or replication).
    placed = {
        k: jax.device_put(v, NamedSharding(row_mesh, P("rows") if v.ndim == 2 and v.shape[0] % 4 == 0 else P()))
        for k, v in hf_flat.items()
    }
    report = tp_worker.sync_params(unflatten_params(placed))
    assert report.leaves_resharded > 0 and report.bytes_copied > 0
    assert greedy(tp_worker).completions == reference


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (
            lambda f: {k: v for k, v in f.items() if not k.endswith("layers_1.mlp.up_proj.kernel")},
            r"missing 1 expected path\(s\): model\.layers_1\.mlp\.up_proj\.kernel",
        ),
        (
            lambda f: {**f, "model.layers_0.mlp.extra.kernel": f["model.norm.scale"]},
            r"unexpected path\(s\): model\.layers_0\.mlp\.extra\.kernel",
        ),
        (
            lambda f: {
                **f,
                "model.layers_0.self_attn.q_proj.kernel": f["model.layers_0.self_attn.q_proj.kernel"][:, :128],
            },
            r"'model\.layers_0\.self_attn\.q_proj\.kernel' has shape \(256, 128\), expected \(256, 256\)",
        ),
        (  # two KV heads where the model has one: the engine's tp=2 repeats it to that width
            lambda f: {
                **f,
                "model.layers_0.self_attn.k_proj.kernel": np.tile(f["model.layers_0.self_attn.k_proj.kernel"], (1, 2)),
            },
            r"'model\.layers_0\.self_attn\.k_proj\.kernel' has shape \(256, 256\), expected \(256, 128\)",
        ),
        (
            lambda f: {**f, "model.norm.scale": f["model.norm.scale"].astype(np.int32)},
            r"'model\.norm\.scale' has dtype int32, expected a floating dtype",
        ),
        (
            lambda f: {
                **f,
                "model.layers_1.input_layernorm.scale": np.full_like(f["model.layers_1.input_layernorm.scale"], np.nan),
            },
            r"non-finite values \(nan/inf\) in: model\.layers_1\.input_layernorm\.scale",
        ),
        (  # finite in the tree's float64, infinite in the engine's float32
            lambda f: {**f, "model.norm.scale": np.full(f["model.norm.scale"].shape, 1e300)},
            r"values beyond float32's range \(\|x\| > 3.40282e\+38\), finite in the tree, .* in: model\.norm\.scale$",
        ),
        (  # JAX takes no big-endian array (it failed as a TypeError naming an argument index)
            lambda f: {**f, "model.norm.scale": f["model.norm.scale"].astype(">f4")},
            r"'model\.norm\.scale' has dtype >f4, in the other byte order .* pass leaf\.astype\('<f4'\)",
        ),
    ],
    ids=["missing", "extra", "shape", "kv-heads", "dtype", "non-finite", "overflow", "byte-order"],
)
def test_bad_trees_fail_cleanly_and_old_weights_keep_serving(tp_worker, hf_flat, corrupt, message):
    tp_worker.sync_params(unflatten_params(hf_flat))
    before, version = greedy(tp_worker).completions, tp_worker.weight_version
    with pytest.raises(SyncError, match=message):
        tp_worker.sync_params(unflatten_params(corrupt(dict(hf_flat))), check_finite=True)
    assert tp_worker.weight_version == version
    assert greedy(tp_worker).completions == before


def test_a_sync_labels_its_weights_with_the_version_asked_for(tp_worker, hf_flat):
    """A trainer's step as the version: a resumed run's tokens carry the versions the
    uninterrupted run's would. A version at or below the served one is refused (tokens'
    versions only grow) and changes nothing."""
    tree = unflatten_params(hf_flat)
    served = tp_worker.sync_params(tree).version
    assert tp_worker.sync_params(tree, version=served + 40).version == served + 40
    batch = greedy(tp_worker)
    assert batch.weight_version == served + 40 and set(batch.token_versions[batch.completion_mask].tolist()) == {
        served + 40
    }
    assert tp_worker.sync_params(tree).version == served + 41  # then one more, as without
    assert tp_worker.sync_params(tree, version=np.int64(served + 50)).version == served + 50
    above = rf"must be an int above the version served \({served + 50}\)"
    for bad in (served + 50, served, True, 60.0, "61"):
        with pytest.raises(SyncError, match=rf"version={bad!r}: {above}"):
            tp_worker.sync_params(tree, version=bad)
    assert tp_worker.weight_version == served + 50 and greedy(tp_worker).completions == batch.completions


def test_weakly_typed_and_host_memory_leaves_sync_without_a_recompile_or_a_raw_error(tp_worker, hf_flat):
    """A weakly typed leaf in the engine's placement (``jnp.full(shape, 1.0)``) is served through
    its own buffers, as a strongly typed array: aliased as it was, the engine's forward compiled
    again for it. A leaf in host memory (offloaded params) is copied to the device: taken as it
    was (the same slices), the sync failed as a raw ValueError, or at jax 0.8 an XLA error."""
    placed = engine_placed(tp_worker, hf_flat)
    path = "model.norm.scale"
    sharding = placed[path].sharding
    engine_index = {leaf.path: leaf.index for leaf in tp_worker.leaves}[
        next(m.engine for m in tp_worker.mappings if m.trainer == path)
    ]
    ones = {**placed, path: jax.device_put(np.ones(placed[path].shape, np.float32), sharding)}
    tp_worker.sync_params(unflatten_params(ones))
    expected = greedy(tp_worker).completions
    weak = jax.device_put(jnp.full(placed[path].shape, 1.0), sharding)
    assert weak.weak_type and weak.sharding == sharding
    report = tp_worker.sync_params(unflatten_params({**ones, path: weak}))
    assert report.leaves_relabeled == 1
    served = tp_worker.engine.weight_leaves()[engine_index]
    assert not served.weak_type
    assert [s.data.unsafe_buffer_pointer() for s in served.addressable_shards] == [
        s.data.unsafe_buffer_pointer() for s in weak.addressable_shards
    ]
    after = greedy(tp_worker)
    assert after.compiles == 0 and after.completions == expected

    tp_worker.sync_params(unflatten_params(placed))
    expected = greedy(tp_worker).completions
    for spec in (sharding.spec, P()):
        host = jax.device_put(placed[path], NamedSharding(sharding.mesh, spec, memory_kind="pinned_host"))
        tp_worker.sync_params(unflatten_params({**placed, path: host}))
        assert tp_worker.engine.weight_leaves()[engine_index].sharding.memory_kind == sharding.memory_kind
        after = greedy(tp_worker)
        assert after.compiles == 0 and after.completions == expected, spec


def test_the_finiteness_check_finds_nan_and_inf_but_not_a_sum_that_overflows():
    big = np.finfo(np.float32).max
    leaves = [
        jnp.full((64, 8), big, jnp.float32),  # finite, yet its float32 sum is inf
        jnp.ones((64, 8), jnp.float32).at[3, 5].set(jnp.inf),
        jnp.ones((7,), jnp.float32).at[6].set(jnp.nan),
        jnp.full((16, 4), -jnp.finfo(jnp.bfloat16).max, jnp.bfloat16),
        jnp.ones((16, 4), jnp.bfloat16).at[0, 0].set(-jnp.inf),
        jnp.ones((16, 4), jnp.float32).at[0, 0].set(jnp.inf).at[1, 1].set(-jnp.inf),  # sums to nan
    ]
    for one_call in (True, False):
        assert non_finite_leaves(leaves, one_call=one_call) == [1, 2, 4, 5]
        assert non_finite_leaves(leaves[:1] + leaves[3:4] + [jnp.arange(5)], one_call=one_call) == []
    assert non_finite_leaves([]) == []


def test_duplicate_and_malformed_trees(tp_worker, hf_flat):
    version = tp_worker.weight_version
    tree = unflatten_params(hf_flat)
    tree["model.norm"] = {"scale": hf_flat["model.norm.scale"]}
    with pytest.raises(SyncError, match=r"path 'model\.norm\.scale' appears twice"):
        tp_worker.sync_params(tree)
    tree = unflatten_params(hf_flat)
    tree["model"]["layers_0"]["mlp"] = [hf_flat["model.layers_0.mlp.up_proj.kernel"]]
    with pytest.raises(SyncError, match=r"'model\.layers_0\.mlp' is a list"):
        tp_worker.sync_params(tree)
    assert tp_worker.weight_version == version


@pytest.mark.parametrize(
    "wrap, message",
    [
        (
            lambda t: {"params": {"params": t}},
            r"its top-level keys are \['params'\], the model's are \['model'\]; "
            r"the params are under 'params': pass tree\['params'\]",
        ),
        (
            lambda t: {"params": t, "opt_state": {"mu": t}},
            r"its top-level keys are \['opt_state', 'params'\], the model's are \['model'\]; "
            r"the params are under 'params': pass tree\['params'\]",
        ),
    ],
    ids=["wrapped-twice", "train-state"],
)
def test_wrapped_trees_name_the_keys_found_and_what_to_pass(tp_worker, hf_flat, wrap, message):
    version = tp_worker.weight_version
    with pytest.raises(SyncError, match=message):
        tp_worker.sync_params(wrap(unflatten_params(hf_flat)))
    assert tp_worker.weight_version == version


@pytest.mark.parametrize(
    "leaf, message",
    [
        (None, r"'model\.norm\.scale' is NoneType None; expected an array"),
        ("weights.bin", r"'model\.norm\.scale' is str 'weights\.bin'; expected an array"),
        (
            jax.ShapeDtypeStruct((256,), jnp.float32),
            r"'model\.norm\.scale' is a jax\.ShapeDtypeStruct \(256,\) float32: a shape without values",
        ),
    ],
    ids=["none", "string", "shape-dtype-struct"],
)
def test_leaves_that_are_not_arrays_are_named(tp_worker, hf_flat, leaf, message):
    version = tp_worker.weight_version
    with pytest.raises(SyncError, match=message):
        tp_worker.sync_params(unflatten_params({**hf_flat, "model.norm.scale": leaf}))
    assert tp_worker.weight_version == version


def test_cast_refused_when_disabled(tp_worker, hf_flat):
    bf16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in hf_flat.items()}
    version = tp_worker.weight_version
    with pytest.raises(SyncError, match=r"'model\.\S+' has dtype bfloat16, expected float32 \(casting is disabled\)"):
        tp_worker.sync_params(unflatten_params(bf16), allow_cast=False)
    assert tp_worker.weight_version == version


def test_trees_on_the_engines_devices_in_another_order_or_on_several_sets_sync_exactly(tp_worker, hf_flat):
    tp_worker.sync_params(unflatten_params(hf_flat))
    expected = greedy(tp_worker).completions
    engine_mesh = tp_worker.engine.mesh
    backwards = Mesh(engine_mesh.devices.reshape(-1)[::-1].reshape(engine_mesh.devices.shape), engine_mesh.axis_names)
    placed = engine_placed(tp_worker, hf_flat)
    outside = Mesh(np.array([d for d in jax.devices() if d not in set(engine_mesh.devices.flat)]), ("outside",))
    trees = {
        # The engine's specs on its devices in the reverse order: a jitted copy takes one order.
        "reversed": {p: jax.device_put(x, NamedSharding(backwards, x.sharding.spec)) for p, x in placed.items()},
        # One leaf on one engine device, one on the other devices: the finiteness check's sums
        # cannot be one call.
        "scattered": placed
        | {
            "model.norm.scale": jax.device_put(hf_flat["model.norm.scale"], jax.devices()[0]),
            "model.layers_1.mlp.up_proj.kernel": jax.device_put(
                hf_flat["model.layers_1.mlp.up_proj.kernel"], NamedSharding(outside, P())
            ),
        },
    }
    silenced = unflatten_params(hf_flat | {"model.norm.scale": np.zeros_like(hf_flat["model.norm.scale"])})
    for name, tree in trees.items():
        tp_worker.sync_params(silenced)
        assert greedy(tp_worker).completions != expected, name
        tp_worker.sync_params(unflatten_params(tree), check_finite=True)
        assert greedy(tp_worker).completions == expected, name
        assert tp_worker.sync_memory_analysis(unflatten_params(tree)).output_size_in_bytes > 0, name


def test_deleted_and_donated_buffers(tp_worker, hf_flat):
    tp_worker.sync_params(unflatten_params(hf_flat))
    before = greedy(tp_worker).completions
    placed = engine_placed(tp_worker, hf_flat)
    dead = dict(placed)
    dead["model.norm.scale"] = jnp.array(placed["model.norm.scale"])
    dead["model.norm.scale"].delete()
    with pytest.raises(SyncError, match=r"'model\.norm\.scale' has been deleted"):
        tp_worker.sync_params(unflatten_params(dead))
    assert greedy(tp_worker).completions == before
    # A deleted leaf placed elsewhere: it was read before it was checked (a bare RuntimeError).
    elsewhere = dict(hf_flat)
    elsewhere["model.layers_1.mlp.up_proj.kernel"] = jax.device_put(hf_flat["model.layers_1.mlp.up_proj.kernel"])
    elsewhere["model.layers_1.mlp.up_proj.kernel"].delete()
    with pytest.raises(SyncError, match=r"'model\.layers_1\.mlp\.up_proj\.kernel' has been deleted"):
        tp_worker.sync_params(unflatten_params(elsewhere))
    with pytest.raises(SyncError, match=r"'model\.layers_1\.mlp\.up_proj\.kernel' has been deleted"):
        tp_worker.check_params(unflatten_params(elsewhere))
    assert greedy(tp_worker).completions == before
    # The engine serves the trainer's own buffers; the trainer then donates them.
    tp_worker.sync_params(unflatten_params(placed))
    placed["model.layers_0.mlp.up_proj.kernel"].delete()
    with pytest.raises(RuntimeError, match=r"Call worker\.sync_params\(params\) before generate"):
        greedy(tp_worker)
    tp_worker.sync_params(unflatten_params(hf_flat))
    assert greedy(tp_worker).completions == before


def test_float32_trainer_into_bfloat16_engine(qwen3_dir):
    params = load_hf_params(qwen3_dir)
    with RolloutWorker(tiny_worker_config(qwen3_dir, load_format="dummy", dtype="bfloat16")) as worker:
        report = worker.sync_params(params)
        assert report.leaves_copied == len(worker.mappings) and report.leaves_aliased == 0
        # The cast writes the engine's bytes (replicated: every device holds them all) plus the
        # output tuple's pointer table, and needs no temporaries.
        memory = worker.sync_memory_analysis(params)
        assert 0 <= memory.output_size_in_bytes - report.bytes_copied <= 8 * report.leaves_copied
        assert memory.temp_size_in_bytes == 0
        flat = flatten_params(params)
        leaves = worker.engine.weight_leaves()
        for leaf in worker.leaves:
            if leaf.path == "transformer.norm.scale":
                np.testing.assert_array_equal(
                    np.asarray(leaves[leaf.index]), np.asarray(jnp.asarray(flat["model.norm.scale"], jnp.bfloat16))
                )
        before = worker.generate(PROMPTS[:2], temperature=0.0, max_new_tokens=4)
        assert before.size == 2
        # At tp=1 param_shardings() gives P(None, 'tensor') over a 1-device 'tensor' axis, which
        # a jitted train step returns as P(): the same placement, the same plan (the copy compiled).
        placed = jax.device_put(params, worker.param_shardings())
        worker.sync_params(placed)
        stepped = jax.jit(lambda tree: jax.tree.map(lambda x: x * 1.0, tree))(placed)
        given = flatten_params(placed)
        respelled = [path for path, leaf in flatten_params(stepped).items() if leaf.sharding != given[path].sharding]
        assert respelled, "the test's premise: jit respells the shardings"
        assert worker.sync_params(stepped).compiles == 0
        # float32's largest value is finite in the tree and infinite in bfloat16: refused, the
        # previous weights keep serving.
        path = "model.layers_1.mlp.gate_proj.kernel"
        huge = {**flat, path: np.asarray(flat[path]).copy()}
        huge[path][0, 0] = np.finfo(np.float32).max
        version = worker.weight_version
        with pytest.raises(SyncError, match=rf"values beyond bfloat16's range .* in: {re.escape(path)}$"):
            worker.sync_params(unflatten_params(huge))
        assert worker.weight_version == version
        assert worker.generate(PROMPTS[:2], temperature=0.0, max_new_tokens=4).completions == before.completions


def test_zero_copy_on_a_single_device(qwen2_dir):
    """The same aliasing check in a process with one CPU device (the engine's mesh is 1x1)."""
    script = textwrap.dedent(f"""
        import os
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        import jax
        from rollout import RolloutWorker
        from tests.helpers import tiny_worker_config
        from trainer_bridge import flatten_params, load_hf_params, unflatten_params
        assert jax.device_count() == 1
        flat = flatten_params(load_hf_params({str(qwen2_dir)!r}))
        placed = {{k: jax.device_put(v) for k, v in flat.items()}}
        with RolloutWorker(tiny_worker_config({str(qwen2_dir)!r}, load_format="dummy")) as worker:
            before = worker.generate([[5, 17, 42]], temperature=0.0, max_new_tokens=8).completions
            report = worker.sync_params(unflatten_params(placed))
            assert report.bytes_copied == 0 and report.leaves_copied == 0, report
            assert report.leaves_aliased == len(worker.mappings), report
            leaves = worker.engine.weight_leaves()
            pointers = {{l.unsafe_buffer_pointer() for l in leaves}}
            assert all(v.unsafe_buffer_pointer() in pointers for v in placed.values())
            after = worker.generate([[5, 17, 42]], temperature=0.0, max_new_tokens=8)
            assert after.compiles == 0 and after.weight_version == 1
        print("single-device zero copy ok")
    """)
    # Run from the repository root (stdin script: its directory is on sys.path).
    result = subprocess.run([sys.executable, "-"], input=script, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "single-device zero copy ok" in result.stdout


def test_param_shardings_give_zero_copy_except_repeated_kv_heads(tp_worker, hf_flat):
    placed = jax.device_put(unflatten_params(hf_flat), tp_worker.param_shardings())
    report = tp_worker.sync_params(placed)
    repeated = [m for m in tp_worker.mappings if m.engine_transform.value == "repeat_kv_heads"]
    assert report.leaves_copied == len(repeated)
    flat = flatten_params(placed)
    leaves = tp_worker.engine.weight_leaves()
    by_path = {leaf.path: leaf for leaf in tp_worker.leaves}
    for m in tp_worker.mappings:
        if m not in repeated:
            assert leaves[by_path[m.engine].index] is flat[m.trainer], m.trainer
    assert report.bytes_aliased == sum(flat[m.trainer].nbytes for m in tp_worker.mappings if m not in repeated)
    assert greedy(tp_worker).compiles == 0


def test_a_train_steps_output_syncs_as_the_tree_it_was_given_and_compiles_nothing(tp_worker, hf_flat):
    """A jitted train step returns the placement ``param_shardings()`` gave spelled jit's way
    (``P()`` for ``P(None, None)``, ``P('tensor')`` for ``P('tensor', None)``): the same plan
    syncs it (the copy compiled once), its aliased leaves wrapped in the engine's shardings."""
    greedy(tp_worker)  # compiled before the syncs (alone, this test would otherwise count it)
    placed = jax.device_put(unflatten_params(hf_flat), tp_worker.param_shardings())
    first = tp_worker.sync_params(placed)
    stepped = flatten_params(jax.jit(lambda tree: jax.tree.map(lambda x: x * 2.0, tree))(placed))
    before = flatten_params(placed)
    repeated = {m.trainer for m in tp_worker.mappings if m.engine_transform.value == "repeat_kv_heads"}
    respelled = [path for path, leaf in stepped.items() if leaf.sharding != before[path].sharding]
    assert set(respelled) - repeated, "the test's premise: jit respells some aliased leaves' shardings"
    report = tp_worker.sync_params(unflatten_params(stepped))
    assert report.compiles == 0
    assert (report.leaves_aliased, report.leaves_copied, report.bytes_copied) == (
        first.leaves_aliased,
        first.leaves_copied,
        first.bytes_copied,
    )
    assert report.leaves_relabeled == len(set(respelled) - repeated)
    leaves = tp_worker.engine.weight_leaves()
    specs = {leaf.path: leaf for leaf in tp_worker.leaves}
    for m in tp_worker.mappings:
        served, spec = leaves[specs[m.engine].index], specs[m.engine]
        assert served.sharding == spec.sharding, m.trainer
        np.testing.assert_array_equal(
            np.asarray(served), expected_engine_leaf(m, stepped[m.trainer], spec.shape, tp_worker.head_dim)
        )
    assert greedy(tp_worker).compiles == 0
    tp_worker.sync_params(placed)


def test_a_weight_calls_flags_are_bools(tp_worker, hf_flat, qwen2_dir, tmp_path):
    """A flag taken by its truth value chose silently: check_finite=None served NaN weights
    unchecked, in_flight="no" swapped in flight. Any flag not a bool is an InvalidRequest naming it."""
    tree = unflatten_params(hf_flat)
    tp_worker.sync_params(tree)
    before, version = greedy(tp_worker).completions, tp_worker.weight_version
    nan = unflatten_params({**hf_flat, "model.norm.scale": np.full_like(hf_flat["model.norm.scale"], np.nan)})
    for flag, value in (("check_finite", None), ("allow_cast", "no"), ("in_flight", "no"), ("recompute_kv", 0)):
        with pytest.raises(InvalidRequest, match=rf"^{flag} must be a bool, got {re.escape(repr(value))}") as bad:
            tp_worker.sync_params(nan, **{flag: value})
        assert bad.value.field == flag
    with pytest.raises(InvalidRequest, match="^check_finite must be a bool, got None"):
        tp_worker.load_hf(qwen2_dir, check_finite=None)
    with pytest.raises(InvalidRequest, match="^check_finite must be a bool, got 0"):
        tp_worker.load_checkpoint(tmp_path / "never-read", check_finite=0)
    with pytest.raises(InvalidRequest, match="^in_flight must be a bool, got 'yes'"):
        tp_worker.perturb_weights(0, 0.1, 1, in_flight="yes")
    assert tp_worker.weight_version == version and greedy(tp_worker).completions == before
    assert tp_worker.sync_params(tree, check_finite=np.bool_(True)).version == version + 1


def test_adapters_without_lora_and_lora_without_adapters_are_named(tp_worker, hf_flat):
    tree, version = unflatten_params(hf_flat), tp_worker.weight_version
    with pytest.raises(InvalidRequest, match="adapters and lora .* go together; lora is missing") as no_lora:
        tp_worker.sync_params(tree, adapters={})
    assert no_lora.value.field == "lora"
    with pytest.raises(InvalidRequest, match="adapters is missing") as no_adapters:
        tp_worker.sync_params(tree, lora=LoraConfig(4, 8.0))
    assert no_adapters.value.field == "adapters" and tp_worker.weight_version == version
