"""GRPO with an in-process sglang-jax rollout worker.

    python -m examples.grpo                       # tiny preset: a few minutes on a CPU
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

``--async-rollout --tis-cap 2`` overlaps generation with the update instead (trainer on the first
half of the devices, engines on the second; on CPU ``XLA_FLAGS=--xla_force_host_platform_device_count=4``).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import optax

from examples.async_rl import run_async
from examples.grpo_math import group_advantages, ppo_clip_loss, token_logprobs
from examples.rl_loop import Policy, RLConfig, Rollout, cli, mismatch_metrics, parse_args as parse_config, run


@dataclasses.dataclass(frozen=True)
class GRPOConfig(RLConfig):
    output_dir: str = "runs/grpo-tiny"
    group_size: int = 8
    # > 0: a KL penalty to the initial model (the reference, kept frozen beside the policy).
    kl_beta: float = 0.0
    # Generate step k+1 during the update of step k, trainer and engines on separate devices,
    # weights pushed in flight (examples/async_rl.py). Needs tis_cap.
    async_rollout: bool = False

    @property
    def samples_per_prompt(self) -> int:
        return self.group_size

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are relative to the group), got {self.group_size}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}")
        super().__post_init__()


PRESETS = {
    "tiny": GRPOConfig(),
    # The same task on a tiny Llama-3-style model (GQA, llama3 RoPE scaling, untied, head_dim 64).
    "tiny-llama": GRPOConfig(preset="tiny-llama", output_dir="runs/grpo-tiny-llama"),
    "tiny-moe": GRPOConfig(preset="tiny-moe", output_dir="runs/grpo-tiny-moe"),
    # Sizes in the range of the published MLLM-JAX GRPO runs on a TPU v4-8.
    "qwen2.5-3b": GRPOConfig(
        preset="qwen2.5-3b",
        model="Qwen/Qwen2.5-3B-Instruct",
        dataset="openai/gsm8k",
        output_dir="runs/grpo-qwen2.5-3b",
        steps=200,
        prompts_per_step=16,
        group_size=8,
        max_prompt_tokens=256,
        max_new_tokens=512,
        temperature=1.0,
        learning_rate=1e-6,
        ppo_epochs=1,
        kl_beta=0.04,
        dtype="bfloat16",
        kv_tokens=131072,
        tp_size=4,
        checkpoint_every=50,
    ),
}


class GRPO:
    """Group-relative advantages and the PPO-clip objective, the policy's params and Adam state."""

    name = "grpo"
    progress_fields = ()
    plot_panels = ()

    def __init__(self, config: GRPOConfig, policy: Policy):
        self.config = config
        self.optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(config.learning_rate))
        # The reference policy for the KL penalty is the initial model, also after a resume; a
        # copy, since the train step donates the policy's buffers.
        self.ref_params = jax.tree_util.tree_map(jnp.copy, policy.params) if config.kl_beta > 0 else None
        self.logprobs, self.train_step = make_train_fns(policy.model, self.optimizer, config)

    def init_trees(self, params) -> dict:
        return {"params": params, "opt_state": self.optimizer.init(params)}

    def update(self, trees: dict, rollout: Rollout) -> tuple[dict, dict]:
        config, arrays = self.config, dict(rollout.arrays)
        # Per prompt group: this process's rows hold whole groups.
        advantages = rollout.rows(group_advantages(rollout.rewards, config.group_size))
        if config.tis_cap is not None:
            arrays["behaviour_logprobs"] = rollout.rows(rollout.batch.logprobs[:, 1:])
        params, opt_state = trees["params"], trees["opt_state"]
        inputs = (arrays["tokens"], arrays["attention_mask"], arrays["positions"])
        old = self.logprobs(params, *inputs)
        if self.ref_params is not None:
            arrays["ref_logprobs"] = self.logprobs(self.ref_params, *inputs)
        for _ in range(config.ppo_epochs):
            params, opt_state, stats = self.train_step(params, opt_state, arrays, old, advantages)
        if config.wants_logprobs:
            stats.update(mismatch_metrics(rollout.batch, old))
        return {"params": params, "opt_state": opt_state}, stats


def make_train_fns(model, optimizer, config: GRPOConfig):
    def logprobs(params, tokens, attention_mask, positions):
        logits = model.apply({"params": params}, tokens, attention_mask, positions)
        # The engine samples at this temperature: the policy being trained is the tempered one.
        return token_logprobs(logits / config.temperature, tokens)

    def loss_fn(params, batch, old_logprobs, advantages):
        new = logprobs(params, batch["tokens"], batch["attention_mask"], batch["positions"])
        return ppo_clip_loss(
            new, old_logprobs, advantages, batch["completion_mask"][:, 1:], config.clip_eps,
            ref_logprobs=batch.get("ref_logprobs"), kl_beta=config.kl_beta,
            behaviour_logprobs=batch.get("behaviour_logprobs"), tis_cap=config.tis_cap,
        )

    # The params and optimizer state are donated: the train step overwrites them in place.
    @partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch, old_logprobs, advantages):
        (_, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, old_logprobs, advantages)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        stats["grad_norm"] = optax.global_norm(grads)
        return optax.apply_updates(params, updates), opt_state, stats

    return jax.jit(logprobs), train_step


def main(config: GRPOConfig) -> dict:
    return (run_async if config.async_rollout else run)(config, GRPO)


def parse_args(argv=None) -> GRPOConfig:
    return parse_config(GRPOConfig, PRESETS, argv, __doc__)


if __name__ == "__main__":
    cli("grpo", main, parse_args())
