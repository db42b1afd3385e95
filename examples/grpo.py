"""GRPO with an in-process sglang-jax rollout worker.

    python -m examples.grpo                       # tiny preset: about 1.5 minutes on a 2-core CPU
    python -m examples.grpo --preset tiny-llama   # the same on a tiny Llama-3-style model
    python -m examples.grpo --preset tiny-moe     # the same on a tiny Qwen3-MoE (8 experts, top-2)
    python -m examples.grpo --preset qwen2.5-3b   # Qwen2.5-3B-Instruct on GSM8K (TPU, network)

The qwen2.5-3b preset downloads its model and dataset; ``--model DIR`` (an HF model dir with a
chat template) and ``--dataset FILE`` (GSM8K rows as JSON lines) replace the downloads and
nothing else.

Each step (the loop of :mod:`examples.rl_loop`): sync the trainer's params into the engine, sample
G completions per prompt, score them, compute group-relative advantages, and take PPO-clip steps
with the KV cache dropped and the params donated to the train step. Metrics go to
``<output_dir>/metrics.jsonl``, a reward plot to ``reward.png``; orbax checkpoints of the trainer
state let a rerun with the same output dir resume.

``--lora-rank 8 --learning-rate 3e-3`` trains LoRA adapters on every projection instead of the
whole model: the base stays frozen, and each sync merges the adapters into the kernels the
engine serves (its other leaves are aliased); with ``--lora-unmerged`` the engine computes the
adapters beside the base instead, and each sync moves the adapters alone.

``--async-rollout --tis-cap 2`` overlaps generation with the update instead (trainer on the first
half of the devices, engines on the second; on CPU ``XLA_FLAGS=--xla_force_host_platform_device_count=4``).
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from examples.async_rl import run_async
from examples.grpo_math import REWARD_SCALES, frac_reward_zero_std, group_advantages, ppo_clip_loss, token_logprobs
from examples.ppo_math import masked_mean, token_entropy
from examples.rl_loop import (
    QWEN25_3B,
    Policy,
    RLConfig,
    Rollout,
    cli,
    mismatch_metrics,
    model_inputs,
    routing_probe,
    run,
)
from examples.rl_loop import (
    parse_args as parse_config,
)
from examples.rl_update import make_optimizer, make_train_step, run_updates
from examples.run_dir import effective_lora_alpha
from trainer_bridge import LoraConfig, apply_adapters, flatten_params, init_adapters

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GRPOConfig(RLConfig):
    algorithm: ClassVar[str] = "grpo"
    output_dir: str = "runs/grpo-tiny"
    group_size: int = 8
    # > 0: a KL penalty to the initial model (the reference, kept frozen beside the policy).
    kl_beta: float = 0.0
    # What the advantages are divided by (TRL's scale_rewards): "group" its group's reward std,
    # "batch" the step's, "none" nothing (grpo_math.group_advantages).
    scale_rewards: str = "group"
    # Generate step k+1 during the update of step k, trainer and engines on separate devices,
    # weights pushed in flight (examples/async_rl.py). Needs tis_cap.
    async_rollout: bool = False
    # > 0: train LoRA adapters of this rank on every attention and MLP projection the model has
    # as a kernel (not an MoE's experts) instead of the whole model (the base stays frozen;
    # Adam's state is adapter-sized); the engine serves the base with the adapters merged at
    # each sync. lora_alpha: the update's scale is alpha / rank (None: 2 x rank).
    lora_rank: int = 0
    lora_alpha: float | None = None
    # The engines compute the adapters beside the base (WorkerConfig.unmerged_lora) instead of
    # serving them merged: a sync moves the adapters alone.
    lora_unmerged: bool = False

    @property
    def unmerged_lora(self) -> LoraConfig | None:
        return self.lora if self.lora_unmerged else None

    @property
    def lora(self) -> LoraConfig | None:
        if not self.lora_rank:
            return None
        return LoraConfig(rank=self.lora_rank, alpha=effective_lora_alpha(self.lora_rank, self.lora_alpha))

    @property
    def samples_per_prompt(self) -> int:
        return self.group_size

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are relative to the group), got {self.group_size}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}")
        if self.scale_rewards not in REWARD_SCALES:
            raise ValueError(f"scale_rewards must be one of {REWARD_SCALES}, got {self.scale_rewards!r}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: train the whole model), got {self.lora_rank}")
        if self.lora_unmerged and not self.lora_rank:
            raise ValueError("lora_unmerged needs lora_rank > 0 (adapters to compute unmerged)")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be > 0 (None: 2 x lora_rank), got {self.lora_alpha}")
        if self.async_rollout and self.max_turns > 1:
            raise ValueError("async_rollout generates single-turn completions: multi-turn episodes run synchronously")
        if self.async_rollout and self.tis_cap is None:
            raise ValueError("async_rollout trains on tokens of older weights: set tis_cap")
        if self.async_rollout and self.eval_every:
            raise ValueError("eval_every runs in the synchronous loop, not with async_rollout")
        if self.async_rollout and self.local_processes > 1:
            raise ValueError("async_rollout runs in one process: its trainer and engines split one process's devices")
        if self.lora_rank and self.routing_replay:
            raise ValueError("lora_rank with routing_replay is not supported: the routing probe needs the whole tree")
        super().__post_init__()


# The tiny task and how it keeps learning. On digits 0-9 a random policy settles within 40
# steps on one near answer per prompt (the shaped reward pays close numbers): every group's
# samples then agree, all advantages are 0 and learning stops at reward ~0.45. On 0-4, with a KL
# penalty to the initial (near uniform) policy, 16 samples per prompt and Adam's learning rate
# warmed up (no approx KL spike on the first update), the groups keep their reward spread: reward
# ~0.1 -> ~0.7 in 60 steps, but a few prompts still settle on a near answer (0+2= -> 1, 3+3= ->
# 7) and the exact-answer rate stops at ~0.6.
TINY = dict(max_operand=4, kl_beta=0.1, group_size=16, warmup_updates=20)
# The demo pays exact answers only (no near answer to settle on), samples 32 per prompt so that
# a prompt's rare right answer shows up in its group, and decays the learning rate once the
# answers are found: exact answers 0.04 -> 0.91 in 80 steps (the first and last five; README).
DEMO = dict(TINY, near_credit=0.0, group_size=32, lr_decay=True, steps=80)
# The calculator task (examples/tool_task.py): 100 supervised steps leave the model calling the
# calculator right in ~90% of episodes but copying its result into the answer exactly in 3-19%;
# GRPO takes the right calls to ~100% and the reward up (the digits copied in place; exact copies
# at some seeds). With a constant learning rate and a KL penalty of 0.05 the reward peaked near
# step 25 and fell back as the entropy collapsed (0.23 -> 0.03 by step 60, an approx-KL spike of
# 417): the rate decays and the KL penalty to the warm-started policy is 0.1 (docs/benchmarks.md).
TOOLS = dict(
    max_prompt_tokens=16,
    max_new_tokens=64,
    max_turns=3,
    turn_tokens=14,
    warm_start_steps=100,
    group_size=16,
    steps=40,
    kv_tokens=16384,
    learning_rate=3e-4,
    warmup_updates=10,
    lr_decay=True,
    kl_beta=0.1,
)
PRESETS = {
    "tiny": GRPOConfig(**DEMO),
    # The shaped tiny task (TINY) on a tiny Llama-3-style model (GQA, llama3 RoPE, untied, head_dim 64).
    "tiny-llama": GRPOConfig(**TINY, preset="tiny-llama", output_dir="runs/grpo-tiny-llama"),
    "tiny-moe": GRPOConfig(**TINY, preset="tiny-moe", output_dir="runs/grpo-tiny-moe"),
    "qwen2.5-3b": GRPOConfig(
        **QWEN25_3B, output_dir="runs/grpo-qwen2.5-3b", prompts_per_step=16, group_size=8, ppo_epochs=1, kl_beta=0.04
    ),
    # Multi-turn episodes with a calculator (examples/tool_task.py): two-digit products, which the
    # model answers by calling the tool and copying its result; a short warm start shows the format.
    "tiny-tools": GRPOConfig(**TOOLS, preset="tiny-tools", output_dir="runs/grpo-tiny-tools"),
    # GSM8K with the calculator in the chat template's tools.
    "qwen2.5-3b-tools": GRPOConfig(
        **{**QWEN25_3B, "preset": "qwen2.5-3b-tools", "max_prompt_tokens": 384, "max_new_tokens": 640},
        output_dir="runs/grpo-qwen2.5-3b-tools",
        prompts_per_step=16,
        group_size=8,
        ppo_epochs=1,
        kl_beta=0.04,
        max_turns=4,
        turn_tokens=512,
    ),
}

# parse_args(argv=None) -> GRPOConfig: --preset and a flag per field.
parse_args = partial(parse_config, GRPOConfig, PRESETS, description=__doc__, prog="python -m examples.grpo")


class GRPO:
    """Group-relative advantages and the PPO-clip objective, the policy's params and Adam state."""

    name = GRPOConfig.algorithm
    progress_fields = (("zstd", "frac_reward_zero_std", "{:.2f}"),)
    plot_panels = (("groups", (("frac_reward_zero_std", "groups with zero reward std"),)),)

    def __init__(self, config: GRPOConfig, policy: Policy):
        self.config = config
        self.optimizer = make_optimizer(config.learning_rate, config.warmup_updates, config.decay_updates)
        # LoRA: the trained tree is the adapters, on the projections this model has as kernels
        # (an MoE's experts are stacked, not kernels); the base is frozen, never donated, and the
        # policy functions below take {"base", "adapters"}.
        self.lora, self.base = None, None
        if config.lora:
            modules = {path.rsplit(".", 2)[-2] for path in flatten_params(policy.params) if path.endswith(".kernel")}
            targets = tuple(name for name in config.lora.target_modules if name in modules)
            self.lora, self.base = dataclasses.replace(config.lora, target_modules=targets), policy.params
        # The reference policy for the KL penalty is the initial model, also after a resume; a
        # copy, since the train step donates the policy's buffers (with LoRA: the base itself,
        # which no step donates).
        self.ref_params = None
        if config.kl_beta > 0:
            self.ref_params = (
                {"base": self.base, "adapters": {}} if self.lora else jax.tree_util.tree_map(jnp.copy, policy.params)
            )
        model, lora = policy.model, self.lora

        def tempered_logits(params, tokens, attention_mask, positions, routed_experts=None):
            if lora is not None:
                params = apply_adapters(params["base"], params["adapters"], lora)
            # The engine samples at this temperature: the policy being trained is the tempered one.
            logits = model.apply({"params": params}, tokens, attention_mask, positions, routed_experts=routed_experts)
            return logits / config.temperature

        def logprobs(params, tokens, attention_mask, positions, routed_experts=None):
            return token_logprobs(tempered_logits(params, tokens, attention_mask, positions, routed_experts), tokens)

        def logprobs_and_entropy(params, tokens, attention_mask, positions, routed_experts=None):
            """The rollout's old log-probs and, from the same forward, each sampled token's
            full-distribution entropy (the policy's exploration, logged per step)."""
            logits = tempered_logits(params, tokens, attention_mask, positions, routed_experts)
            return token_logprobs(logits, tokens), token_entropy(logits)

        def loss_fn(trained, batch, frozen=None):
            params = trained["params"] if frozen is None else {"base": frozen, "adapters": trained["params"]}
            new = logprobs(params, *model_inputs(batch))
            return ppo_clip_loss(
                new,
                batch["old_logprobs"],
                batch["advantages"],
                batch["completion_mask"][:, 1:],
                config.clip_eps,
                ref_logprobs=batch.get("ref_logprobs"),
                kl_beta=config.kl_beta,
                behaviour_logprobs=batch.get("behaviour_logprobs"),
                tis_cap=config.tis_cap,
            )

        self.logprobs = jax.jit(logprobs)
        self.routing_probe = routing_probe(model) if config.routing_replay else None
        self.logprobs_and_entropy = jax.jit(logprobs_and_entropy)
        self.train_step = make_train_step(loss_fn, {"params": ("opt_state", self.optimizer)}, config.target_kl)

    def init_trees(self, params) -> dict:
        if self.lora:
            params = init_adapters(params, self.lora, jax.random.key(self.config.seed))
        return {"params": params, "opt_state": self.optimizer.init(params)}

    def policy(self, trees: dict):
        """What the policy functions take: the params, or with LoRA the base and the adapters."""
        return {"base": self.base, "adapters": trees["params"]} if self.lora else trees["params"]

    def update(self, trees: dict, rollout: Rollout) -> tuple[dict, dict]:
        config, data = self.config, dict(rollout.arrays)
        inputs = model_inputs(data)
        old, entropy = self.logprobs_and_entropy(self.policy(trees), *inputs)
        data["old_logprobs"] = old
        # Per prompt group: this process's rows hold whole groups; "batch" divides by the std of
        # every process's rewards.
        step_std = float(jnp.std(rollout.rows(rollout.rewards))) if config.scale_rewards == "batch" else None
        advantages = group_advantages(rollout.rewards, config.group_size, config.scale_rewards, step_std=step_std)
        data["advantages"] = rollout.rows(advantages)
        rollout_stats = {
            "entropy": masked_mean(entropy, data["completion_mask"][:, 1:]),
            "frac_reward_zero_std": frac_reward_zero_std(rollout.rows(rollout.rewards), config.group_size),
        }
        if float(rollout_stats["frac_reward_zero_std"]) == 1.0:
            logger.warning(
                "step %d: every group's samples earned equal rewards: all advantages are 0, the update has no signal",
                rollout.step + 1,
            )
        if self.routing_probe is not None:  # the rollout's policy, before the update donates it
            rollout_stats.update(self.routing_probe(trees["params"], data))
        if self.ref_params is not None:
            data["ref_logprobs"] = self.logprobs(self.ref_params, *inputs)
        if config.tis_cap is not None:
            data["behaviour_logprobs"] = rollout.rows(rollout.batch.logprobs[:, 1:])
        trees, stats, _ = run_updates(
            partial(self.train_step, frozen=self.base) if self.lora else self.train_step,
            trees,
            data,
            epochs=config.ppo_epochs,
            minibatches=config.minibatches,
            seed=config.seed,
            step=rollout.step,
        )
        stats.update(rollout_stats)
        if config.wants_logprobs:
            stats.update(mismatch_metrics(rollout.batch, old))
        return trees, stats


def main(config: GRPOConfig) -> dict:
    return (run_async if config.async_rollout else run)(config, GRPO)


if __name__ == "__main__":
    cli("grpo", main, parse_args())
