"""trainer_bridge/lora.py without an engine: adapter trees checked against a base tree, merged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import EngineTransform
from rollout import counting_compiles
from trainer_bridge import LoraConfig, SyncError, apply_adapters, flatten_params, init_adapters, unflatten_params
from trainer_bridge.lora import (
    adapter_mappings,
    canonical_adapters,
    check_unmerged_targets,
    collect_adapters,
    is_adapter_tree,
    merge_adapters,
)

HIDDEN, KV, INTER, RANK = 8, 4, 12, 2
SHAPES = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN, KV),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.down_proj": (INTER, HIDDEN),
}
TARGETS = ("q_proj", "k_proj", "o_proj", "down_proj")


def base_tree(dtype=np.float32):
    rng = np.random.default_rng(0)
    flat = {"model.norm.scale": np.ones(HIDDEN, dtype)}
    for layer in range(2):
        for module, shape in SHAPES.items():
            flat[f"model.layers_{layer}.{module}.kernel"] = rng.normal(size=shape).astype(dtype)
    return flat


KERNELS = [path for path in base_tree() if path.endswith(".kernel")]


def adapter_tree(names=("lora_a", "lora_b"), rank=RANK):
    rng = np.random.default_rng(1)
    flat = {}
    for path in KERNELS:
        module = path.removesuffix(".kernel")
        in_dim, out_dim = base_tree()[path].shape
        flat[f"{module}.{names[0]}"] = rng.normal(size=(in_dim, rank)).astype(np.float32)
        flat[f"{module}.{names[1]}"] = rng.normal(size=(rank, out_dim)).astype(np.float32)
    return flat


CONFIG = LoraConfig(rank=RANK, alpha=4.0, target_modules=TARGETS)


def deleted(value):
    array = jnp.asarray(value)
    array.delete()
    return array


def merged(adapters, base=None, config=CONFIG):
    base = base_tree() if base is None else base
    return merge_adapters(base, collect_adapters(adapters, base, KERNELS, config), config)


@pytest.mark.parametrize("names", [("lora_a", "lora_b"), ("kernel_lora_a", "kernel_lora_b")], ids=["ours", "qwix"])
def test_each_adapted_kernel_is_served_as_kernel_plus_scaled_a_b(names):
    base, adapters = base_tree(), adapter_tree(names)
    out = merged(adapters, base)
    assert set(out) == set(base)
    assert out["model.norm.scale"] is base["model.norm.scale"], "an unadapted leaf is passed as it is"
    for path in KERNELS:
        module = path.removesuffix(".kernel")
        a, b = adapters[f"{module}.{names[0]}"], adapters[f"{module}.{names[1]}"]
        np.testing.assert_allclose(np.asarray(out[path]), base[path] + 2.0 * a @ b, rtol=1e-6, atol=1e-5)


def test_the_merge_keeps_each_kernels_dtype_and_sharding_and_compiles_once():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "tp"))
    base = {path: jnp.asarray(leaf, jnp.bfloat16) for path, leaf in base_tree().items()}
    base |= {path: jax.device_put(base[path], sharding) for path in KERNELS}
    out = merged(adapter_tree(), base)
    for path in KERNELS:
        assert out[path].dtype == jnp.bfloat16 and out[path].sharding == sharding
        assert out[path] is not base[path]
    with counting_compiles() as compiles:
        merged(adapter_tree(), base)
    assert compiles.value == 0


def drop(flat, suffix):
    return {path: leaf for path, leaf in flat.items() if not path.endswith(suffix)}


@pytest.mark.parametrize(
    "adapters, config, message",
    [
        (
            adapter_tree() | {"model.layers_0.self_attn.q_proj.lora_c": np.zeros((HIDDEN, RANK))},
            CONFIG,
            "'model.layers_0.self_attn.q_proj.lora_c' is not a LoRA factor",
        ),
        (
            drop(adapter_tree(), "layers_1.self_attn.k_proj.lora_b"),
            CONFIG,
            "'model.layers_1.self_attn.k_proj.lora_a' has no lora_b beside it",
        ),
        (
            adapter_tree()
            | {
                "model.layers_0.self_attn.v_proj.lora_a": np.zeros((HIDDEN, RANK)),
                "model.layers_0.self_attn.v_proj.lora_b": np.zeros((RANK, KV)),
            },
            CONFIG,
            "adapts 'model.layers_0.self_attn.v_proj.kernel', which the base tree does not have",
        ),
        (
            adapter_tree(),
            LoraConfig(rank=RANK, alpha=4.0, target_modules=("q_proj", "k_proj", "o_proj")),
            "'model.layers_0.mlp.down_proj.lora_a' adapts 'model.layers_0.mlp.down_proj', which is not in "
            "LoraConfig.target_modules",
        ),
        (
            adapter_tree(rank=3),
            CONFIG,
            "'model.layers_0.mlp.down_proj.lora_a' has shape (12, 3); the kernel 'model.layers_0.mlp.down_proj.kernel' "
            "(12, 8) at rank 2 needs (12, 2)",
        ),
        (
            drop(drop(adapter_tree(), "layers_1.mlp.down_proj.lora_a"), "layers_1.mlp.down_proj.lora_b"),
            CONFIG,
            "no adapter for 'model.layers_1.mlp.down_proj.kernel'",
        ),
        (
            adapter_tree(),
            LoraConfig(rank=RANK, alpha=4.0, target_modules=TARGETS + ("gate_proj",)),
            "LoraConfig.target_modules: 'gate_proj' is not a projection this model has as a kernel",
        ),
        (
            adapter_tree() | {"model.layers_1.self_attn.o_proj.lora_b": np.ones((RANK, HIDDEN), np.int32)},
            CONFIG,
            "'model.layers_1.self_attn.o_proj.lora_b' has dtype int32, expected a floating dtype",
        ),
        (
            adapter_tree() | {"model.layers_0.self_attn.q_proj.lora_a": "weights.npy"},
            CONFIG,
            "'model.layers_0.self_attn.q_proj.lora_a' is a str, expected an array",
        ),
        (
            adapter_tree() | {"model.layers_0.mlp.down_proj.lora_a": deleted(np.zeros((INTER, RANK), np.float32))},
            CONFIG,
            "'model.layers_0.mlp.down_proj.lora_a' has been deleted (donated to a train step?)",
        ),
        (  # a raw JAX TypeError naming no path, once
            adapter_tree() | {"model.layers_1.mlp.up_proj.lora_b": np.zeros((RANK, INTER), ">f4")},
            CONFIG,
            "'model.layers_1.mlp.up_proj.lora_b' has dtype >f4, in the other byte order than this machine's",
        ),
    ],
    ids=[
        "unknown-leaf",
        "a-without-b",
        "no-base-kernel",
        "not-targeted",
        "wrong-rank",
        "missing",
        "no-such-module",
        "integer",
        "not-an-array",
        "deleted",
        "big-endian",
    ],
)
def test_a_bad_adapter_tree_is_a_sync_error_naming_the_path(adapters, config, message):
    with pytest.raises(SyncError) as error:
        merged(adapters, config=config)
    assert message in str(error.value)


QWIX = ("kernel_lora_a", "kernel_lora_b")


@pytest.mark.parametrize(
    "adapters, message",
    [
        (
            drop(adapter_tree(QWIX), "layers_0.self_attn.q_proj.kernel_lora_b"),
            "'model.layers_0.self_attn.q_proj.kernel_lora_a' has no kernel_lora_b beside it",
        ),
        (
            adapter_tree() | {"model.layers_0.self_attn.q_proj.kernel_lora_a": np.zeros((HIDDEN, RANK))},
            "are both the A of 'model.layers_0.self_attn.q_proj'",
        ),
        (
            drop(adapter_tree(), "layers_0.self_attn.q_proj.lora_b")
            | {"model.layers_0.self_attn.q_proj.kernel_lora_b": np.zeros((RANK, HIDDEN))},
            "'model.layers_0.self_attn.q_proj.lora_a' and 'model.layers_0.self_attn.q_proj.kernel_lora_b' are named "
            "in two layouts",
        ),
    ],
    ids=["qwix-a-without-b", "two-names-for-a", "mixed-layouts"],
)
def test_the_layouts_are_not_mixed_within_a_module(adapters, message):
    with pytest.raises(SyncError) as error:
        merged(adapters)
    assert message in str(error.value)


def test_adapters_on_other_devices_than_their_kernels_are_merged_where_the_kernels_are():
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("tp",)), PartitionSpec(None, "tp"))
    base = {path: jax.device_put(leaf, sharding) if path in KERNELS else leaf for path, leaf in base_tree().items()}
    elsewhere = {path: jax.device_put(leaf, jax.devices()[3]) for path, leaf in adapter_tree().items()}
    out = merged(elsewhere, base)
    expected = merged(adapter_tree())
    for path in KERNELS:
        assert out[path].sharding == sharding
        np.testing.assert_allclose(np.asarray(out[path]), np.asarray(expected[path]), rtol=1e-6, atol=1e-6)


def test_kernels_on_several_sets_of_devices_are_merged_each_where_it_is():
    """A jitted program takes its inputs on one set of devices: kernels a trainer keeps on
    several (one on a mesh, one on a device of its own, another mesh in reverse order) were
    refused with JAX's words about argument indices. Each set is merged in a program of its own."""
    devices = jax.devices()
    on_mesh = NamedSharding(Mesh(np.array(devices[:2]), ("tp",)), PartitionSpec(None, "tp"))
    reversed_mesh = NamedSharding(Mesh(np.array(devices[:2][::-1]), ("tp",)), PartitionSpec())
    kernels = sorted(KERNELS)
    places = {kernels[0]: on_mesh, kernels[1]: jax.sharding.SingleDeviceSharding(devices[3])}
    places |= {path: reversed_mesh for path in kernels[2:]}
    base = {path: jax.device_put(leaf, places[path]) if path in places else leaf for path, leaf in base_tree().items()}
    out = merged(adapter_tree(), base)
    expected = merged(adapter_tree())
    for path in KERNELS:
        assert out[path].sharding == places[path], path
        np.testing.assert_allclose(np.asarray(out[path]), np.asarray(expected[path]), rtol=1e-6, atol=1e-6)


def test_lora_config_checks_its_fields():
    for rank in (0, True, 2.0):
        with pytest.raises(ValueError, match="rank must be a positive int"):
            LoraConfig(rank=rank, alpha=1.0)
    for alpha in (0.0, float("inf"), True, "8"):
        with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
            LoraConfig(rank=4, alpha=alpha)
    with pytest.raises(ValueError, match="alpha / rank must be > 0 in float64, got 5e-324 / 4"):
        LoraConfig(rank=4, alpha=5e-324)  # a denormal: the scale would be 0
    for targets in ("q_proj", (), ("q_proj", ""), 5, (name for name in ())):
        with pytest.raises(ValueError, match="target_modules must be a non-empty sequence of names"):
            LoraConfig(rank=4, alpha=8.0, target_modules=targets)
    assert LoraConfig(rank=16, alpha=32.0).scale == 2.0
    # A generator is read once: it had been checked, then stored empty.
    assert LoraConfig(4, 8.0, (name for name in ("v_proj", "q_proj"))).target_modules == ("q_proj", "v_proj")
    # numpy integers (a config read from an array) are ints; the targets are a set.
    config = LoraConfig(rank=np.int64(4), alpha=np.float32(8.0), target_modules=["v_proj", "q_proj"])
    assert config == LoraConfig(4, 8.0, ("q_proj", "v_proj")) and type(config.rank) is int
    assert LoraConfig(4, np.array(8.0)).alpha == LoraConfig(4, jnp.asarray(8.0)).alpha == 8.0  # 0-d arrays


def test_the_trainers_merge_is_the_syncs_and_fresh_adapters_leave_the_base_as_it_is():
    base, adapters = base_tree(), adapter_tree()
    from_sync = merged(adapters, base)
    nested = apply_adapters(unflatten_params(base), unflatten_params(adapters), CONFIG)
    for path, leaf in flatten_params(nested).items():
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(from_sync[path]), rtol=1e-6, atol=1e-6)
    fresh = init_adapters(unflatten_params(base), CONFIG, jax.random.key(0))
    assert sorted(flatten_params(fresh)) == sorted(adapters)
    for path, leaf in flatten_params(apply_adapters(unflatten_params(base), fresh, CONFIG)).items():
        np.testing.assert_array_equal(np.asarray(leaf), base[path])


def test_the_trainers_merge_of_bfloat16_factors_is_the_syncs():
    """Both multiply the factors in float32 (the trainer's multiplied bfloat16 ones in bfloat16)."""
    base = base_tree()
    adapters = {path: jnp.asarray(leaf, jnp.bfloat16) for path, leaf in adapter_tree().items()}
    from_sync = merged(adapters, base)
    nested = apply_adapters(unflatten_params(base), unflatten_params(adapters), CONFIG)
    for path, leaf in flatten_params(nested).items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(from_sync[path]), err_msg=path)


def test_a_loss_through_the_merge_trains_the_adapters():
    base = unflatten_params(base_tree())
    fresh = init_adapters(base, CONFIG, jax.random.key(0))

    def loss(adapters):
        merged_tree = flatten_params(apply_adapters(base, adapters, CONFIG))
        return sum(jnp.sum(leaf**2) for leaf in merged_tree.values())

    grads = flatten_params(jax.grad(loss)(fresh))
    # B starts at zero, so the first gradient reaches B (through A's values), not A.
    assert all(float(jnp.abs(g).max()) > 0 for path, g in grads.items() if path.endswith("lora_b"))
    assert all(float(jnp.abs(g).max()) == 0 for path, g in grads.items() if path.endswith("lora_a"))


# ---- unmerged adapters: their mapping entries, names and the serve flag ------------------------


def qwen_mappings(model_type="qwen2", **config):
    from models import mappings_for

    hf = {"model_type": model_type, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
    hf["hidden_size"] = 8
    hf |= {"tie_word_embeddings": False, **config}
    return mappings_for(hf)


def test_unmerged_adapters_map_beside_each_targeted_linear_weight_and_b_repeats_kv_heads_as_its_kernel():
    entries = {m.trainer: m for m in adapter_mappings(qwen_mappings(), LoraConfig(4, 8.0, ("k_proj", "o_proj")))}
    assert sorted(entries) == sorted(
        f"model.layers_{layer}.self_attn.{proj}.lora_{f}"
        for layer in (0, 1)
        for proj in ("k_proj", "o_proj")
        for f in "ab"
    )
    k_a, k_b = (entries[f"model.layers_1.self_attn.k_proj.lora_{f}"] for f in "ab")
    assert (k_a.engine, k_b.engine) == tuple(f"transformer.layers.1.self_attn.k_proj.lora_{f}" for f in "ab")
    assert k_a.engine_transform is EngineTransform.IDENTITY
    assert k_b.engine_transform is EngineTransform.REPEAT_KV_HEADS
    assert entries["model.layers_0.self_attn.o_proj.lora_b"].engine_transform is EngineTransform.IDENTITY


def test_moe_adapters_follow_the_tables_engine_names_and_leave_the_experts_out():
    mappings = qwen_mappings("qwen3_moe", num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0])
    entries = {m.trainer: m.engine for m in adapter_mappings(mappings, LoraConfig(4, 8.0))}
    assert entries["model.layers_1.self_attn.o_proj.lora_a"] == "transformer.layers.1.self_attn.c_proj.lora_a"
    assert "model.layers_0.mlp.gate_proj.lora_a" in entries  # layer 0's dense MLP
    assert not any(path.startswith("model.layers_1.mlp.") for path in entries)  # stacked experts


def test_unmerged_targets_the_engine_cannot_adapt_are_refused_by_name():
    mappings = qwen_mappings()
    check_unmerged_targets(mappings, LoraConfig(4, 8.0))
    with pytest.raises(ValueError, match=r"\['lm_head', 'w1'\] name no projection .* \(those it has: \['down_proj'"):
        check_unmerged_targets(mappings, LoraConfig(4, 8.0, ("q_proj", "lm_head", "w1")))


def test_adapter_trees_are_told_apart_and_take_one_naming():
    qwix = adapter_tree(("kernel_lora_a", "kernel_lora_b"))
    assert is_adapter_tree(qwix) and is_adapter_tree(adapter_tree())
    assert not is_adapter_tree({**qwix, "model.norm.scale": 0}) and not is_adapter_tree({})
    canonical = canonical_adapters(qwix)
    assert canonical.keys() == adapter_tree().keys()
    assert all(canonical[p.replace("kernel_lora_", "lora_")] is leaf for p, leaf in qwix.items())


def test_the_serve_flag_reads_rank_alpha_and_modules(tmp_path):
    from rollout.serve import parse_args

    def unmerged(flag):
        return parse_args(["--model-path", str(tmp_path), "--unmerged-lora", flag])[0].unmerged_lora

    assert unmerged("16,32") == LoraConfig(16, 32.0)
    assert unmerged("8,16,q_proj,v_proj") == LoraConfig(8, 16.0, ("q_proj", "v_proj"))
    for bad in ("16", "16,32,"):
        with pytest.raises(SystemExit):
            unmerged(bad)


def test_one_factor_in_both_layouts_is_refused_by_name():
    both = {"m.q_proj.lora_a": 0, "m.q_proj.kernel_lora_a": 1}
    with pytest.raises(SyncError, match="'m.q_proj.kernel_lora_a' and 'm.q_proj.lora_a' are both the A of 'm.q_proj'"):
        canonical_adapters(both)


def test_each_token_gets_its_requests_adapter_slot_in_the_forwards_layout():
    """write_token_slots: a prefill's requests' new tokens one after another, a decode's one
    per request, the padding and unknown requests on the default slot 0."""
    from types import SimpleNamespace

    from rollout.engine.lora import write_token_slots

    def runner_with(leaves):
        model_state_leaves = leaves

        def run_model_wrapper():
            return model_state_leaves

        return SimpleNamespace(jitted_run_model=run_model_wrapper)

    leaves = [jnp.zeros(3), jnp.zeros(10, jnp.int32)]
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner_with(leaves))))
    reqs = [SimpleNamespace(rid=rid) for rid in ("a", "b", "c")]
    slots = {"a": 2, "c": 1}
    extend = SimpleNamespace(reqs=reqs, extend_lens=[3, 2, 1], forward_mode=SimpleNamespace(is_extend=lambda: True))
    write_token_slots(scheduler, extend, slots, 1)
    assert leaves[1].tolist() == [2, 2, 2, 0, 0, 1, 0, 0, 0, 0]
    decode = SimpleNamespace(reqs=reqs, extend_lens=None, forward_mode=SimpleNamespace(is_extend=lambda: False))
    write_token_slots(scheduler, decode, slots, 1)
    assert leaves[1].tolist() == [2, 0, 1, 0, 0, 0, 0, 0, 0, 0]


def test_an_adapter_on_an_moes_stacked_experts_is_refused_naming_them():
    """An MoE keeps its experts' projections stacked, as '<module>' with no kernel: the message
    had said the base tree had no '<module>.kernel', as if the module were missing."""
    base = base_tree()
    experts = np.zeros((4, *base["model.layers_1.mlp.down_proj.kernel"].shape), np.float32)
    base = {path: leaf for path, leaf in base.items() if path != "model.layers_1.mlp.down_proj.kernel"}
    base["model.layers_1.mlp.down_proj"] = experts
    with pytest.raises(SyncError) as error:
        merged(adapter_tree(), base)
    assert (
        f"adapters: 'model.layers_1.mlp.down_proj.lora_a' adapts 'model.layers_1.mlp.down_proj', an array of shape "
        f"{experts.shape} in the base tree, not a '<module>.kernel' projection: an MoE's stacked experts take no "
        "adapters"
    ) in str(error.value)
