"""The contract every registered model family (``models.FAMILIES``) must meet, one module-scoped
engine per case, each case at one end of the JAX range (``Case.end``): greedy tokens and
log-probs equal the family's Flax model after ``sync_params``, ``load_hf`` and
``load_checkpoint``; a tree placed by ``param_shardings()`` copies only the leaves its table
transforms; another family's tree is a SyncError naming the first mismatching path.
Unsupported configs, refused before anything starts: tests/unit/test_registry.py. What
tests/test_sync.py and tests/test_logprobs.py already check for every Qwen variant (exact leaf
values, KV-head repeats, validation, sampling filters) is not repeated here.
"""

import dataclasses
import json
import re
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from models import (
    EngineTransform,
    TinyModelSpec,
    flax_model_for,
    greedy_decode,
    tiny_llama3_spec,
    tiny_random_llama_spec,
    write_tiny_model,
)
from rollout import RolloutWorker
from tests.helpers import CASES, Case, tiny_worker_config
from trainer_bridge import (
    DEFAULT_TARGET_MODULES,
    LoraConfig,
    SyncError,
    flatten_params,
    load_hf_params,
    unflatten_params,
)

PROMPTS = [[5, 17, 42, 8, 100, 3, 250, 251, 252, 7, 9, 11, 64, 65, 66, 300], [100, 3], [12, 34, 56]]
NEW_TOKENS = 8
# fp32 engine vs fp32 Flax model: float rounding only (tests/test_logprobs.py uses the same).
LOGPROB_ATOL = 1e-4


def greedy(worker):
    return worker.generate(PROMPTS, temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True).completions


def save_checkpoint(path, tree):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    return path


@dataclasses.dataclass
class Served:
    case: Case
    model_dir: Path
    config: dict
    params: dict  # host arrays, trainer layout
    reference: list  # the Flax model's greedy tokens
    worker: RolloutWorker


@pytest.fixture(
    scope="module",
    params=[pytest.param(c, id=c.id, marks=getattr(pytest.mark, f"{c.end}_end")) for c in CASES],
)
def served(request, tmp_path_factory):
    case = request.param
    model_dir = write_tiny_model(tmp_path_factory.mktemp(case.id), case.spec(), with_tokenizer=False)
    config = json.loads((model_dir / "config.json").read_text())
    params = load_hf_params(model_dir)
    reference = greedy_decode(flax_model_for(config), params, PROMPTS, NEW_TOKENS)
    worker_config = tiny_worker_config(model_dir, load_format="dummy", tp_size=case.tp_size)
    with RolloutWorker(worker_config) as worker:
        yield Served(case, model_dir, config, params, reference, worker)


def transformed(served) -> list:
    """Mapping entries whose engine leaf is not the trainer's array as it is: transposed heads,
    and k/v projections whose heads the engine repeats (tp_size > num_key_value_heads)."""
    repeat = served.case.tp_size > served.config["num_key_value_heads"]
    return [
        m
        for m in served.worker.mappings
        if m.engine_transform is EngineTransform.TRANSPOSE
        or (m.engine_transform is EngineTransform.REPEAT_KV_HEADS and repeat)
    ]


def test_placed_tree_copies_only_transformed_leaves_and_serves_the_flax_policy(served):
    worker = served.worker
    assert greedy(worker) != served.reference, "dummy weights must not already give the answer"
    tree = jax.device_put(served.params, worker.param_shardings())
    report = worker.sync_params(tree)
    copies = transformed(served)
    by_path = {leaf.path: leaf for leaf in worker.leaves}
    leaves = worker.engine.weight_leaves()
    assert report.leaves_copied == len(copies)
    assert report.bytes_copied == sum(leaves[by_path[m.engine].index].nbytes for m in copies)
    assert report.leaves_aliased == len(worker.mappings) - len(copies)
    assert greedy(worker) == served.reference
    worker.check_consistency(tree, PROMPTS, n=2, max_new_tokens=NEW_TOKENS, atol=LOGPROB_ATOL)


def test_load_hf_and_load_checkpoint_serve_the_flax_policy(served, tmp_path):
    worker = served.worker
    scaled = jax.tree_util.tree_map(lambda x: x * 1.1, served.params)
    worker.sync_params(scaled)
    assert greedy(worker) != served.reference
    worker.load_hf(served.model_dir)
    assert greedy(worker) == served.reference
    worker.sync_params(scaled)
    worker.load_checkpoint(save_checkpoint(tmp_path / "ckpt", served.params))
    assert greedy(worker) == served.reference
    worker.check_consistency(served.params, PROMPTS, max_new_tokens=NEW_TOKENS, atol=LOGPROB_ATOL)


def first_mismatching_path(mappings, flat) -> str:
    """The path a SyncError must name first: an expected path the tree lacks (table order), else
    a path the tree has and the table does not."""
    expected = [m.trainer for m in mappings]
    missing = [p for p in expected if p not in flat]
    return missing[0] if missing else next(p for p in flat if p not in set(expected))


def test_another_familys_tree_is_refused_naming_the_first_mismatching_path(served, tmp_path):
    worker = served.worker
    worker.sync_params(served.params)
    other_family = "qwen2" if served.case.family != "qwen2" else "llama"
    other = next(c for c in CASES if c.family == other_family)
    flat = flatten_params(load_hf_params(write_tiny_model(tmp_path, other.spec(), with_tokenizer=False)))
    with pytest.raises(SyncError, match=re.escape(first_mismatching_path(worker.mappings, flat))):
        worker.sync_params(flat)
    assert greedy(worker) == served.reference


def random_adapters(served, rank=4, alpha=8.0):
    """Adapters on every projection kernel the family has (rank 4, B non-zero, so that they change
    the policy), the same tree merged on the host, and their LoraConfig."""
    flat = flatten_params(served.params)
    kernels = [m.trainer for m in served.worker.mappings if m.trainer.endswith(".kernel")]
    targets = tuple(sorted({k.rsplit(".", 2)[-2] for k in kernels} & set(DEFAULT_TARGET_MODULES)))
    config = LoraConfig(rank=rank, alpha=alpha, target_modules=targets)
    rng = np.random.default_rng(served.case.tp_size)
    adapters, merged = {}, dict(flat)
    for kernel in kernels:
        if kernel.rsplit(".", 2)[-2] in targets:
            module, (in_dim, out_dim) = kernel.removesuffix(".kernel"), flat[kernel].shape
            a = (rng.normal(size=(in_dim, rank)) * 0.1).astype(np.float32)
            b = (rng.normal(size=(rank, out_dim)) * 0.1).astype(np.float32)
            adapters |= {f"{module}.lora_a": a, f"{module}.lora_b": b}
            merged[kernel] = flat[kernel] + config.scale * a @ b
    return unflatten_params(adapters), unflatten_params(merged), config


@pytest.fixture(scope="module")
def lora(served):
    """(adapters, the base with them merged, their LoraConfig, the Flax model's greedy tokens
    with them merged)."""
    adapters, merged, config = random_adapters(served)
    reference = greedy_decode(flax_model_for(served.config), merged, PROMPTS, NEW_TOKENS)
    assert reference != served.reference, "the adapters must change the policy"
    return adapters, merged, config, reference


def test_lora_adapters_merged_at_sync_serve_the_flax_policy_with_them_merged(served, lora, tmp_path):
    """sync_params(base, adapters=..., lora=...): greedy tokens and log-probs of the Flax model
    with the adapters merged; a broken adapter tree is refused and the merged policy serves on;
    adapters alone need a worker that keeps its base (unmerged_lora)."""
    worker = served.worker
    adapters, merged, config, reference = lora
    base = jax.device_put(served.params, worker.param_shardings())
    report = worker.sync_params(base, adapters=adapters, lora=config)
    kernels = {path.rsplit(".", 1)[0] + ".kernel" for path in flatten_params(adapters)}
    assert len(kernels) > 0 and report.bytes_merged == sum(flatten_params(base)[k].nbytes for k in kernels)
    assert greedy(worker) == reference
    # A host base (load_hf_params' numpy) is merged where the engine keeps each kernel, which it
    # then serves as it is: merged on JAX's default device, a tp 2 engine's copied them again.
    report = worker.sync_params(served.params, adapters=adapters, lora=config)
    as_is = kernels - {m.trainer for m in transformed(served)}
    assert report.bytes_aliased == sum(flatten_params(base)[k].nbytes for k in as_is) > 0
    assert greedy(worker) == reference
    worker.check_consistency(merged, PROMPTS, n=2, max_new_tokens=NEW_TOKENS, atol=LOGPROB_ATOL)
    broken = flatten_params(adapters)
    dropped = next(path for path in broken if path.endswith(".lora_b"))
    del broken[dropped]
    with pytest.raises(SyncError, match=re.escape(f"'{dropped.removesuffix('_b')}_a' has no lora_b beside it")):
        worker.sync_params(base, adapters=unflatten_params(broken), lora=config)
    nan = flatten_params(adapters)
    nan[dropped] = np.full(nan[dropped].shape, np.nan, np.float32)
    with pytest.raises(SyncError, match=re.escape(f"non-finite values (nan/inf) in: {dropped}")):  # not its kernel
        worker.sync_params(base, adapters=unflatten_params(nan), lora=config)
    wide = flatten_params(adapters)
    wide[dropped] = np.full(wide[dropped].shape, 1e300)  # float64: finite as given, inf in float32
    with pytest.raises(
        SyncError,
        match=re.escape(
            "values beyond float32's range (|x| > 3.40282e+38), finite in the adapters, infinite in the float32 "
            f"merge, in: {dropped}"
        ),
    ):
        worker.sync_params(base, adapters=unflatten_params(wide), lora=config)
    huge = flatten_params(adapters)  # finite in float32, each; their product is not
    factor_a = dropped.removesuffix("_b") + "_a"
    huge[factor_a], huge[dropped] = np.full(huge[factor_a].shape, 1e19), np.full(huge[dropped].shape, 1e19)
    kernel = dropped.removesuffix(".lora_b") + ".kernel"
    with pytest.raises(
        SyncError, match=re.escape(f"{kernel}: finite in the base tree, as are their adapters, but not")
    ):
        worker.sync_params(base, adapters=unflatten_params(huge), lora=config, check_finite=True)
    with pytest.raises(SyncError, match=re.escape("start it with WorkerConfig(unmerged_lora=LoraConfig(...))")):
        worker.sync_adapters(adapters)
    with pytest.raises(SyncError, match="holds LoRA adapters alone; loading them onto the served base needs"):
        worker.load_checkpoint(save_checkpoint(tmp_path / "adapters", adapters))
    assert greedy(worker) == reference


def test_lora_adapters_computed_unmerged_serve_the_flax_policy_with_them_merged(served, lora):
    """A worker started with unmerged_lora (the engine computes x @ W + scale * (x @ A) @ B):
    greedy tokens and log-probs of the Flax model with the adapters merged, the base aliased,
    and adapters alone synced without touching a base leaf."""
    adapters, merged, config, reference = lora
    worker_config = tiny_worker_config(
        served.model_dir, load_format="dummy", tp_size=served.case.tp_size, unmerged_lora=config
    )
    with RolloutWorker(worker_config) as worker:
        report = worker.sync_params(
            jax.device_put(served.params, worker.param_shardings()), adapters=adapters, lora=config
        )
        factors = [leaf for leaf in worker.leaves if leaf.path.endswith((".lora_a", ".lora_b"))]
        assert len(factors) == len(flatten_params(adapters))
        assert report.leaves_copied == len(transformed(served)) + len(factors)  # host adapters: copied
        assert greedy(worker) == reference
        worker.check_consistency(merged, PROMPTS, n=2, max_new_tokens=NEW_TOKENS, atol=LOGPROB_ATOL)
        alone = worker.sync_adapters(adapters)
        assert (alone.leaves_copied, alone.leaves_aliased) == (len(factors), 0)
        assert alone.bytes_copied == sum(int(np.prod(leaf.shape)) * 4 for leaf in factors)
        assert greedy(worker) == reference


def test_flax_llama_equals_hf_transformers_flax_llama(tmp_path):
    """The trainer's Flax Llama against transformers' own (Flax) Llama on the same weights."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxLlamaForCausalLM"):
        pytest.skip("this transformers has no Flax Llama")
    from flax.traverse_util import unflatten_dict
    from safetensors.numpy import load_file

    model_dir = write_tiny_model(tmp_path, tiny_random_llama_spec(), with_tokenizer=False)
    hf_config = transformers.LlamaConfig.from_pretrained(model_dir)
    hf_model = transformers.FlaxLlamaForCausalLM(hf_config, dtype=np.float32, _do_init=False)
    hf_params = {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        *module, kind = name.split(".")
        if "embed_tokens" in name:
            hf_params[(*module, "embedding")] = tensor
        elif "norm" in name:
            hf_params[(*module, "weight")] = tensor
        else:
            hf_params[(*module, "kernel")] = tensor.T
    tokens = np.asarray([PROMPTS[0]], np.int32)
    expected = np.asarray(hf_model(tokens, params=unflatten_dict(hf_params)).logits)
    config = json.loads((model_dir / "config.json").read_text())
    logits = np.asarray(jax.jit(flax_model_for(config).apply)({"params": load_hf_params(model_dir)}, tokens))
    np.testing.assert_allclose(logits, expected, atol=1e-4)


@pytest.fixture(scope="module")
def llama3_from_safetensors(tmp_path_factory):
    """A Llama-3-style model (head_dim 64, llama3 RoPE) booted straight from its safetensors."""
    model_dir = write_tiny_model(
        tmp_path_factory.mktemp("llama3-auto"), tiny_llama3_spec(seed=21), with_tokenizer=False
    )
    with RolloutWorker(tiny_worker_config(model_dir, load_format="auto")) as worker:
        yield worker, model_dir


def test_llama3_rope_scaling_gives_the_trainers_positions(llama3_from_safetensors):
    """Pins "llama3-rope-scaling": without it the engine ignores the scaling and diverges from
    the trainer after a few tokens."""
    worker, model_dir = llama3_from_safetensors
    params = load_hf_params(model_dir)
    model = flax_model_for(json.loads((model_dir / "config.json").read_text()))
    assert greedy(worker) == greedy_decode(model, params, PROMPTS, NEW_TOKENS)
    worker.check_consistency(params, PROMPTS, n=2, max_new_tokens=NEW_TOKENS, atol=LOGPROB_ATOL)


def test_head_dim_64_boots_from_safetensors_and_generates_the_flax_tokens(tmp_path):
    """Pins "head-dim-padding": a Qwen2.5-0.5B-like model (head_dim 64, biases, 2 KV heads)
    loaded by the engine's own safetensors loader, tensor-parallel."""
    spec = TinyModelSpec(num_attention_heads=4, num_key_value_heads=2, head_dim=64, seed=22)
    model_dir = write_tiny_model(tmp_path, spec, with_tokenizer=False)
    params = load_hf_params(model_dir)
    reference = greedy_decode(flax_model_for(spec.hf_config()), params, PROMPTS, NEW_TOKENS)
    with RolloutWorker(tiny_worker_config(model_dir, load_format="auto", tp_size=2)) as worker:
        assert greedy(worker) == reference


@pytest.fixture(scope="module")
def llama_pool(tmp_path_factory):
    """The tiny-random-LlamaForCausalLM shapes with a tokenizer, two engines (dp_size=2) booted
    from safetensors: the set-up of the seeds' several-engines and HTTP admin runs."""
    model_dir = write_tiny_model(tmp_path_factory.mktemp("llama-pool"), tiny_random_llama_spec(seed=23))
    with RolloutWorker(tiny_worker_config(model_dir, load_format="auto", dp_size=2)) as worker:
        yield worker, model_dir


def test_llama_engine_pool_and_kv_drop_rebuild(llama_pool):
    worker, model_dir = llama_pool
    params = load_hf_params(model_dir)
    reference = greedy_decode(
        flax_model_for(json.loads((model_dir / "config.json").read_text())), params, PROMPTS, NEW_TOKENS
    )
    assert greedy(worker) == reference
    report = worker.sync_params(jax.device_put(params, worker.param_shardings()))
    # Only the untied head is transposed; every engine aliases the rest.
    assert [r.leaves_copied for r in report.per_engine] == [1, 1]
    assert greedy(worker) == reference
    dropped = worker.drop_kv()
    assert dropped.bytes > 0 and worker.memory().kv_bytes == 0
    assert greedy(worker) == reference  # rebuilds first
    assert worker.memory().kv_bytes == dropped.bytes


def test_llama_http_admin_checksum_perturb_reload(llama_pool):
    import httpx

    from bench.serve_load import ADMIN_TOKEN

    worker, model_dir = llama_pool
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    reload = {"path": str(model_dir), "format": "hf"}

    def complete(http):
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        return http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]

    with (
        worker.serve(admin_token=ADMIN_TOKEN, served_model_name="tiny") as server,
        httpx.Client(base_url=server.url, timeout=120) as http,
    ):
        assert http.post("/admin/reload_weights", json=reload, headers=admin).status_code == 200
        original = http.get("/admin/weights_checksum", headers=admin).json()
        assert original["leaves"] == len(worker.mappings)
        before = complete(http)
        perturbed = http.post("/admin/perturb_weights", json={"seed": 3, "scale": 0.05, "num_leaves": 4}, headers=admin)
        assert perturbed.json()["checksum_after"] != original["checksum"]
        assert http.post("/admin/reload_weights", json=reload, headers=admin).status_code == 200
        assert http.get("/admin/weights_checksum", headers=admin).json()["checksum"] == original["checksum"]
        assert complete(http) == before


@pytest.mark.oldest_end  # an example's path on a family, float32: the other end runs the MoE family's
def test_grpo_example_runs_on_tiny_llama(tmp_path):
    """``python -m examples.grpo --preset tiny-llama`` as a user runs it (3 steps): every step
    syncs only the untied head (vocab 32 x hidden 256 float32) and the engine serves the
    trainer's policy (checked every step)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    command = [
        sys.executable,
        "-m",
        "examples.grpo",
        "--preset",
        "tiny-llama",
        "--output-dir",
        str(tmp_path),
        "--no-progress",
        "--no-plot",
        "--steps",
        "3",
        "--check-consistency-every",
        "1",
    ]
    result = subprocess.run(
        command, cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["bytes_copied"] == 32 * 256 * 4 for r in records)
    assert all(r["consistency_max"] < LOGPROB_ATOL for r in records)
