"""GRPO example: math, rewards, the qwen2.5-3b preset's pieces, and real tiny runs."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.grpo import GRPO, PRESETS, GRPOConfig, parse_args
from examples.rl_loop import Policy, Rollout, Task, claim_output_dir
from examples.rl_update import make_optimizer
from examples.grpo_math import frac_reward_zero_std, group_advantages, ppo_clip_loss, token_logprobs
from examples.tasks import (
    addition_problems,
    addition_reward,
    extract_final_number,
    gsm8k_format_reward,
    gsm8k_problems,
    gsm8k_prompt,
    gsm8k_reference_answer,
    gsm8k_reward,
)
from models import QwenConfig, QwenForCausalLM, TinyModelSpec, write_tiny_model
from trainer_bridge import load_hf_params

REPO = Path(__file__).resolve().parents[1]
GSM8K_SAMPLE = REPO / "tests" / "data" / "gsm8k_sample.jsonl"  # GSM8K-format rows, written for these tests

# A real GSM8K train example (question and reference solution as the dataset stores them).
GSM8K_QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to "
    "friends in May. How many clips did Natalia sell altogether in April and May?"
)
GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)
GSM8K_THOUSANDS = "She earns 1,200 * 2 = <<1200*2=2400>>2400 dollars.\n#### 2,400"


def test_group_advantages():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    adv = group_advantages(rewards, 4)
    np.testing.assert_allclose(adv[:4], [1, -1, -1, 1], atol=1e-5)
    np.testing.assert_array_equal(adv[4:], 0.0)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        group_advantages(rewards, 3)


def test_frac_reward_zero_std_counts_the_groups_that_teach_nothing():
    # Groups of 4: mixed, all 0.5, all 0 (also with -0.0), mixed by a hair.
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, -0.0, 0.0, 0.0, 0.45, 0.45, 0.45, 0.4500001]
    assert float(frac_reward_zero_std(rewards, 4)) == 0.5
    assert float(frac_reward_zero_std(rewards, 16)) == 0.0
    assert float(frac_reward_zero_std(rewards[4:12], 4)) == 1.0
    # Where it is 1 every advantage is 0: the update has no signal.
    np.testing.assert_array_equal(group_advantages(rewards[4:12], 4), 0.0)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        frac_reward_zero_std(rewards, 3)


def test_grpo_update_logs_entropy_and_warns_when_no_group_has_a_signal(qwen2_dir, caplog):
    """The update's statistics carry the rollout policy's entropy on the sampled tokens (from
    the old log-probs' forward) and frac_reward_zero_std; a step whose every group earned equal
    rewards is logged as a warning (its advantages are all 0)."""
    model = QwenForCausalLM(QwenConfig.from_hf(qwen2_dir))
    params = jax.tree_util.tree_map(jnp.asarray, load_hf_params(qwen2_dir))
    grpo = GRPO(GRPOConfig(group_size=2, prompts_per_step=2, temperature=2.0), Policy(model, params, qwen2_dir))
    tokens = jnp.array([[0, 5, 6, 7, 8], [0, 5, 6, 9, 10], [5, 6, 7, 8, 9], [5, 6, 7, 11, 12]])
    arrays = {
        "tokens": tokens, "attention_mask": tokens > 0,
        "positions": jnp.maximum(jnp.cumsum(tokens > 0, axis=1) - 1, 0),
        "completion_mask": jnp.array([[0, 0, 0, 1, 1]] * 4),
    }
    logits = model.apply({"params": params}, tokens, arrays["attention_mask"], arrays["positions"]) / 2.0
    logp = jax.nn.log_softmax(logits[:, 2:4], axis=-1)  # the distributions the completion tokens were drawn from
    expected_entropy = float(-(jnp.exp(logp) * logp).sum(-1).mean())

    def update(rewards):
        trees = grpo.init_trees(jax.tree_util.tree_map(jnp.copy, params))  # the train step donates
        return grpo.update(trees, Rollout([], None, np.array(rewards, np.float32), arrays, step=6))[1]

    with caplog.at_level("WARNING", logger="examples.grpo"):
        stats = update([1.0, 0.0, 0.5, 0.5])
        assert float(stats["frac_reward_zero_std"]) == 0.5 and not caplog.records
        assert float(stats["entropy"]) == pytest.approx(expected_entropy, rel=1e-5)
        stats = update([0.5, 0.5, 0.0, 0.0])
    assert float(stats["frac_reward_zero_std"]) == 1.0 and float(stats["grad_norm"]) == 0.0
    assert [r.getMessage() for r in caplog.records] == [
        "step 7: every group's samples earned equal rewards: all advantages are 0, the update has no signal"
    ]


def test_warmup_ramps_adams_steps_from_zero():
    """Adam's first step moves each parameter by about the learning rate whatever its gradient;
    with warmup_updates, step k (counted from 0) is scaled by k / warmup_updates, then by 1."""
    params, grad = jnp.zeros(3), jnp.array([1e-3, 0.1, -0.2])  # global norm < 1: no clipping

    def steps(optimizer, count):
        state, moved = optimizer.init(params), []
        for _ in range(count):
            updates, state = optimizer.update(grad, state, params)
            moved.append(float(jnp.abs(updates).max()))
        return np.array(moved)

    plain, warm = steps(make_optimizer(1e-2), 6), steps(make_optimizer(1e-2, warmup_updates=4), 6)
    np.testing.assert_allclose(plain, 1e-2, rtol=1e-3)
    np.testing.assert_allclose(warm, 1e-2 * np.array([0, 0.25, 0.5, 0.75, 1, 1]), rtol=1e-3, atol=1e-9)


def test_token_logprobs_gather_the_next_token():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
    tokens = jnp.array([[1, 2, 3, 4, 5], [6, 0, 1, 2, 3]])
    got = token_logprobs(logits, tokens)
    expected = np.array(
        [[jax.nn.log_softmax(logits[b, t - 1])[tokens[b, t]] for t in range(1, 5)] for b in range(2)]
    )
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_ppo_clip_loss():
    old = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))
    mask = jnp.array([[1.0, 1.0, 0.0]])
    adv = jnp.array([2.0])
    loss, stats = ppo_clip_loss(old, old, adv, mask)
    assert float(loss) == pytest.approx(-2.0)
    assert float(stats["clip_fraction"]) == 0 and float(stats["approx_kl"]) == pytest.approx(0, abs=1e-7)
    # Ratio 1.5 with a positive advantage is clipped at 1.2: no gradient pushes it further.
    new = old + jnp.log(1.5)
    loss, stats = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2)
    assert float(loss) == pytest.approx(-1.2 * 2.0)
    assert float(stats["clip_fraction"]) == 1.0
    grad = jax.grad(lambda n: ppo_clip_loss(n, old, adv, mask, clip_eps=0.2)[0])(new)
    np.testing.assert_array_equal(grad, 0.0)
    # With a negative advantage the unclipped term is the minimum: the gradient stays.
    grad = jax.grad(lambda n: ppo_clip_loss(n, old, -adv, mask, clip_eps=0.2)[0])(new)
    assert float(grad[0, 0]) > 0 and float(grad[0, 2]) == 0  # masked token: no gradient
    # KL to a reference policy adds beta * k3 per token.
    ref = old
    loss_kl, stats = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2, ref_logprobs=ref, kl_beta=0.1)
    k3 = np.exp(np.log(1 / 1.5)) - np.log(1 / 1.5) - 1
    assert float(loss_kl - loss) == pytest.approx(0.1 * k3, rel=1e-5)
    assert float(stats["ref_kl"]) == pytest.approx(k3, rel=1e-5)


def test_addition_task_and_reward():
    problems = addition_problems(np.random.default_rng(0), 50)
    assert all(p.prompt == f"{p.prompt[0]}+{p.prompt[2]}=" for p in problems)
    assert all(int(p.answer) == int(p.prompt[0]) + int(p.prompt[2]) for p in problems)
    small = addition_problems(np.random.default_rng(0), 200, max_operand=4)
    assert {p.prompt[0] for p in small} == {p.prompt[2] for p in small} == set("01234")
    assert addition_reward("7", "7") == 1.0
    assert addition_reward(" 7 ", "7") == 1.0
    assert addition_reward("8", "7") == pytest.approx(0.45)
    assert addition_reward("17", "7") == 0.0
    assert addition_reward("7+", "7") == 0.0
    assert addition_reward("", "7") == 0.0


def test_gsm8k_answers_and_rewards():
    assert gsm8k_reference_answer(GSM8K_SOLUTION) == "72"
    assert gsm8k_reference_answer(GSM8K_THOUSANDS) == "2400"
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_reference_answer("72")
    good = "In May she sold 48/2 = 24 clips.\nIn total 48 + 24 = 72.\n#### 72"
    assert extract_final_number(good) == "72"
    assert gsm8k_reward(good, "72") == 1.5
    unformatted = "She sold 24 in May, so 72 clips in total."
    assert gsm8k_reward(unformatted, "72") == 1.0 and gsm8k_format_reward(unformatted) == 0.0
    wrong = "48 + 24 = 73\n#### 73"
    assert gsm8k_reward(wrong, "72") == 0.5
    assert extract_final_number("#### $2,400.00") == "2400"
    assert extract_final_number("no number here") is None


QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_gsm8k_prompt_uses_the_chat_template(qwen2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir)
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    prompt = gsm8k_prompt(tokenizer, GSM8K_QUESTION)
    assert prompt.startswith("<|im_start|>system\n")
    assert f"<|im_start|>user\n{GSM8K_QUESTION}<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids


def test_config_validation_and_presets():
    with pytest.raises(ValueError, match="preset must be one of"):
        GRPOConfig(preset="gpt5")
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="kv_tokens=100 cannot hold one step"):
        GRPOConfig(kv_tokens=100)
    with pytest.raises(ValueError, match="max_operand must be a digit"):
        GRPOConfig(max_operand=10)
    with pytest.raises(ValueError, match="needs a model and a dataset"):
        dataclasses.replace(PRESETS["qwen2.5-3b"], model=None)
    with pytest.raises(ValueError, match="needs a model and a dataset"):
        dataclasses.replace(PRESETS["qwen2.5-3b"], dataset=None)
    big = PRESETS["qwen2.5-3b"]
    assert big.model == "Qwen/Qwen2.5-3B-Instruct" and big.dataset == "openai/gsm8k" and big.dtype == "bfloat16"
    assert big.kl_beta > 0, "the preset trains against its reference model"
    assert big.prompts_per_step * big.group_size * (big.max_prompt_tokens + big.max_new_tokens) <= big.kv_tokens
    config = parse_args(["--preset", "qwen2.5-3b", "--steps", "3", "--no-resync"])
    assert config.steps == 3 and config.resync is False and config.max_new_tokens == 512


def run_grpo(output_dir, *args, devices: int = 1):
    """The example as a user runs it, in a fresh process with ``devices`` CPU devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    command = [sys.executable, "-m", "examples.grpo", "--output-dir", str(output_dir), "--no-progress", "--no-plot", *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def mean_reward(records):
    return float(np.mean([r["reward"] for r in records]))


STEPS = 30
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
    and sharpens (~1.5 after 30 steps). An ablation that never re-syncs (same prompts, same
    seed) must stay within 0.06 of where it started."""
    trained = run_grpo(tmp_path / "trained", "--steps", str(STEPS))
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert all(r["bytes_copied"] == 0 for r in trained), "params placed like the engine: zero-copy syncs"
    assert mean_reward(trained[-5:]) - mean_reward(trained[:5]) > GAIN
    for key in ("entropy", "frac_reward_zero_std", "approx_kl", "clip_fraction", "completion_tokens", "solved"):
        assert all(np.isfinite(r[key]) for r in trained), key
    assert max(r["frac_reward_zero_std"] for r in trained[10:]) < 0.5
    assert trained[0]["entropy"] > 2.5 and np.mean([r["entropy"] for r in trained[-5:]]) < trained[0]["entropy"] - 0.8

    ablation = run_grpo(tmp_path / "ablation", "--steps", str(STEPS), "--no-resync")
    assert abs(mean_reward(ablation[-5:]) - mean_reward(ablation[:5])) < 0.06
    assert mean_reward(ablation[-5:]) < mean_reward(trained[-5:]) - GAIN

    # Resume: the same output dir continues from the last checkpoint with the trained weights.
    resumed = run_grpo(tmp_path / "trained", "--steps", str(STEPS + 5))
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 6))
    assert mean_reward(resumed[-5:]) > mean_reward(trained[:5]) + GAIN


def test_truncated_importance_sampling_weights_the_policy_gradient():
    old = jnp.log(jnp.array([[0.5, 0.5, 0.2]]))
    behaviour = jnp.log(jnp.array([[0.25, 0.5, 0.5]]))  # weights 2 (capped at 1.5), 1, 0.4
    mask = jnp.array([[1.0, 1.0, 1.0]])
    adv = jnp.array([1.0])
    plain = jax.grad(lambda n: ppo_clip_loss(n, old, adv, mask)[0])(old)
    loss, stats = ppo_clip_loss(old, old, adv, mask, behaviour_logprobs=behaviour, tis_cap=1.5)
    grad = jax.grad(lambda n: ppo_clip_loss(n, old, adv, mask, behaviour_logprobs=behaviour, tis_cap=1.5)[0])(old)
    np.testing.assert_allclose(grad, plain * jnp.array([[1.5, 1.0, 0.4]]), rtol=1e-5)
    assert float(loss) == pytest.approx(-(1.5 + 1.0 + 0.4) / 3, rel=1e-5)
    assert float(stats["tis_capped"]) == pytest.approx(1 / 3) and float(stats["tis_weight"]) == pytest.approx(2.9 / 3, rel=1e-5)


@pytest.mark.example_run
def test_tiny_grpo_with_engine_logprobs_and_tis_learns(tmp_path):
    """Same bar as the plain run; in fp32 engine and trainer agree, so the logged mismatch is
    float rounding and the TIS weights are 1."""
    records = run_grpo(tmp_path / "tis", "--steps", str(STEPS), "--tis-cap", "2", "--check-consistency-every", "10")
    assert mean_reward(records[-5:]) - mean_reward(records[:5]) > GAIN
    assert all(r["mismatch_max"] < 1e-4 and abs(r["mismatch_kl"]) < 1e-8 for r in records)
    assert all(r["tis_weight"] == pytest.approx(1.0, abs=1e-3) and r["tis_capped"] == 0 for r in records)
    assert [r["step"] for r in records if "consistency_max" in r] == [1, 11, 21]


@pytest.mark.example_run
def test_async_grpo_overlaps_generation_and_learns(tmp_path):
    """Trainer on 2 devices, engine on the other 2: each step trains on the rollout generated
    during the previous update (one version behind, TIS-corrected) and learns as the plain
    run does (20 steps: measured gains of 0.19 and more, against a 5-step noise of ~0.02)."""
    steps = 20
    records = run_grpo(tmp_path / "async", "--steps", str(steps), "--async-rollout", "--tis-cap", "2", devices=4)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # The first rollout is the initial policy's; later tokens are 1 version behind, or 0 where
    # the pushed weights reached a rollout still running.
    lags = [r["version_lag"] for r in records]
    assert lags[0] == 0 and all(0 <= lag <= 1 for lag in lags) and np.mean(lags[1:]) > 0.5
    assert all(r["bytes_copied"] > 0 for r in records), "the engine's devices hold their own copy"
    assert mean_reward(records[-5:]) - mean_reward(records[:5]) > 0.1


@pytest.mark.example_run
def test_consistency_check_stops_a_run_whose_engine_serves_another_policy(tmp_path):
    """The ablation never re-syncs: after a few updates the engine no longer serves the
    trainer's params, and the periodic check stops the run naming the statistic."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    command = [
        sys.executable, "-m", "examples.grpo", "--output-dir", str(tmp_path / "run"), "--no-progress", "--no-plot",
        "--no-resync", "--steps", "4", "--check-consistency-every", "3",
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode != 0
    assert "grpo stopped: step 4: train-inference mismatch: max |Δ log p|" in result.stderr, result.stderr[-3000:]


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """The stand-in for Qwen2.5-3B-Instruct: a tiny random Qwen2 dir with a ChatML template."""
    return write_tiny_model(tmp_path_factory.mktemp("chat-model"), TinyModelSpec(chat_template=True))


def test_gsm8k_rows_from_a_local_file_become_chat_prompts(chat_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    rows = [json.loads(line) for line in GSM8K_SAMPLE.read_text().splitlines()]
    problems = gsm8k_problems(tokenizer, str(GSM8K_SAMPLE))
    assert [p.answer for p in problems] == [gsm8k_reference_answer(r["answer"]) for r in rows]
    assert problems[0].prompt == gsm8k_prompt(tokenizer, rows[0]["question"])
    assert problems[0].prompt.startswith("<|im_start|>system\n") and problems[0].prompt.endswith("<|im_start|>assistant\n")
    # The preset's task keeps the prompts that fit max_prompt_tokens (256; these are 238-296).
    config = dataclasses.replace(PRESETS["qwen2.5-3b"], model=str(chat_model_dir), dataset=str(GSM8K_SAMPLE), prompts_per_step=2)
    task = Task(config, tokenizer)
    lengths = [len(tokenizer.encode(p.prompt, add_special_tokens=False)) for p in problems]
    assert [p.prompt for p in task.pool] == [p.prompt for p, n in zip(problems, lengths) if n <= 256]
    assert 2 <= len(task.pool) < len(problems) and task.reward_fn is gsm8k_reward
    with pytest.raises(ValueError, match=r"3 of 8 prompts fit in max_prompt_tokens=256, fewer than prompts_per_step=16"):
        Task(dataclasses.replace(config, prompts_per_step=16), tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: GSM8K solution has no '####' answer line"):
        gsm8k_problems(tokenizer, str(bad))


def test_a_resume_in_an_output_dir_must_be_the_same_run(tmp_path, chat_model_dir, monkeypatch):
    """A resume with another seed would restore one run's weights and go on with another run's
    prompts and KL reference: refused before anything starts, naming the file and both values.
    Before a first checkpoint nothing is bound (a rerun may fix a start-up error)."""
    config = dataclasses.replace(PRESETS["tiny"], seed=2)
    claim_output_dir(config, tmp_path)
    claim_output_dir(dataclasses.replace(config, seed=0), tmp_path)  # no checkpoint yet: rebinds
    assert json.loads((tmp_path / "run.json").read_text())["seed"] == 0
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    claim_output_dir(dataclasses.replace(config, seed=0, steps=90), tmp_path)  # the same run, resumed for longer
    with pytest.raises(ValueError, match=r"run\.json: this output dir holds checkpoints of a run with seed=0; this one has seed=2"):
        claim_output_dir(config, tmp_path)
    # A local model dir named by another path is the same run.
    other = tmp_path / "other"
    other.mkdir()
    claim_output_dir(dataclasses.replace(config, model=str(chat_model_dir)), other)
    (other / "checkpoints" / "1").mkdir(parents=True)
    monkeypatch.chdir(chat_model_dir.parent)
    claim_output_dir(dataclasses.replace(config, model=chat_model_dir.name), other)


@pytest.mark.example_run
def test_qwen25_3b_preset_path_on_a_local_stand_in(chat_model_dir, tmp_path):
    """The qwen2.5-3b preset end to end with its downloads replaced by local files: chat
    template from the tokenizer, GSM8K rows and rewards, initial weights from the HF dir, the
    KL penalty to the reference model, checkpoints and resume. The other overrides only make it
    fit a CPU; a TPU user runs ``python -m examples.grpo --preset qwen2.5-3b``."""
    local = ["--preset", "qwen2.5-3b", "--model", str(chat_model_dir), "--dataset", str(GSM8K_SAMPLE)]
    cpu = ["--prompts-per-step", "2", "--max-new-tokens", "16", "--dtype", "float32", "--tp-size", "1",
           "--kv-tokens", "8192", "--checkpoint-every", "1"]
    records = run_grpo(tmp_path / "run", *local, *cpu, "--steps", "2")
    assert [r["step"] for r in records] == [1, 2]
    # The KL penalty ran against a reference equal to the initial policy (a reference loaded
    # wrongly, e.g. random, would be far off). The random stand-in earns no GSM8K reward, so
    # its advantages are zero and the policy stays where it started.
    assert all("ref_kl" in r for r in records)
    assert records[0]["ref_kl"] == pytest.approx(0.0, abs=1e-6)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["1", "2"]
    resumed = run_grpo(tmp_path / "run", *local, *cpu, "--steps", "3")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    # After two updates: Adam turns the float noise of zero-advantage gradients into steps of
    # about the learning rate, so the policy drifts by a hair (1.3e-6 seen on jax 0.12); a wrong
    # reference would be off by orders of magnitude more.
    assert resumed[2]["ref_kl"] == pytest.approx(0.0, abs=1e-4)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "3"]
