"""Unmerged LoRA on one engine (Qwen2, tp 2, one KV head repeated): adapters alone synced, loaded
from orbax checkpoints and over HTTP, refused when bad; the merged mode and every family are in
tests/test_families.py, the adapter tables and names in tests/unit/test_lora.py."""

import asyncio
import gc
import json
import re
import threading
import weakref

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import rollout.engine.runtime
import trainer_bridge.sync
from models import flax_model_for, greedy_decode
from rollout import RolloutWorker
from rollout.errors import InvalidRequest
from tests.helpers import admitted_together, tiny_worker_config
from trainer_bridge import LoraConfig, SyncError, flatten_params, load_hf_params, unflatten_params

PROMPTS = [[5, 17, 42, 8, 100, 3], [100, 3], [12, 34, 56]]
NEW_TOKENS = 8
CONFIG = LoraConfig(rank=4, alpha=8.0)
LOGPROB_ATOL = 1e-4  # fp32 engine vs fp32 Flax model (tests/test_logprobs.py)


def random_adapters(flat, seed, scale=0.1):
    """Adapters on every projection kernel (B non-zero: they change the policy) and the base
    with them merged, both flat."""
    rng = np.random.default_rng(seed)
    adapters, merged = {}, dict(flat)
    for path, kernel in flat.items():
        if path.endswith(".kernel") and path.rsplit(".", 2)[-2] in CONFIG.target_modules:
            module, (in_dim, out_dim) = path.removesuffix(".kernel"), kernel.shape
            a = (rng.normal(size=(in_dim, CONFIG.rank)) * scale).astype(np.float32)
            b = (rng.normal(size=(CONFIG.rank, out_dim)) * scale).astype(np.float32)
            adapters |= {f"{module}.lora_a": a, f"{module}.lora_b": b}
            merged[path] = kernel + CONFIG.scale * a @ b
    return adapters, merged


class Served:
    def __init__(self, worker, model_dir):
        self.worker = worker
        config = json.loads((model_dir / "config.json").read_text())
        self.params = load_hf_params(model_dir)
        flat = flatten_params(self.params)
        self.adapters, merged = random_adapters(flat, seed=0)
        self.other_adapters, other_merged = random_adapters(flat, seed=1)
        self.merged = unflatten_params(merged)
        model = flax_model_for(config)
        self.base_tokens = greedy_decode(model, self.params, PROMPTS, NEW_TOKENS)
        self.tokens = greedy_decode(model, self.merged, PROMPTS, NEW_TOKENS)
        self.other_tokens = greedy_decode(model, unflatten_params(other_merged), PROMPTS, NEW_TOKENS)
        assert len({str(self.base_tokens), str(self.tokens), str(self.other_tokens)}) == 3, "adapters must matter"
        # The base placed for a zero-copy sync; the adapters as the engine holds them.
        self.base = jax.device_put(self.params, worker.param_shardings())
        self.placed_adapters = jax.device_put(unflatten_params(self.adapters), worker.adapter_shardings())

    def greedy(self):
        return self.worker.generate(PROMPTS, temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True).completions


@pytest.fixture(scope="module")
def served(qwen2_dir):
    # Decode chunks (4 steps per dispatch) with the adapters unmerged; ``slotted`` below decodes
    # a step at a time.
    config = tiny_worker_config(qwen2_dir, load_format="dummy", tp_size=2, unmerged_lora=CONFIG, decode_steps=4)
    with RolloutWorker(config) as worker:
        yield Served(worker, qwen2_dir)


def adapter_leaves(worker):
    return [leaf for leaf in worker.leaves if leaf.path.endswith((".lora_a", ".lora_b"))]


def adapter_bytes(worker) -> int:
    """Bytes of the engine's adapter leaves (float32)."""
    return sum(int(np.prod(leaf.shape)) * 4 for leaf in adapter_leaves(worker))


def test_a_base_sync_serves_the_base_and_adapters_alone_move_only_their_bytes(served):
    worker = served.worker
    worker.sync_params(served.base)
    assert served.greedy() == served.base_tokens, "a base without adapters is served with none"
    assert worker.sync_memory_analysis(served.base).temp_size_in_bytes >= 0
    report = worker.sync_adapters(served.placed_adapters)
    served_by_chunks = worker.engine.decode_chunk_stats.steps_served
    assert served.greedy() == served.tokens
    # Its decode steps came from chunks: each computed the adapters' terms on the device.
    assert worker.engine.decode_chunk_stats.steps_served - served_by_chunks == NEW_TOKENS - 1
    worker.check_consistency(served.merged, PROMPTS, n=2, max_new_tokens=NEW_TOKENS, atol=LOGPROB_ATOL)
    leaves = adapter_leaves(worker)
    assert report.leaves_aliased + report.leaves_copied == len(leaves)
    assert report.bytes_aliased + report.bytes_copied == adapter_bytes(worker)
    # Copied: only B of k/v, whose one KV head the engine repeats for tp 2.
    assert report.leaves_copied == 2 * 2  # 2 layers x (k_proj, v_proj)
    worker.sync_adapters(unflatten_params(served.other_adapters))  # host arrays: all copied
    assert served.greedy() == served.other_tokens
    assert worker.sync_adapters(unflatten_params(served.other_adapters)).compiles == 0


def test_base_and_adapters_together_alias_the_base_and_a_base_passed_again_is_kept(served, monkeypatch):
    worker = served.worker
    read = []  # the leaves each sync reads for NaN/inf
    check = trainer_bridge.sync.read_leaves
    monkeypatch.setattr(
        trainer_bridge.sync, "read_leaves", lambda leaves, *args: read.append(len(leaves)) or check(leaves, *args)
    )
    worker.sync_params(served.base)
    report = worker.sync_params(served.base, adapters=served.placed_adapters, lora=CONFIG)
    assert served.greedy() == served.tokens
    # The same base arrays, still served: only the adapters are synced (k/v B copied: repeated heads).
    assert report.leaves_aliased + report.leaves_copied == len(adapter_leaves(worker))
    assert report.leaves_copied == 2 * 2 and report.bytes_aliased + report.bytes_copied == adapter_bytes(worker)
    assert read[-1] == len(adapter_leaves(worker))
    with worker.released_for_training():
        pass  # a train step may donate what the engine aliased: those leaves are taken again
    with pytest.raises(SyncError, match="base was released for a train step"):
        worker.sync_adapters(served.placed_adapters)
    again = worker.sync_params(served.base, adapters=served.placed_adapters, lora=CONFIG)
    # The engine's own copies (k/v with their KV head repeated: 2 layers x kernel, bias) are
    # kept; the released base leaves are aliased again; the adapters synced (k/v B copied).
    assert again.leaves_copied == 2 * 2
    assert again.leaves_aliased == len(worker.mappings) - 2 * 4 + len(adapter_leaves(worker)) - 2 * 2
    assert read[-1] == 0, "the base and adapters were checked when they came"
    assert served.greedy() == served.tokens
    # qwix's names for the same factors serve the same policy.
    qwix = {p.replace(".lora_", ".kernel_lora_"): leaf for p, leaf in flatten_params(served.placed_adapters).items()}
    worker.sync_params(served.base)
    worker.sync_params(served.base, adapters=unflatten_params(qwix), lora=CONFIG)
    assert served.greedy() == served.tokens
    # Factors in the base tree and adapters= too: the base's had been replaced silently.
    both = {**flatten_params(served.base), **flatten_params(served.placed_adapters)}
    with pytest.raises(SyncError, match=r"params holds LoRA factors \('model\.layers_0\..*lora_[ab]'\) and adapters="):
        worker.sync_params(unflatten_params(both), adapters=unflatten_params(qwix), lora=CONFIG)
    assert served.greedy() == served.tokens


def test_a_tree_of_the_leaves_a_resync_moved_is_no_whole_base(served):
    """A sync of the same base after a train step moves only the released leaves (and the
    adapters): its plan, of those leaves alone, had been cached under their tree's key, so a
    later sync of exactly that tree, which lacks the engine's copied k/v leaves, went through
    unchecked for missing paths."""
    worker = served.worker
    worker.sync_params(served.base, adapters=served.placed_adapters, lora=CONFIG)
    with worker.released_for_training():
        pass
    worker.sync_params(served.base, adapters=served.placed_adapters, lora=CONFIG)
    copied = {p for p in flatten_params(served.base) if re.search(r"\.(k|v)_proj\.", p)}  # KV heads repeated
    moved = {p: leaf for p, leaf in flatten_params(served.base).items() if p not in copied}
    version = worker.weight_version
    with pytest.raises(SyncError, match=r"missing 8 expected path\(s\): model\.layers_0\.self_attn\.k_proj\.kernel"):
        worker.sync_params(unflatten_params(moved | flatten_params(served.placed_adapters)))
    assert worker.weight_version == version
    assert served.greedy() == served.tokens


def test_bad_adapters_are_refused_naming_what_is_wrong_and_the_adapters_keep_serving(served):
    worker = served.worker
    worker.sync_params(served.base, adapters=served.placed_adapters, lora=CONFIG)
    version = worker.weight_version
    q_a = "model.layers_0.self_attn.q_proj.lora_a"
    bad_rank, _ = random_adapters(flatten_params(served.params), seed=2)
    bad_rank[q_a] = np.zeros((bad_rank[q_a].shape[0], 2), np.float32)
    nan = dict(served.adapters)
    nan["model.layers_1.mlp.up_proj.lora_b"] = np.full_like(nan["model.layers_1.mlp.up_proj.lora_b"], np.nan)
    missing = {p: leaf for p, leaf in served.adapters.items() if p != "model.layers_1.self_attn.v_proj.lora_b"}
    qwix_nan = {re.sub(r"\.(lora_[ab])$", r".kernel_\1", p): leaf for p, leaf in nan.items()}
    # Each factor finite, their product not in float32: the engine had served NaN.
    up = "model.layers_1.mlp.up_proj"
    huge = {**served.adapters, f"{up}.lora_a": np.full_like(served.adapters[f"{up}.lora_a"], 1e19)}
    huge[f"{up}.lora_b"] = np.full_like(served.adapters[f"{up}.lora_b"], 1e19)
    qwix_huge = {re.sub(r"\.(lora_[ab])$", r".kernel_\1", p): leaf for p, leaf in huge.items()}
    # The A served (checked when it came, not read again) beside a new B: both read for the bound.
    served_a = flatten_params(served.placed_adapters) | {f"{up}.lora_b": np.full_like(huge[f"{up}.lora_b"], 3e38)}
    cases = [
        (lambda: worker.sync_adapters(unflatten_params(bad_rank)), rf"'{q_a}' has shape \(256, 2\)"),
        (lambda: worker.sync_adapters(unflatten_params(nan)), r"nan/inf\) in: model.layers_1.mlp.up_proj.lora_b"),
        # Named as the caller's tree names them (qwix's names), not as the engine does.
        (
            lambda: worker.sync_adapters(unflatten_params(qwix_nan)),
            r"nan/inf\) in: model.layers_1.mlp.up_proj.kernel_lora_b$",
        ),
        (
            lambda: worker.sync_adapters(unflatten_params(huge)),
            rf"max\|B\| = 8e\+38 \(scale alpha / rank = 2, rank 4\), past 3.40282e\+38: .* in: {up}.lora_a and "
            rf"{up}.lora_b$",
        ),
        (
            lambda: worker.sync_params(served.base, adapters=unflatten_params(qwix_huge), lora=CONFIG),
            rf"too large for the engine's float32: .*, in: {up}.kernel_lora_a and {up}.kernel_lora_b$",
        ),
        (lambda: worker.sync_adapters(unflatten_params(served_a)), rf"in: {up}.lora_a and {up}.lora_b$"),
        (lambda: worker.sync_adapters(unflatten_params(missing)), "'model.layers_1.self_attn.v_proj.lora_a' has no"),
        (
            lambda: worker.sync_params(served.base, adapters=served.placed_adapters, lora=LoraConfig(4, 4.0)),
            "is not the engines' WorkerConfig.unmerged_lora",
        ),
        (lambda: worker.sync_adapters(served.placed_adapters, LoraConfig(8, 8.0)), "rank=8"),
        (
            lambda: worker.sync_adapters(served.placed_adapters, name="x"),
            r"serves the default adapters alone \(WorkerConfig\.max_loras=1\); start it with max_loras > 1",
        ),
    ]
    for call, message in cases:
        with pytest.raises(SyncError, match=message):
            call()
        assert worker.weight_version == version
    assert served.greedy() == served.tokens
    # The same targets in another order are the engines' configuration.
    reordered = LoraConfig(CONFIG.rank, CONFIG.alpha, tuple(reversed(CONFIG.target_modules)))
    worker.sync_adapters(served.placed_adapters, reordered)


def test_an_empty_tree_is_refused_and_the_adapters_keep_serving(served):
    """A trainer filter that left nothing ({} or {'params': {}}) had been synced as zero adapters
    alone: a new version serving the base without the adapters. A merged worker refuses it."""
    worker = served.worker
    worker.sync_params(served.base, adapters=served.placed_adapters, lora=CONFIG)
    version = worker.weight_version
    for tree in ({}, {"params": {}}):
        for call in (worker.check_params, worker.sync_params):
            with pytest.raises(SyncError, match="param tree does not match the model: .*missing"):
                call(tree)
    assert worker.weight_version == version
    assert served.greedy() == served.tokens


def test_a_leaf_served_unchecked_is_checked_when_it_comes_again(served):
    """Arrays the engine already serves are not read again for NaN, unless they came unchecked."""
    worker = served.worker
    flat = flatten_params(served.base)
    norm = "model.norm.scale"
    poisoned = {**flat, norm: jax.device_put(np.full(flat[norm].shape, np.nan, np.float32), flat[norm].sharding)}
    worker.sync_params(poisoned, check_finite=False)
    try:
        with pytest.raises(SyncError, match=f"nan/inf\\) in: {norm}"):
            worker.sync_params(poisoned)
    finally:  # the module's later tests are served the base, whatever failed here
        worker.sync_params(served.base, adapters=served.placed_adapters, lora=CONFIG)
    assert served.greedy() == served.tokens


def save(path, tree):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    return path


def test_adapter_checkpoints_load_onto_the_served_base_and_full_ones_are_not_adapters(served, tmp_path):
    worker = served.worker
    worker.sync_params(served.base)
    qwix = {p.replace(".lora_", ".kernel_lora_"): leaf for p, leaf in served.adapters.items()}
    adapters_dir = save(tmp_path / "adapters", {"params": unflatten_params(qwix)})
    report = worker.load_adapters(adapters_dir)
    assert served.greedy() == served.tokens
    assert report.bytes_copied + report.bytes_aliased == adapter_bytes(worker)
    worker.sync_params(served.base)
    worker.load_checkpoint(adapters_dir)  # recognized as adapters
    assert served.greedy() == served.tokens
    full = save(tmp_path / "full", served.params)
    with pytest.raises(SyncError, match="is not of LoRA adapters alone: 'model.embed_tokens.embedding'"):
        worker.load_adapters(full)
    assert served.greedy() == served.tokens
    worker.load_checkpoint(full)  # a base alone: served without adapters
    assert served.greedy() == served.base_tokens
    both = save(tmp_path / "both", unflatten_params({**flatten_params(served.params), **served.other_adapters}))
    worker.load_checkpoint(both)
    assert served.greedy() == served.other_tokens
    # A base with qwix's factors (a Tunix model's state), saved and synced: it had been refused
    # as having unexpected paths.
    qwix_other = {p.replace(".lora_", ".kernel_lora_"): leaf for p, leaf in served.other_adapters.items()}
    worker.load_checkpoint(full)
    worker.load_checkpoint(save(tmp_path / "qwix", unflatten_params({**flatten_params(served.params), **qwix_other})))
    assert served.greedy() == served.other_tokens
    worker.sync_params(served.base)
    worker.sync_params(unflatten_params({**flatten_params(served.base), **qwix}))
    assert served.greedy() == served.tokens
    # Misshapen, named as the caller's tree names it.
    up_a = "model.layers_1.mlp.up_proj.kernel_lora_a"
    with pytest.raises(SyncError, match=re.escape(up_a)):
        worker.sync_params(unflatten_params({**flatten_params(served.base), **qwix, up_a: qwix[up_a][:, :1]}))
    assert served.greedy() == served.tokens


@pytest.mark.one_end
def test_admin_load_lora_serves_an_adapter_checkpoint(served, tmp_path):
    import httpx

    from bench.serve_load import ADMIN_TOKEN

    worker = served.worker
    worker.sync_params(served.base)
    path = str(save(tmp_path / "adapters", unflatten_params(served.other_adapters)))
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def complete(http):
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        return http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]

    with (
        worker.serve(admin_token=ADMIN_TOKEN, served_model_name="tiny") as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        assert http.post("/admin/load_lora", json={"lora_path": path}).status_code == 401
        missing = http.post("/admin/load_lora", json={"lora_name": "policy"}, headers=admin)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
        absent = http.post("/admin/load_lora", json={"lora_path": str(tmp_path / "absent")}, headers=admin)
        assert absent.status_code == 404 and absent.json()["error"]["param"] == "lora_path", absent.text
        full = str(save(tmp_path / "full", served.params))
        not_adapters = http.post("/admin/load_lora", json={"lora_path": full}, headers=admin)
        assert not_adapters.status_code == 400 and "is not of LoRA adapters alone" in not_adapters.text
        loaded = http.post("/admin/load_lora", json={"lora_path": path, "lora_name": "policy"}, headers=admin)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["lora_name"] == "policy" and loaded.json()["version"] == worker.weight_version
        assert complete(http) == served.other_tokens[0]


def test_the_worker_keeps_no_trainer_array_it_copied_alive(served):
    """A sync remembers the arrays it checked weakly: a trainer's bfloat16 tree, cast into the
    float32 engine, is freed once the trainer drops it."""
    worker = served.worker
    tree = jax.tree_util.tree_map(lambda x: jax.numpy.asarray(x, jax.numpy.bfloat16), served.params)
    probe = weakref.ref(tree["model"]["norm"]["scale"])
    worker.sync_params(tree)
    del tree
    gc.collect()
    assert probe() is None
    worker.sync_params(served.base)


# ---- several adapters at once (max_loras) -----------------------------------------------------


@pytest.fixture(scope="module")
def slotted(qwen2_dir, served):
    """A worker holding the default adapters and two named ones (the prefix cache off: it keys
    prefixes by tokens alone), serving the base of ``served``: two engines, each tp=2."""
    config = tiny_worker_config(
        qwen2_dir, load_format="dummy", tp_size=2, dp_size=2, unmerged_lora=CONFIG, max_loras=3, prefix_cache=False
    )
    with RolloutWorker(config) as worker:
        worker.sync_params(jax.device_put(served.params, worker.param_shardings()))
        yield worker


def greedy_on(worker, **options):
    return worker.generate(PROMPTS, temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, **options).completions


def test_named_adapters_serve_their_own_policy_beside_the_default_ones(slotted, served, tmp_path, monkeypatch):
    worker = slotted
    worker.sync_adapters(unflatten_params(served.adapters))
    report = worker.sync_adapters(unflatten_params(served.other_adapters), name="other")
    # One slot's adapters moved to each engine (host arrays: copied).
    assert report.bytes_copied == adapter_bytes(worker) * len(worker.engines) == 2 * adapter_bytes(worker)
    zero = unflatten_params({k: v * 0 for k, v in served.adapters.items()})
    worker.load_adapters(save(tmp_path / "zero", zero), name="base")
    assert worker.adapter_names() == ["base", "other"]
    assert greedy_on(worker) == served.tokens
    assert greedy_on(worker, lora="other") == served.other_tokens
    assert greedy_on(worker, lora="base") == served.base_tokens

    forwards = []  # the slots of each forward's requests
    write = rollout.engine.runtime.write_token_slots

    def recorded(scheduler, batch, slot_of_request, leaf_index):
        forwards.append({slot_of_request.get(req.rid, 0) for req in batch.reqs})
        write(scheduler, batch, slot_of_request, leaf_index)

    monkeypatch.setattr(rollout.engine.runtime, "write_token_slots", recorded)

    async def together():
        calls = [None, "other", "base", "other"]
        options = dict(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        batches = await asyncio.gather(*(worker.agenerate(PROMPTS, lora=name, **options) for name in calls))
        return [batch.completions for batch in batches]

    expected = [served.tokens, served.other_tokens, served.base_tokens, served.other_tokens]
    with admitted_together(worker, requests=4 * len(PROMPTS)):
        assert asyncio.run(together()) == expected
    assert max(map(len, forwards)) == 3, "the calls' rows ran in forwards together"


def test_adapter_slots_are_named_refused_when_full_and_freed(slotted, served):
    worker = slotted
    for name in worker.adapter_names():
        assert worker.unload_adapters(name)
    # A named slot's factors are named as the caller's tree names them (not lora_b_1).
    up_b = "model.layers_1.mlp.up_proj.lora_b"
    nan = {**served.adapters, up_b: np.full_like(served.adapters[up_b], np.nan)}
    with pytest.raises(SyncError, match=rf"nan/inf\) in: {re.escape(up_b)}$") as error:
        worker.sync_adapters(unflatten_params(nan), name="one")
    assert error.value.non_finite == (up_b,)
    up_a = "model.layers_1.mlp.up_proj.lora_a"
    huge = {**served.adapters, up_a: np.full_like(served.adapters[up_a], 1e19), up_b: np.full_like(nan[up_b], 1e19)}
    with pytest.raises(
        SyncError, match=rf"too large for the engine's float32: .*, in: {re.escape(up_a)} and {re.escape(up_b)}$"
    ):
        worker.sync_adapters(unflatten_params(huge), name="one")
    assert worker.adapter_names() == []
    worker.sync_adapters(unflatten_params(served.adapters), name="one")
    worker.sync_adapters(unflatten_params(served.adapters), name="two")
    with pytest.raises(SyncError, match=r"max_loras=3 holds the default adapters and 2 named ones \(\['one', 'two'\]"):
        worker.sync_adapters(unflatten_params(served.adapters), name="three")
    assert worker.unload_adapters("one") and not worker.unload_adapters("one")  # gone from both engines
    for bad in (["one"], None, " "):
        with pytest.raises(InvalidRequest, match="name must be a non-empty string") as error:
            worker.unload_adapters(bad)
        assert error.value.field == "name"
    with pytest.raises(SyncError, match="name must be a non-empty string or None"):
        worker.sync_adapters(unflatten_params(served.adapters), name=" ")
    with pytest.raises(SyncError, match="adapters must be a tree of LoRA factors .* got NoneType"):
        worker.sync_adapters(None, name="three")
    assert all("one" not in engine.lora_names for engine in worker.engines)
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'one' is loaded"):
        greedy_on(worker, lora="one")
    worker.sync_adapters(unflatten_params(served.other_adapters), name="three")
    assert worker.adapter_names() == ["three", "two"]
    assert greedy_on(worker, lora="three") == served.other_tokens
    # An unloaded name's slot stays taken while a call still runs on it.
    slot = worker.engine.lora_names["two"]
    worker.unload_adapters("two")
    running = worker.engine._control.lora_slots
    running["a running call's request"] = slot
    try:
        with pytest.raises(SyncError, match="slots still used by running calls"):
            worker.sync_adapters(unflatten_params(served.adapters), name="four")
    finally:
        del running["a running call's request"]
    worker.sync_adapters(unflatten_params(served.adapters), name="four")
    assert worker.engine.lora_names["four"] == slot


def test_an_adapter_served_unchecked_with_non_finite_factors_leaves_the_other_slots_alone(slotted, served):
    """A slot's NaN (synced with check_finite=False) is that adapter's own fault: the default
    adapters' and the other named ones' tokens had all become token 0 (0 * NaN), and stayed so
    after the bad one was unloaded."""
    worker = slotted
    for name in worker.adapter_names():
        worker.unload_adapters(name)
    worker.sync_adapters(unflatten_params(served.adapters))
    worker.sync_adapters(unflatten_params(served.other_adapters), name="one")
    up_b = "model.layers_1.mlp.up_proj.lora_b"
    for poison in (np.nan, np.inf):
        bad = {**served.adapters, up_b: np.full_like(served.adapters[up_b], poison)}
        worker.sync_adapters(unflatten_params(bad), name="bad", check_finite=False)
        assert greedy_on(worker) == served.tokens
        assert greedy_on(worker, lora="one") == served.other_tokens
        greedy_on(worker, lora="bad")  # its own rows' KV is NaN: the pages it frees are reused
        worker.unload_adapters("bad")
        assert greedy_on(worker) == served.tokens
        assert greedy_on(worker, lora="one") == served.other_tokens
    worker.unload_adapters("one")


class ContendedLock:
    """A lock (or RLock) that sets ``contended`` when a thread finds it held by another and waits."""

    def __init__(self, lock, contended: threading.Event):
        self.lock, self.contended = lock, contended

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            self.contended.set()
            self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def test_a_call_never_runs_on_a_slot_handed_to_other_adapters_while_it_registers(slotted, served):
    """A call found its adapter's slot, then registered its requests on it: an unload and a
    sync of other adapters in between saw the slot free, filled it, and the call ran on them.
    The call is held inside its registration until the other thread has either done both
    (the fault) or waits for the registration's lock; it must decode its own adapter's tokens."""
    worker = slotted
    for name in worker.adapter_names():
        worker.unload_adapters(name)
    worker.sync_adapters(unflatten_params(served.other_adapters), name="one")
    registering, release = threading.Event(), threading.Event()
    other = threading.Event()  # the rival waits for the registration's lock, or is done (the fault)
    controls = [engine._control for engine in worker.engines]
    originals = [(control.lora_slots, control.lora_lock) for control in controls]

    class HeldRegistration(dict):
        def update(self, *args, **kwargs):
            registering.set()
            release.wait(120)
            super().update(*args, **kwargs)

    for control in controls:
        control.lora_slots, control.lora_lock = (
            HeldRegistration(control.lora_slots),
            ContendedLock(control.lora_lock, other),
        )
    tokens, synced = [], threading.Event()

    def unload_and_sync_others():
        worker.unload_adapters("one")
        worker.sync_adapters(unflatten_params(served.adapters), name="two", in_flight=True)
        synced.set()
        other.set()

    # One prompt: one engine's requests, registered at once (a call spread over both engines
    # registers on each, and an unload between them refuses the rest of the call).
    options = dict(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, lora="one")
    call = threading.Thread(target=lambda: tokens.append(worker.generate(PROMPTS[:1], **options).completions))
    rival = threading.Thread(target=unload_and_sync_others)
    try:
        call.start()
        assert registering.wait(120)
        rival.start()
        assert other.wait(120)
        release.set()
        call.join(120)
        rival.join(120)
        assert not call.is_alive() and not rival.is_alive() and synced.is_set()
    finally:
        release.set()
        for control, (slots, lock) in zip(controls, originals):
            control.lora_slots, control.lora_lock = slots, lock
    assert tokens == [served.other_tokens[:1]]
    worker.unload_adapters("two")


def test_a_slot_a_call_registered_on_is_not_handed_out_when_its_name_is_unloaded_meanwhile(
    slotted, served, monkeypatch
):
    """A sync of new adapters read the running calls' slots, then the names: a call registered
    on a named slot in between, and its name unloaded, left that slot looking free. Forced here
    inside the slot choice's read of the running calls: the unload must wait for the choice,
    which must not pick the call's slot."""
    worker = slotted
    for name in worker.adapter_names():
        worker.unload_adapters(name)
    worker.sync_adapters(unflatten_params(served.other_adapters), name="one")
    slot = worker.engine.lora_names["one"]
    waited = threading.Event()  # the unload waits for the choice, or is done (the fault)
    monkeypatch.setattr(worker, "_state_lock", ContendedLock(worker._state_lock, waited))
    engine = worker.engines[-1]
    read = engine.lora_slots_in_use

    def meanwhile():
        running = read()  # before the call registers: what the choice sees
        engine._control.lora_slots["a call of 'one'"] = slot
        unloading = threading.Thread(target=lambda: worker.unload_adapters("one") and waited.set())
        unloading.start()
        assert waited.wait(120)
        monkeypatch.setattr(engine, "lora_slots_in_use", read)
        meanwhile.unloading = unloading
        return running

    monkeypatch.setattr(engine, "lora_slots_in_use", meanwhile)
    try:
        worker.sync_adapters(unflatten_params(served.adapters), name="two")
        meanwhile.unloading.join(120)
        assert worker.engine.lora_names["two"] != slot and "one" not in worker.adapter_names()
    finally:
        engine._control.lora_slots.pop("a call of 'one'", None)
    worker.unload_adapters("two")


def test_named_adapters_synced_as_aliases_serve_on_after_a_train_step(slotted, served):
    """Named adapters the trainer placed (aliased) are copied when a train step takes the
    buffers: the base sync after it puts back the base and the default slot, the named ones
    serve on although the step donated their arrays (every generate raised AttributeError)."""
    worker = slotted
    for name in worker.adapter_names():
        worker.unload_adapters(name)
    placed = jax.device_put(unflatten_params(served.other_adapters), worker.adapter_shardings())
    assert worker.sync_adapters(placed, name="ref").leaves_aliased > 0
    base = jax.device_put(served.params, worker.param_shardings())
    with worker.released_for_training():
        jax.jit(lambda tree: jax.tree.map(lambda x: x + 1, tree), donate_argnums=0)(placed)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(placed)), "the test's premise: donated"
    worker.sync_params(base)
    try:
        assert greedy_on(worker) == served.base_tokens
        assert greedy_on(worker, lora="ref") == served.other_tokens
    finally:
        worker.unload_adapters("ref")


def test_named_adapters_alone_are_refused_while_the_default_ones_are_released(slotted, served):
    """A train step released the default adapters (aliased) where the base was the engine's own
    copy: a sync of named adapters alone had gone through and the worker taken itself for synced,
    refusing every call after, the named adapters' too, blaming a donation."""
    worker = slotted
    worker.sync_params(served.params)  # host arrays: the engine's own copies, kept through a release
    placed = jax.device_put(unflatten_params(served.adapters), worker.adapter_shardings())
    assert worker.sync_adapters(placed).leaves_aliased > 0
    with worker.released_for_training():
        pass
    version = worker.weight_version
    released = r"adapters the engine serves in another slot were released .*e\.g\. '.*lora_[ab]'"
    with pytest.raises(SyncError, match=released):
        worker.sync_adapters(unflatten_params(served.other_adapters), name="x")
    assert worker.weight_version == version and "x" not in worker.adapter_names()
    worker.sync_adapters(placed)
    worker.sync_adapters(unflatten_params(served.other_adapters), name="x")
    try:
        assert greedy_on(worker) == served.tokens
        assert greedy_on(worker, lora="x") == served.other_tokens
    finally:
        worker.unload_adapters("x")
        worker.sync_params(jax.device_put(served.params, worker.param_shardings()))


@pytest.mark.one_end
def test_requests_pick_a_named_adapter_by_model_over_http(slotted, served, tmp_path):
    import httpx

    from bench.serve_load import ADMIN_TOKEN

    worker = slotted
    for name in worker.adapter_names():
        worker.unload_adapters(name)
    worker.sync_adapters(unflatten_params(served.adapters))
    path = str(save(tmp_path / "other", unflatten_params(served.other_adapters)))
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def complete(http, model):
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        return http.post("/v1/completions", json=body)

    with (
        worker.serve(admin_token=ADMIN_TOKEN, served_model_name="tiny") as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        loaded = http.post("/admin/load_lora", json={"lora_path": path, "lora_name": "other"}, headers=admin)
        assert loaded.status_code == 200, loaded.text
        models = http.get("/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("other", "tiny")]
        assert complete(http, "tiny").json()["choices"][0]["token_ids"] == served.tokens[0]
        assert complete(http, "other").json()["choices"][0]["token_ids"] == served.other_tokens[0]
        assert complete(http, "other").json()["model"] == "other"
        missing = complete(http, "nobody")
        assert missing.status_code == 404 and "the LoRA adapters ['other']" in missing.text
        assert (
            http.post("/admin/load_lora", json={"lora_path": path, "lora_name": "tiny"}, headers=admin).status_code
            == 400
        )
        assert http.post("/admin/unload_lora", json={"lora_name": "other"}, headers=admin).json()["unloaded"]
        assert http.post("/admin/unload_lora", json={"lora_name": "other"}, headers=admin).status_code == 404
        assert complete(http, "other").status_code == 404
