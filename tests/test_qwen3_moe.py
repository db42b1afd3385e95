"""Qwen3-MoE: the Flax trainer model against the engine (greedy tokens and log-probs after every
way of loading weights), zero-copy of the stacked experts, what the consistency check catches,
and the engine workarounds it needs. The contract suite (tests/test_families.py) runs the same
checks at tp 2; here they run at tp 1. The mapping table, routing and HF loading, which need no
engine: tests/unit/ (test_registry.py, test_moe.py, test_qwen3_moe.py, test_hf.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from models import (
    TinyMoeSpec,
    greedy_decode,
    router_choices,
    write_tiny_model,
)
from rollout import ConsistencyError, InvalidRequest, RolloutWorker
from rollout.engine import EngineHandle
from tests.helpers import flax_model, swap_at_token, tiny_options, tiny_worker_config
from trainer_bridge import flatten_params, load_hf_params, unflatten_params

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11]]
NEW_TOKENS = 8
FP32_ATOL = 1e-4  # as tests/test_logprobs.py holds the dense families


@pytest.fixture(scope="module")
def params(moe_dir):
    return load_hf_params(moe_dir)


@pytest.fixture(scope="module")
def reference(moe_dir, params):
    """The Flax trainer model's greedy tokens."""
    return greedy_decode(flax_model(moe_dir), params, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def tp1_worker(moe_dir):
    """Weights from the engine's own safetensors loader (load_format auto)."""
    with RolloutWorker(tiny_worker_config(moe_dir, tp_size=1, load_format="auto")) as worker:
        yield worker


@pytest.fixture(scope="module")
def tp2_worker(moe_dir):
    """Dummy weights at start-up; the experts sharded over 2 devices; routing recorded."""
    with RolloutWorker(tiny_worker_config(moe_dir, tp_size=2, load_format="dummy", record_routing=True)) as worker:
        yield worker


@pytest.fixture(params=["tp1", "tp2"])
def worker(request):
    return request.getfixturevalue(f"{request.param}_worker")


def greedy(worker):
    return worker.generate(PROMPTS, temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def assert_serves(worker, params, reference):
    """Greedy tokens equal the Flax model's, and sampled log-probs agree to fp32 rounding."""
    batch = greedy(worker)
    assert batch.completions == reference
    report = worker.check_consistency(params, PROMPTS, n=2, max_new_tokens=NEW_TOKENS, atol=FP32_ATOL)
    # Every token the same seed samples was compared (a row may draw EOS before NEW_TOKENS).
    sampled = worker.generate(PROMPTS, n=2, max_new_tokens=NEW_TOKENS, seed=0)
    assert report.tokens == int(sampled.completion_mask.sum()) >= len(PROMPTS) * NEW_TOKENS
    assert abs(report.kl) < 1e-6
    return batch, report


# ---- the engine against the Flax model ------------------------------------------------------


def test_engine_serves_the_flax_models_tokens_from_safetensors(tp1_worker, params, reference):
    """Pins WORKAROUNDS "moe-forward": 0.0.2's expert block crashes on one device (and off TPU
    on several), and routes with a bfloat16 softmax."""
    assert_serves(tp1_worker, params, reference)


def test_tensor_parallel_dummy_engine_holds_every_expert(tp2_worker):
    """Pins WORKAROUNDS "moe-expert-shapes": each device holds its half of all 8 experts."""
    leaves = {leaf.path: leaf for leaf in tp2_worker.leaves}
    for name, shape in (("wi_0", (8, 256, 128)), ("wi_1", (8, 256, 128)), ("wo", (8, 128, 256))):
        leaf = leaves[f"transformer.layers.1.mlp.{name}"]
        assert leaf.shape == shape
        assert {index[0] for index in leaf.sharding.devices_indices_map(shape).values()} == {slice(0, 4), slice(4, 8)}


def test_sync_params(tp1_worker, params, reference):
    report = tp1_worker.sync_params(params)
    assert report.leaves_copied == len(tp1_worker.mappings)
    assert_serves(tp1_worker, params, reference)


def test_placed_tree_aliases_every_leaf_stacked_experts_included(tp1_worker, params, reference):
    placed = jax.device_put(params, tp1_worker.param_shardings())
    report = tp1_worker.sync_params(placed)
    # 2 KV heads: no tp here repeats them, so nothing is transformed.
    assert report.leaves_copied == 0 and report.bytes_copied == 0, report
    assert report.leaves_aliased == len(tp1_worker.mappings)
    flat, leaves = flatten_params(placed), tp1_worker.engine.weight_leaves()
    by_path = {leaf.path: leaf for leaf in tp1_worker.leaves}
    for m in tp1_worker.mappings:
        assert leaves[by_path[m.engine].index] is flat[m.trainer], m.trainer
    batch, _ = assert_serves(tp1_worker, params, reference)
    assert batch.compiles == 0


def test_load_checkpoint(tp1_worker, params, reference, tmp_path):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", jax.tree_util.tree_map(lambda x: x * 1.0, params))
    checkpointer.wait_until_finished()
    tp1_worker.sync_params(jax.tree_util.tree_map(lambda x: x * 0.5, params))
    assert greedy(tp1_worker).completions != reference
    report = tp1_worker.load_checkpoint(tmp_path / "ckpt")
    assert report.leaves_copied == 0
    assert_serves(tp1_worker, params, reference)


def test_load_hf(tp1_worker, moe_dir, params, reference):
    tp1_worker.sync_params(jax.tree_util.tree_map(lambda x: x * 0.5, params))
    tp1_worker.load_hf(moe_dir)
    assert_serves(tp1_worker, params, reference)


def test_kv_drop_rebuild_and_http_admin_flow(tp1_worker, moe_dir, params, reference):
    """The seeds' admin flow on a MoE engine: checksum, perturb, reload from the HF dir."""
    import httpx

    from bench.serve_load import ADMIN_TOKEN

    tp1_worker.sync_params(params)
    dropped = tp1_worker.drop_kv()
    assert dropped.bytes > 0 and tp1_worker.memory().kv_bytes == 0
    assert greedy(tp1_worker).completions == reference  # rebuilds first
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    reload = {"path": str(moe_dir), "format": "hf"}
    with (
        tp1_worker.serve(admin_token=ADMIN_TOKEN, served_model_name="moe") as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        original = http.get("/admin/weights_checksum", headers=admin).json()
        assert original["leaves"] == len(tp1_worker.mappings)
        perturbed = http.post("/admin/perturb_weights", json={"seed": 3, "scale": 0.05, "num_leaves": 4}, headers=admin)
        assert perturbed.json()["checksum_after"] != original["checksum"]
        assert http.post("/admin/reload_weights", json=reload, headers=admin).status_code == 200
        assert http.get("/admin/weights_checksum", headers=admin).json()["checksum"] == original["checksum"]
        body = {"model": "moe", "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == reference[0]


def test_consistency_check_catches_experts_swapped_behind_the_routers_back(worker, params):
    """Experts 0 and 1 of layer 1 exchanged in the stacked weights, the router left as it is:
    every shape matches, the engine routes tokens to the wrong experts."""
    flat = dict(flatten_params(params))
    for name in ("gate_proj", "up_proj", "down_proj"):
        path = f"model.layers_1.mlp.{name}"
        flat[path] = flat[path][np.array([1, 0, 2, 3, 4, 5, 6, 7])]
    worker.sync_params(unflatten_params(flat))
    with pytest.raises(ConsistencyError, match=r"max \|Δ log p\|"):
        worker.check_consistency(params, PROMPTS, n=2, max_new_tokens=NEW_TOKENS, atol=1e-3)
    worker.sync_params(params)
    worker.check_consistency(params, PROMPTS, max_new_tokens=NEW_TOKENS, atol=FP32_ATOL)


def test_decoder_sparse_step_and_unnormalized_routing(tmp_path):
    """Pins WORKAROUNDS "moe-sparse-step": with decoder_sparse_step 2 layers 0 and 2 are dense
    (0.0.2 builds experts in every layer not in mlp_only_layers); norm_topk_prob false."""
    spec = TinyMoeSpec(num_hidden_layers=3, mlp_only_layers=(), decoder_sparse_step=2, norm_topk_prob=False, seed=4)
    model_dir = write_tiny_model(tmp_path / "moe", spec, with_tokenizer=False)
    params = load_hf_params(model_dir)
    flat = flatten_params(params)
    assert {
        "model.layers_0.mlp.gate_proj.kernel",
        "model.layers_1.mlp.gate_proj",
        "model.layers_2.mlp.up_proj.kernel",
    } <= set(flat)
    reference = greedy_decode(flax_model(model_dir), params, PROMPTS, NEW_TOKENS)
    with RolloutWorker(tiny_worker_config(model_dir, load_format="auto")) as worker:
        assert {leaf.path for leaf in worker.leaves} >= {
            "transformer.layers.0.mlp.gate_proj.weight",
            "transformer.layers.1.mlp.wi_0",
            "transformer.layers.2.mlp.down_proj.weight",
        }
        assert_serves(worker, params, reference)


# ---- routing replay ------------------------------------------------------------------------

# Routing replay runs at the newest end (the oldest is the longer): where a token's routing is
# filed and found (KV slots, chunks, pages, swaps, the server) is the worker's bookkeeping, the
# same at every JAX release, and the expert block and router it records are tested at both ends
# by the rest of this file. The first test below, the recording itself, runs at both ends.
ONE_END = pytest.mark.one_end


def test_recorded_routing_is_the_flax_models_float32_routing(tp2_worker, moe_dir, params):
    """Every position a forward took as input carries the experts the fp32 Flax model picks
    there (tp 2: the experts sharded, the routing replicated); the rest -1."""
    tp2_worker.sync_params(params)
    batch = tp2_worker.generate(PROMPTS, n=2, max_new_tokens=NEW_TOKENS, seed=3, return_routing=True)
    routed = batch.routed_experts
    assert routed.shape == batch.tokens.shape + (1, 2) and routed.dtype == np.int8
    own = np.asarray(router_choices(flax_model(moe_dir), params, batch.tokens, batch.attention_mask, batch.positions))
    recorded = routed[..., 0, 0] >= 0
    last = batch.prompt_width + batch.completion_lengths - 1
    expected = batch.attention_mask.copy()
    expected[np.arange(batch.size), last] = False  # a completion's last token is never an input
    np.testing.assert_array_equal(recorded, expected)
    np.testing.assert_array_equal(routed[recorded], own[recorded])
    assert np.all(routed[~recorded] == -1)


@ONE_END
def test_routing_through_chunked_prefills_and_pages(moe_dir, params):
    """Prompts longer than a prefill chunk (computed over several forwards), KV pages of 4
    tokens, samples whose prompts were cached: every routed position is still the fp32 Flax
    model's routing."""
    config = tiny_worker_config(
        moe_dir, load_format="dummy", record_routing=True, chunked_prefill_size=16, max_prefill_tokens=16, page_size=4
    )
    prompts = [list(range(7, 47)), list(range(100, 121)), PROMPTS[0]]
    with RolloutWorker(config) as worker:
        worker.sync_params(params)
        batch = worker.generate(prompts, n=2, max_new_tokens=NEW_TOKENS, seed=4, return_routing=True)
    own = np.asarray(router_choices(flax_model(moe_dir), params, batch.tokens, batch.attention_mask, batch.positions))
    recorded = batch.routed_experts[..., 0, 0] >= 0
    assert recorded.sum() == batch.attention_mask.sum() - batch.size
    np.testing.assert_array_equal(batch.routed_experts[recorded], own[recorded])


@ONE_END
def test_a_cached_prompts_routing_is_the_one_its_prefill_recorded(tp2_worker, params):
    """The first call after a sync prefills the prompts; the second finds them in the prefix
    cache and still returns their routing, the same."""
    tp2_worker.sync_params(params)  # flushes the prefix cache
    first = tp2_worker.generate(PROMPTS, max_new_tokens=2, seed=1, return_routing=True)
    second = tp2_worker.generate(PROMPTS, n=3, max_new_tokens=2, seed=2, return_routing=True)
    width = first.prompt_width
    for row in range(second.size):
        np.testing.assert_array_equal(
            second.routed_experts[row, :width], first.routed_experts[second.prompt_index[row], :width]
        )


@ONE_END
def test_across_an_in_flight_swap_a_position_is_routed_by_the_weights_of_its_forward(tp2_worker, moe_dir, params):
    """Only the router changes (negated): every position's router input is the same under both
    versions (attention and KV do not depend on it, and the sparse layer is the last). A position
    is routed by the version whose forward took it as input: the one that sampled the next token."""
    tp2_worker.sync_params(params)
    flat = dict(flatten_params(params))
    flat["model.layers_1.mlp.gate.kernel"] = -flat["model.layers_1.mlp.gate.kernel"]
    new_params = unflatten_params(flat)
    prompt = PROMPTS[2]

    def generate():
        return tp2_worker.generate([prompt], temperature=0.0, max_new_tokens=10, ignore_eos=True, return_routing=True)

    batch, report = swap_at_token(tp2_worker, new_params, 4, generate)
    model, inputs = flax_model(moe_dir), (batch.tokens, batch.attention_mask, batch.positions)
    by_version = {
        report.version - 1: np.asarray(router_choices(model, params, *inputs))[0],
        report.version: np.asarray(router_choices(model, new_params, *inputs))[0],
    }
    width, versions = batch.prompt_width, batch.token_versions[0]
    assert set(versions[width:]) == set(by_version)  # the swap landed inside the request
    for column in range(width - len(prompt), width + len(batch.completions[0]) - 1):
        version = versions[max(column + 1, width)]  # the prompt's prefill sampled the first token
        np.testing.assert_array_equal(batch.routed_experts[0, column], by_version[version][column], str(column))


@ONE_END
def test_the_completions_route_returns_routing_on_request(tp2_worker, params):
    import httpx

    tp2_worker.sync_params(params)
    sampling = dict(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=5, ignore_eos=True)
    batch = tp2_worker.generate(PROMPTS[:1], return_routing=True, **sampling)
    body = {"model": "moe", "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "seed": 5, "ignore_eos": True}
    body["return_routing"] = True
    with tp2_worker.serve(served_model_name="moe") as server, httpx.Client(base_url=server.url, timeout=120) as http:
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
        unrouted = http.post("/v1/completions", json={**body, "return_routing": False}).json()["choices"][0]
        assert "routed_experts" not in unrouted and "prompt_token_ids" not in unrouted
        streamed = http.post("/v1/completions", json={**body, "stream": True})
    assert choice["token_ids"] == batch.completions[0]
    # One entry per prompt and completion token, the last -1.
    start = batch.prompt_width - len(PROMPTS[0])
    assert choice["routed_experts"] == batch.routed_experts[0, start : start + len(PROMPTS[0]) + NEW_TOKENS].tolist()
    assert choice["routed_experts"][-1] == [[-1, -1]]
    # The prompt's tokens, which the routing's first entries belong to (a chat prompt's are the
    # template's rendering).
    assert choice["prompt_token_ids"] == PROMPTS[0]
    assert len(choice["routed_experts"]) == len(choice["prompt_token_ids"]) + len(choice["token_ids"])
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "return_routing"


@ONE_END
def test_routing_is_asked_of_a_worker_that_records_it(tp1_worker, qwen3_dir):
    with pytest.raises(InvalidRequest, match=r"record_routing=True"):
        tp1_worker.generate(PROMPTS, max_new_tokens=2, return_routing=True)
    with pytest.raises(ValueError, match=r"record_routing: .* is a qwen3 model, which routes no tokens to experts"):
        RolloutWorker(tiny_worker_config(qwen3_dir, record_routing=True))
    # An engine started directly (or on a hub id, which the worker cannot check first) refuses too.
    with pytest.raises(ValueError, match=r"record_routing: .* is not a mixture-of-experts model"):
        EngineHandle(tiny_options(qwen3_dir, record_routing=True))


@pytest.fixture(scope="module")
def near_tie_dir(tmp_path_factory):
    """Router logits 3x narrower than moe_dir's: bf16 rounding flips many tokens' top-k."""
    return write_tiny_model(
        tmp_path_factory.mktemp("moe_near_ties"), TinyMoeSpec(router_scale=1.0), with_tokenizer=False
    )


# The dense families' bf16 bound (tests/test_logprobs.py: BF16_MAX_ABS_DIFF).
BF16_MAX_ABS_DIFF = 0.25
REPLAY_PROMPTS = PROMPTS + [[1], [64, 65, 66], [300, 2, 4], [9] * 7, [12, 34]]


@ONE_END
def test_replay_brings_a_bf16_moe_within_the_dense_bf16_tolerance(near_tie_dir):
    """bf16 engine, fp32 trainer: routed by its own top-k the trainer is far off on the tokens
    whose experts flipped; routed as the engine recorded, within the dense models' bound."""
    params = load_hf_params(near_tie_dir)
    config = tiny_worker_config(near_tie_dir, dtype="bfloat16", load_format="dummy", record_routing=True)
    with RolloutWorker(config) as worker:
        worker.sync_params(params)
        check = dict(n=4, max_new_tokens=16, seed=0, atol=BF16_MAX_ABS_DIFF)
        with pytest.raises(ConsistencyError) as without:
            worker.check_consistency(params, REPLAY_PROMPTS, **check)
        replayed = worker.check_consistency(params, REPLAY_PROMPTS, routing_replay=True, **check)
    assert without.value.report.tokens == replayed.tokens
    assert replayed.max_abs_diff < BF16_MAX_ABS_DIFF < without.value.report.max_abs_diff
    assert replayed.kl < without.value.report.kl / 3


@pytest.mark.example_path
def test_grpo_example_runs_on_tiny_moe_with_an_engine_pool(tmp_path):
    """``python -m examples.grpo --preset tiny-moe --dp-size 2`` as a user runs it (2 steps, two
    engines): every sync aliases all leaves on both engines (experts and routers included) and
    the engines serve the trainer's policy (checked every step). Routing replay over an engine
    pool: the README's block (tests/test_readme.py); in RL: tests/test_grpo.py, tests/test_ppo.py."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    command = [
        sys.executable,
        "-m",
        "examples.grpo",
        "--preset",
        "tiny-moe",
        "--output-dir",
        str(tmp_path),
        "--no-progress",
        "--no-plot",
        "--steps",
        "2",
        "--check-consistency-every",
        "1",
        "--prompts-per-step",
        "4",
        "--dp-size",
        "2",
    ]
    result = subprocess.run(
        command, cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["bytes_copied"] == 0 for r in records)
    assert all(r["consistency_max"] < FP32_ATOL for r in records)
