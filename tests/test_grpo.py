"""GRPO example: the update's logs, real tiny runs, the qwen2.5-3b preset on a local stand-in (its
math, tasks and config checks: tests/unit/)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.grpo import GRPO, GRPOConfig
from examples.rl_loop import Policy, Rollout
from models import CausalLM, DecoderConfig
from tests.helpers import GSM8K_SAMPLE
from trainer_bridge import checkpoint_tree_metadata, flatten_params, load_hf_params

REPO = Path(__file__).resolve().parents[1]


def test_grpo_update_logs_entropy_and_warns_when_no_group_has_a_signal(qwen2_dir, caplog):
    """The update's statistics carry the rollout policy's entropy on the sampled tokens (from
    the old log-probs' forward) and frac_reward_zero_std; a step whose every group earned equal
    rewards is logged as a warning (its advantages are all 0)."""
    model = CausalLM(DecoderConfig.from_hf(qwen2_dir))
    params = jax.tree_util.tree_map(jnp.asarray, load_hf_params(qwen2_dir))
    grpo = GRPO(GRPOConfig(group_size=2, prompts_per_step=2, temperature=2.0), Policy(model, params, qwen2_dir))
    tokens = jnp.array([[0, 5, 6, 7, 8], [0, 5, 6, 9, 10], [5, 6, 7, 8, 9], [5, 6, 7, 11, 12]])
    arrays = {
        "tokens": tokens,
        "attention_mask": tokens > 0,
        "positions": jnp.maximum(jnp.cumsum(tokens > 0, axis=1) - 1, 0),
        "completion_mask": jnp.array([[0, 0, 0, 1, 1]] * 4),
    }
    logits = jax.jit(model.apply)({"params": params}, tokens, arrays["attention_mask"], arrays["positions"]) / 2.0
    logp = jax.nn.log_softmax(logits[:, 2:4], axis=-1)  # the distributions the completion tokens were drawn from
    expected_entropy = float(-(jnp.exp(logp) * logp).sum(-1).mean())

    def update(rewards):
        trees = grpo.init_trees(jax.tree_util.tree_map(jnp.copy, params))  # the train step donates
        return grpo.update(trees, Rollout([], None, np.array(rewards, np.float32), arrays, step=6))[1]

    def warned():  # the handler sees every logger's warnings: another's would not be the update's
        return [r.getMessage() for r in caplog.records if r.name == "examples.grpo"]

    with caplog.at_level("WARNING", logger="examples.grpo"):
        stats = update([1.0, 0.0, 0.5, 0.5])
        assert float(stats["frac_reward_zero_std"]) == 0.5 and not warned()
        assert float(stats["entropy"]) == pytest.approx(expected_entropy, rel=1e-5)
        stats = update([0.5, 0.5, 0.0, 0.0])
    assert float(stats["frac_reward_zero_std"]) == 1.0 and float(stats["grad_norm"]) == 0.0
    assert warned() == [
        "step 7: every group's samples earned equal rewards: all advantages are 0, the update has no signal"
    ]


def run_grpo(output_dir, *args, devices: int = 1):
    """The example as a user runs it, in a fresh process with ``devices`` CPU devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    command = [
        sys.executable,
        "-m",
        "examples.grpo",
        "--output-dir",
        str(output_dir),
        "--no-progress",
        "--no-plot",
        *args,
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def mean_reward(records):
    return float(np.mean([r["reward"] for r in records]))


STEPS = 30
# The learning tests run the tiny task as the Llama and MoE presets do (examples.grpo.TINY: near
# answers earn up to 0.5, 16 samples a group, a constant learning rate): a step costs half of
# the demo preset's (exact answers only, 32 a group, a decaying rate: `make demo`, its curve in
# docs/benchmarks.md), and the thresholds below were measured on it.
SHAPED = ("--near-credit", "0.5", "--group-size", "16", "--no-lr-decay")
# The reward gain (last 5 minus first 5 steps) the tiny preset must make in STEPS steps. Measured
# on this machine (jax 0.8) over seeds 0-3: 0.466 / 0.417 / 0.459 / 0.406; the bar sits 0.1 below
# the smallest. Rewards are means over 128 samples: five-step means of a fixed policy differ by
# about 0.015 (standard deviation), so the margin is several of those and another CPU's rounding
# cannot flip the claim, while a broken update (wrong sign, advantages not reaching the loss)
# stays near the start (the ablation below: 0.026).
GAIN = 0.3


@pytest.mark.example_run
def test_tiny_grpo_learns_and_the_ablation_does_not(tmp_path):
    """The preset learns (GAIN) and keeps a learning signal: no step after the first 10 has most
    of its groups without reward spread (at most a quarter of them seen, seeds 0-3). The policy
    starts near uniform over its 32 tokens (entropy of the sampled tokens ~3.1, log 32 = 3.47)
    and sharpens (~1.5 after 30 steps). It runs with the engine's log-probs, TIS and the periodic
    consistency check: in fp32 engine and trainer agree, so the logged mismatch is float
    rounding and the TIS weights are 1 (the update is the plain one). An ablation that never
    re-syncs (same prompts, same seed) must stay within 0.06 of where it started."""
    engine_logprobs = ("--tis-cap", "2", "--check-consistency-every", "10")
    trained = run_grpo(tmp_path / "trained", *SHAPED, *engine_logprobs, "--steps", str(STEPS))
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert all(r["bytes_copied"] == 0 for r in trained), "params placed like the engine: zero-copy syncs"
    assert mean_reward(trained[-5:]) - mean_reward(trained[:5]) > GAIN
    for key in ("entropy", "frac_reward_zero_std", "approx_kl", "clip_fraction", "completion_tokens", "solved"):
        assert all(np.isfinite(r[key]) for r in trained), key
    assert max(r["frac_reward_zero_std"] for r in trained[10:]) < 0.5
    assert trained[0]["entropy"] > 2.5 and np.mean([r["entropy"] for r in trained[-5:]]) < trained[0]["entropy"] - 0.8
    assert all(r["mismatch_max"] < 1e-4 and abs(r["mismatch_kl"]) < 1e-8 for r in trained)
    assert all(r["tis_weight"] == pytest.approx(1.0, abs=1e-3) and r["tis_capped"] == 0 for r in trained)
    assert [r["step"] for r in trained if "consistency_max" in r] == [1, 11, 21]

    ablation = run_grpo(tmp_path / "ablation", *SHAPED, "--steps", str(STEPS), "--no-resync")
    assert abs(mean_reward(ablation[-5:]) - mean_reward(ablation[:5])) < 0.06
    assert mean_reward(ablation[-5:]) < mean_reward(trained[-5:]) - GAIN

    # Resume: the same output dir continues from the last checkpoint with the trained weights.
    resumed = run_grpo(tmp_path / "trained", *SHAPED, *engine_logprobs, "--steps", str(STEPS + 5))
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 6))
    assert mean_reward(resumed[-5:]) > mean_reward(trained[:5]) + GAIN


@pytest.mark.example_run_newest
def test_tiny_moe_grpo_in_bfloat16_with_routing_replay_keeps_learning(tmp_path):
    """The MoE preset in bf16 (engine and trainer), every policy forward routed as the engine
    routed (--routing-replay): it learns as the dense preset does (GAIN; at jax 0.12 seeds 0-1
    gained 0.470 / 0.392 in ~32 s, at jax 0.8 0.392 / 0.381 in 48-52 s) and is still learning in
    the second half; the engine-trainer mismatch stays within the dense bf16 bound at every step
    (measured at most 0.051), while the trainer's own routers would have picked other experts for
    some tokens (routing_differs, up to 6% a step)."""
    records = run_grpo(
        tmp_path / "moe",
        "--preset",
        "tiny-moe",
        "--dtype",
        "bfloat16",
        "--routing-replay",
        "--return-logprobs",
        "--steps",
        str(STEPS),
    )
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    first, middle, last = (mean_reward(records[i : i + 5]) for i in (0, 12, STEPS - 5))
    assert last - first > GAIN and first < middle < last
    assert max(r["frac_reward_zero_std"] for r in records[10:]) < 0.5
    assert np.mean([r["entropy"] for r in records[-5:]]) < records[0]["entropy"] - 0.8
    assert all(r["mismatch_max"] < 0.25 for r in records)
    differs = [r["routing_differs"] for r in records]
    assert all(0 <= d < 0.2 for d in differs) and max(differs) > 0


@pytest.mark.example_run
def test_async_grpo_overlaps_generation_and_learns(tmp_path):
    """Trainer on 2 devices, engine on the other 2: each step trains on the rollout generated
    during the previous update (one version behind, TIS-corrected) and learns as the plain
    run does (20 steps: measured gains of 0.19 and more, against a 5-step noise of ~0.02)."""
    steps = 20
    records = run_grpo(
        tmp_path / "async", *SHAPED, "--steps", str(steps), "--async-rollout", "--tis-cap", "2", devices=4
    )
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # The first rollout is the initial policy's; later tokens are 1 version behind, or 0 where
    # the pushed weights reached a rollout still running (how many of them: how fast generation
    # runs beside the update, which a loaded host changes; rollouts run after each update would
    # have none behind).
    lags = [r["version_lag"] for r in records]
    assert lags[0] == 0 and all(0 <= lag <= 1 for lag in lags) and np.mean(lags[1:]) > 0
    assert all(r["bytes_copied"] > 0 for r in records), "the engine's devices hold their own copy"
    elapsed = [r["elapsed_s"] for r in records]
    assert all(0 < r["step_s"] <= e for r, e in zip(records, elapsed)) and elapsed == sorted(elapsed)
    assert mean_reward(records[-5:]) - mean_reward(records[:5]) > 0.1


@pytest.mark.example_path
def test_consistency_check_stops_a_run_whose_engine_serves_another_policy(tmp_path):
    """The ablation never re-syncs: after a few updates the engine no longer serves the
    trainer's params, and the periodic check stops the run naming the statistic."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    command = [
        sys.executable,
        "-m",
        "examples.grpo",
        "--output-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--no-plot",
        "--no-resync",
        "--steps",
        "4",
        "--check-consistency-every",
        "3",
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode != 0
    assert "grpo stopped: step 4: train-inference mismatch: max |Δ log p|" in result.stderr, result.stderr[-3000:]


@pytest.mark.example_path
def test_a_resume_after_an_interruption_logs_each_step_once(tmp_path):
    """A run killed after step 3's record, during its checkpoint's write (orbax's temporary dir
    left, checkpoint 2 the last) and half-way through writing a record: the rerun resumes from
    step 2, runs step 3 again and leaves metrics.jsonl with steps 1-4 once each."""
    small = ("--prompts-per-step", "2", "--group-size", "2", "--checkpoint-every", "2")
    first = run_grpo(tmp_path / "run", *small, "--steps", "3")
    assert [r["step"] for r in first] == [1, 2, 3]
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "3").rename(checkpoints / "3.orbax-checkpoint-tmp")
    with (tmp_path / "run" / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 4, "rew')
    resumed = run_grpo(tmp_path / "run", *small, "--steps", "4")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[:2] == first[:2]
    # The weights are versioned by step: the resumed steps' as the uninterrupted run's (not 1, 2).
    assert [r["weight_version"] for r in resumed] == [1, 2, 3, 4]
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2", "4"]


@pytest.mark.example_path
def test_qwen25_3b_preset_path_on_a_local_stand_in(chat_dir, tmp_path):
    """The qwen2.5-3b preset end to end with its downloads replaced by local files: chat
    template from the tokenizer, GSM8K rows and rewards, initial weights from the HF dir, the
    KL penalty to the reference model, checkpoints and resume. The other overrides only make it
    fit a CPU; a TPU user runs ``python -m examples.grpo --preset qwen2.5-3b``."""
    local = ["--preset", "qwen2.5-3b", "--model", str(chat_dir), "--dataset", str(GSM8K_SAMPLE)]
    cpu = "--prompts-per-step 2 --max-new-tokens 16 --dtype float32 --tp-size 1 --kv-tokens 8192 --checkpoint-every 1"
    records = run_grpo(tmp_path / "run", *local, *cpu.split(), "--steps", "2")
    assert [r["step"] for r in records] == [1, 2]
    # The KL penalty ran against a reference equal to the initial policy (a reference loaded
    # wrongly, e.g. random, would be far off). The random stand-in earns no GSM8K reward, so
    # its advantages are zero and the policy stays where it started.
    assert all("ref_kl" in r for r in records)
    assert records[0]["ref_kl"] == pytest.approx(0.0, abs=1e-6)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["1", "2"]
    resumed = run_grpo(tmp_path / "run", *local, *cpu.split(), "--steps", "3")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    # After two updates: Adam turns the float noise of zero-advantage gradients into steps of
    # about the learning rate, so the policy drifts by a hair (1.3e-6 seen on jax 0.12); a wrong
    # reference would be off by orders of magnitude more.
    assert resumed[2]["ref_kl"] == pytest.approx(0.0, abs=1e-4)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "3"]


@pytest.mark.example_path
def test_qwen25_3b_tools_preset_path_on_a_local_stand_in(chat_dir, tmp_path):
    """The qwen2.5-3b-tools preset on local files: GSM8K rows with the calculator in the chat
    template's tools (the tiny template lays them out as Qwen2.5's does), episodes of up to two
    turns, GSM8K's reward on the final answer, the KL reference. The random stand-in writes no
    tool call: this is the path, not learning. The overrides only make it fit a CPU (the tiny
    tokenizer spends ~650 tokens on these prompts with the tools block)."""
    local = ["--preset", "qwen2.5-3b-tools", "--model", str(chat_dir), "--dataset", str(GSM8K_SAMPLE)]
    cpu = (
        "--prompts-per-step 2 --group-size 2 --max-prompt-tokens 700 --max-new-tokens 48 --turn-tokens 16 "
        "--max-turns 2 --dtype float32 --tp-size 1 --kv-tokens 8192"
    )
    (record,) = run_grpo(tmp_path / "run", *local, *cpu.split(), "--steps", "1")
    assert 1 <= record["turns"] <= 2 and record["completion_tokens"] <= 48
    assert record["ref_kl"] == pytest.approx(0.0, abs=1e-6)
    assert 0 <= record["tool_call_success"] <= 1 and np.isfinite(record["entropy"])


@pytest.mark.example_path
def test_decode_chunks_leave_a_tool_preset_run_unchanged(chat_dir, tmp_path):
    """--decode-steps 8: the engines decode 8 steps per dispatch through the episodes of the
    qwen2.5-3b-tools preset on its stand-in (sessions, turns of 16 tokens; the random model
    writes no tool call, so an episode is one turn) and the run logs what the one-step run
    logs, to the bit (the chunks' tokens and log-probs are the one-step forward's on CPU:
    tests/test_multistep.py), but its timings and prefill_saved: which episodes share a
    prefill, and so find each other's prompts in the cache or not, follows when each arrives
    (two one-step runs read 0.41 and 0.66 on one step)."""
    local = ["--preset", "qwen2.5-3b-tools", "--model", str(chat_dir), "--dataset", str(GSM8K_SAMPLE)]
    cpu = (
        "--prompts-per-step 2 --group-size 2 --max-prompt-tokens 700 --max-new-tokens 48 --turn-tokens 16 "
        "--max-turns 2 --dtype float32 --tp-size 1 --kv-tokens 8192 --steps 2 --temperature 1.5"
    ).split()
    timed = {"elapsed_s", "sync_s", "generate_s", "train_s", "prefill_saved"}

    def untimed(records):
        return [{k: v for k, v in r.items() if k not in timed} for r in records]

    one_step = run_grpo(tmp_path / "one", *local, *cpu)
    chunked = run_grpo(tmp_path / "chunked", *local, *cpu, "--decode-steps", "8")
    assert untimed(chunked) == untimed(one_step)
    assert sum(r["completion_tokens"] for r in one_step) > 0


@pytest.mark.example_run_newest
def test_lora_grpo_keeps_learning_and_trains_and_checkpoints_only_the_adapters(tmp_path):
    """--lora-rank 8 on the shaped tiny task: it learns as the full-parameter run does (GAIN; at
    jax 0.12 seeds 0-1 gained 0.386 / 0.390 in ~22 s, full-parameter runs 0.3-0.4) and is still
    learning in the second half. The trainer's tree and its checkpoints are the adapters (Adam's
    state adapter-sized), the policy starts as the base (fresh B = 0: no KL to the reference at
    step 1), each sync merges them into buffers the engine takes (nothing copied after the
    merge), and the run resumes from its checkpoint."""
    args = ("--lora-rank", "8", "--learning-rate", "3e-3", "--checkpoint-every", "10")
    records = run_grpo(tmp_path / "run", *SHAPED, *args, "--steps", str(STEPS))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    first, middle, last = (mean_reward(records[i : i + 5]) for i in (0, 12, STEPS - 5))
    assert last - first > GAIN and first < middle < last
    assert max(r["frac_reward_zero_std"] for r in records[10:]) < 0.5
    assert np.mean([r["entropy"] for r in records[-5:]]) < records[0]["entropy"] - 0.8
    # The reference is the base: no KL at the start, some once the adapters have moved.
    assert records[0]["ref_kl"] == pytest.approx(0.0, abs=1e-6) and records[-1]["ref_kl"] > 1e-3
    assert all(r["bytes_copied"] == 0 for r in records)
    saved = checkpoint_tree_metadata(tmp_path / "run" / "checkpoints" / str(STEPS) / "default")
    assert {path.rpartition(".")[2] for path in flatten_params(saved["params"])} == {"lora_a", "lora_b"}
    moments = [leaf for leaf in jax.tree_util.tree_leaves(saved["opt_state"]) if len(getattr(leaf, "shape", ())) == 2]
    assert moments and all(8 in tuple(leaf.shape) for leaf in moments), "Adam's moments are adapter-sized"
    resumed = run_grpo(tmp_path / "run", *SHAPED, *args, "--steps", str(STEPS + 1))
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 2))
    assert resumed[-1]["ref_kl"] > 1e-3, "the trained adapters were restored, not fresh ones"
    with pytest.raises(AssertionError, match="lora_rank"):
        run_grpo(tmp_path / "run", *SHAPED, "--lora-rank", "4", "--steps", str(STEPS + 2))


@pytest.mark.example_path
def test_async_grpo_with_lora_pushes_merged_adapters_to_the_engines_devices(tmp_path):
    """--async-rollout with --lora-rank: the trainer (2 devices) keeps the base and trains the
    adapters; each in-flight push merges them beside the base and copies the result to the
    engine's own devices, and the rollouts after the first are one version behind."""
    args = ("--async-rollout", "--tis-cap", "2", "--lora-rank", "4", "--learning-rate", "3e-3", "--steps", "3")
    records = run_grpo(tmp_path / "async", *SHAPED, *args, devices=4)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["bytes_copied"] > 0 for r in records), "the engine's devices hold their own copy"
    assert [r["version_lag"] for r in records][0] == 0 and all(0 <= r["version_lag"] <= 1 for r in records)
    assert records[0]["ref_kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.example_path
def test_async_grpo_with_unmerged_lora_pushes_the_adapters_alone(tmp_path):
    """--lora-unmerged: the engines compute the adapters beside their copy of the base, so each
    in-flight push after the first moves exactly the adapters' bytes to each engine (the base,
    on the trainer's devices, stays as the first push placed it)."""
    args = ("--async-rollout", "--tis-cap", "2", "--lora-rank", "4", "--lora-unmerged", "--learning-rate", "3e-3")
    records = run_grpo(tmp_path / "async", *SHAPED, *args, "--steps", "3", "--checkpoint-every", "3", devices=4)
    saved = checkpoint_tree_metadata(tmp_path / "async" / "checkpoints" / "3" / "default")
    adapter_bytes = sum(4 * int(np.prod(leaf.shape)) for leaf in flatten_params(saved["params"]).values())
    assert [r["bytes_copied"] for r in records] == [2 * adapter_bytes] * 3  # 2 engines, one device each
    assert records[0]["ref_kl"] == pytest.approx(0.0, abs=1e-6)


TOOL_STEPS = 15


@pytest.mark.example_run_newest
def test_tiny_tools_grpo_learns_to_call_the_calculator_and_answer(tmp_path):
    """--preset tiny-tools: a warm start, then episodes of up to 3 turns (a call to the calculator,
    its result, an answer) packed into the batch the update trains on. A step's reward swings with
    the problems it drew (seed 0 at jax 0.12 on a 2-core AMD EPYC with AVX-512: 0.22-0.45 per
    step), so the learning is judged on fixed eval problems (--eval-every: the same 32 problems x
    16 samples and seeds at steps 1, 8 and 15): there the reward went 0.259 -> 0.380 -> 0.416 and
    exact answers 0.049 -> 0.117 -> 0.141 on that CPU, while the episodes whose call computed their
    problem's product stayed at 0.84-1.0; groups keep a reward spread, and a later turn finds the
    earlier ones in the prefix cache (resumes: the other GRPO tests; the warm start in a run's
    identity: tests/unit/test_rl_loop.py). With the default 16 eval problems the exact answers are
    too few to judge: the same training run read 0.039 -> 0.047 -> 0.031 on the AMD CPU, where a
    2-core Intel Xeon's run (other numerics, another trajectory) had read 0.08 -> 0.11 -> 0.13."""
    records = run_grpo(
        tmp_path / "run",
        "--preset",
        "tiny-tools",
        "--steps",
        str(TOOL_STEPS),
        "--checkpoint-every",
        "5",
        "--eval-every",
        "7",
        "--eval-prompts",
        "32",
    )
    assert [r["step"] for r in records] == list(range(1, TOOL_STEPS + 1))
    for key in ("turns", "failed_call_fraction", "episodes_answered", "prefill_saved", "entropy", "approx_kl"):
        assert all(np.isfinite(r[key]) for r in records), key
    evaluations = [r for r in records if "eval_reward" in r]
    assert [r["step"] for r in evaluations] == [1, 8, 15]
    assert evaluations[-1]["eval_reward"] > evaluations[0]["eval_reward"] + 0.05
    assert evaluations[-1]["eval_solved"] > evaluations[0]["eval_solved"]

    def mean(key, rows):
        return float(np.mean([r[key] for r in rows]))

    assert mean("tool_call_success", records[-5:]) > max(0.9, mean("tool_call_success", records[:3]))
    assert max(r["frac_reward_zero_std"] for r in records) < 0.5
    assert all(1 <= r["turns"] <= 3 and r["completion_tokens"] <= 64 for r in records)
    assert min(r["prefill_saved"] for r in records) > 0.3
