"""PPO with a critic and an in-process sglang-jax rollout worker.

    python -m examples.ppo                       # tiny preset: a minute or two on a CPU
    python -m examples.ppo --preset qwen2.5-3b   # Qwen2.5-3B-Instruct on GSM8K (TPU, network)

Each step (the loop of :mod:`examples.rl_loop`, as GRPO's): sync the policy into the engine,
sample completions, score them; then, with the engine released: old log-probs (the trainer's,
or the engine's with ``--old-logprobs engine``), the critic's values and the reference's
log-probs; per-token rewards (the task's score at the last completion token, minus ``kl_coef``
times the KL to the reference); GAE advantages (whitened) and returns; and ``ppo_epochs`` x
``minibatches`` train steps of the clipped surrogate, the clipped value loss and the entropy
bonus, stopped early past ``target_kl``. The critic is a model of the policy's family with a
scalar value head (``--critic separate``, initialized from the policy's backbone) or a second
head on the policy's backbone (``--critic shared``). Checkpoints hold the policy, the critic
and both optimizer states.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from examples.critic import CRITIC_MODES, ValueHead, init_critic
from examples.grpo_math import ppo_clip_loss, token_logprobs
from examples.ppo_math import (
    KL_ESTIMATORS,
    clipped_value_loss,
    explained_variance,
    gae,
    kl_penalty,
    masked_mean,
    masked_whiten,
    token_entropy,
    token_rewards,
)
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

OLD_LOGPROBS = ("trainer", "engine")


@dataclasses.dataclass(frozen=True)
class PPOConfig(RLConfig):
    algorithm: ClassVar[str] = "ppo"
    output_dir: str = "runs/ppo-tiny"
    steps: int = 40
    prompts_per_step: int = 64
    samples_per_prompt: int = 1
    learning_rate: float = 3e-4
    ppo_epochs: int = 2
    minibatches: int = 2
    critic: str = "separate"  # or "shared": one backbone, two heads
    critic_learning_rate: float = 1e-3
    vf_coef: float = 0.5  # weight of the value loss in the loss both trees are trained on
    value_clip: float = 0.2  # new values stay within this of the rollout's in the clipped term
    ent_coef: float = 0.0  # entropy bonus
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    # > 0: per-token reward -kl_coef * KL(policy || initial model), estimator k1 or k3.
    kl_coef: float = 0.0
    kl_estimator: str = "k1"
    # "trainer": recompute the rollout's log-probs before the first epoch; "engine": use the
    # engine's (one forward fewer; the mismatch is measured on the first minibatch).
    old_logprobs: str = "trainer"

    @property
    def logprob_settings(self) -> tuple[str, ...]:
        return super().logprob_settings + (("old_logprobs engine",) if self.old_logprobs == "engine" else ())

    def __post_init__(self):
        if self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        if self.critic not in CRITIC_MODES:
            raise ValueError(f"critic must be one of {CRITIC_MODES}, got {self.critic!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        if self.old_logprobs == "engine" and self.tis_cap is not None:
            raise ValueError(
                "tis_cap needs old_logprobs='trainer': with the engine's old log-probs the "
                "PPO ratio is already taken against the engine's policy"
            )
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma} and {self.lam}")
        for name in ("critic_learning_rate", "vf_coef", "ent_coef", "kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.value_clip <= 0:
            raise ValueError(f"value_clip must be > 0, got {self.value_clip}")
        super().__post_init__()


# The tiny task and how PPO keeps learning on it (issue 32; GRPO's tiny preset did the same).
# On digits 0-9 at lr 3e-4 with Adam cold, the first update jumped the policy (approx KL 0.37,
# clip fraction 0.84) and the critic often never learned (seed 0: explained variance ~0, reward
# +0.05 in 20 steps). On digits 0-4, with the policy's Adam warmed up over 20 updates (5 steps)
# and 128 rows a step, it learns fast but collapses within 15 steps onto one answer for every
# prompt ("4": exact for 1 prompt in 5, close for the rest; reward ~0.53, entropy ~0.03), and a
# deterministic policy explores no further; a per-token KL penalty of 0.02 to the initial
# policy still collapses, 0.05 keeps it exploring and learning all run (seeds 0-3: entropy ~3.1
# -> 1.5-2.6 nats, reward ~0.09-0.16 -> 0.40-0.48 in 40 steps, still 0.11-0.21 higher over
# steps 31-40 than over 11-20; tests/test_ppo.py). lam 0: with completions of at most 3 tokens
# every token's advantage bootstraps from the critic (TD(0)).
TINY = dict(lam=0.0, max_operand=4, prompts_per_step=128, warmup_updates=20, kl_coef=0.05)

PRESETS = {
    "tiny": PPOConfig(**TINY),
    # The tiny task on the tiny Qwen3-MoE (with --routing-replay: R3).
    "tiny-moe": PPOConfig(**TINY, preset="tiny-moe", output_dir="runs/ppo-tiny-moe"),
    # GRPO's 128 completions a step, one sample per prompt as PPO usually draws them.
    "qwen2.5-3b": PPOConfig(
        **QWEN25_3B,
        output_dir="runs/ppo-qwen2.5-3b",
        prompts_per_step=128,
        samples_per_prompt=1,
        critic_learning_rate=5e-6,
        ppo_epochs=2,
        minibatches=4,
        kl_coef=0.05,
        target_kl=0.1,
    ),
}

# parse_args(argv=None) -> PPOConfig: --preset and a flag per field.
parse_args = partial(parse_config, PPOConfig, PRESETS, description=__doc__, prog="python -m examples.ppo")


class PPO:
    """The policy and the critic, each with its Adam state; the update of one rollout."""

    name = PPOConfig.algorithm
    progress_fields = (("vloss", "value_loss", "{:.3f}"), ("ev", "explained_variance", "{:.2f}"))
    plot_panels = (("critic", (("value_loss", "value loss"), ("explained_variance", "explained variance"))),)

    def __init__(self, config: PPOConfig, policy: Policy):
        self.config = config
        model = policy.model
        self.optimizers = {
            "params": ("opt_state", make_optimizer(config.learning_rate, config.warmup_updates, config.decay_updates)),
            # The warm-up keeps the policy near the one that sampled the rollout; the critic has no
            # such tie, and a slow start of its values is a slow start of every advantage (lam 0).
            "critic": ("critic_opt_state", make_optimizer(config.critic_learning_rate)),
        }
        self.critic, critic_model = init_critic(config.critic, model, policy.params, config.seed)
        # The reference is the initial policy, also after a resume; a copy (the train step donates).
        self.ref_params = jax.tree_util.tree_map(jnp.copy, policy.params) if config.kl_coef > 0 else None

        def policy_hidden(params, tokens, attention_mask, positions, routed_experts=None):
            return model.apply(
                {"params": params}, tokens, attention_mask, positions, routed_experts, method="hidden_states"
            )

        def values(trained, tokens, attention_mask, positions, routed_experts=None, hidden=None):
            if critic_model is not None:
                # A critic of its own routes its tokens itself: replay is for the policy's gradient.
                out = critic_model.apply({"params": trained["critic"]}, tokens, attention_mask, positions)
            else:
                if hidden is None:
                    hidden = policy_hidden(trained["params"], tokens, attention_mask, positions, routed_experts)
                out = ValueHead().apply({"params": trained["critic"]["value_head"]}, hidden)
            return out[:, :-1]  # the value of each action's state, aligned with token_logprobs

        def forward(trained, tokens, attention_mask, positions, routed_experts=None):
            """Log-probs, entropies and values of the rollout's actions: [B, T - 1] each."""
            hidden = policy_hidden(trained["params"], tokens, attention_mask, positions, routed_experts)
            # The engine samples at this temperature: the policy being trained is the tempered one.
            logits = model.apply({"params": trained["params"]}, hidden, method="logits") / config.temperature
            return (
                token_logprobs(logits, tokens),
                token_entropy(logits),
                values(trained, tokens, attention_mask, positions, routed_experts, hidden),
            )

        def logprobs(params, tokens, attention_mask, positions, routed_experts=None):
            logits = model.apply({"params": params}, tokens, attention_mask, positions, routed_experts=routed_experts)
            return token_logprobs(logits / config.temperature, tokens)

        def loss_fn(trained, batch):
            mask = batch["completion_mask"][:, 1:]
            new, entropy, new_values = forward(trained, *model_inputs(batch))
            policy_loss, stats = ppo_clip_loss(
                new,
                batch["old_logprobs"],
                batch["advantages"],
                mask,
                config.clip_eps,
                behaviour_logprobs=batch.get("behaviour_logprobs"),
                tis_cap=config.tis_cap,
            )
            value_loss, value_clipped = clipped_value_loss(
                new_values, batch["old_values"], batch["returns"], mask, config.value_clip
            )
            stats["entropy"] = masked_mean(entropy, mask)
            stats["loss"] = policy_loss + config.vf_coef * value_loss - config.ent_coef * stats["entropy"]
            delta = new - batch["old_logprobs"]
            # Before the first update these compare the trainer to the old log-probs' source.
            stats.update(
                policy_loss=policy_loss,
                value_loss=value_loss,
                value_clip_fraction=value_clipped,
                logprob_diff_mean=masked_mean(jnp.abs(delta), mask),
                logprob_diff_max=jnp.max(jnp.abs(delta) * mask),
                logprob_diff_kl=masked_mean(jnp.expm1(delta) - delta, mask),
            )
            return stats["loss"], stats

        self.values = jax.jit(values)
        self.forward = jax.jit(forward)
        self.logprobs = jax.jit(logprobs)
        self.routing_probe = routing_probe(model) if config.routing_replay else None
        self.train_step = make_train_step(loss_fn, self.optimizers, config.target_kl)

    def init_trees(self, params) -> dict:
        return {
            "params": params,
            "opt_state": self.optimizers["params"][1].init(params),
            "critic": self.critic,
            "critic_opt_state": self.optimizers["critic"][1].init(self.critic),
        }

    def update(self, trees: dict, rollout: Rollout) -> tuple[dict, dict]:
        config, data = self.config, dict(rollout.arrays)
        inputs = model_inputs(data)
        mask = data["completion_mask"][:, 1:]
        if config.old_logprobs == "engine":
            old = rollout.rows(rollout.batch.logprobs[:, 1:])
            old_values = self.values(trees, *inputs)
            entropy = None
        else:
            old, entropy, old_values = self.forward(trees, *inputs)
        stats = {}
        if self.routing_probe is not None:  # the rollout's policy, before the update donates it
            stats.update(self.routing_probe(trees["params"], data))
        kl = None
        if self.ref_params is not None:
            kl = kl_penalty(old, self.logprobs(self.ref_params, *inputs), config.kl_estimator)
            stats["ref_kl"] = masked_mean(kl, mask)
        rewards = token_rewards(rollout.rows(rollout.rewards), mask, kl, config.kl_coef)
        advantages, returns = gae(rewards, old_values, mask, config.gamma, config.lam)
        if config.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        stats["explained_variance"] = explained_variance(old_values, returns, mask)
        stats["value_mean"] = masked_mean(old_values, mask)
        data.update(old_logprobs=old, old_values=old_values, advantages=advantages, returns=returns)
        if config.tis_cap is not None:
            data["behaviour_logprobs"] = rollout.rows(rollout.batch.logprobs[:, 1:])
        trees, last, first = run_updates(
            self.train_step,
            trees,
            data,
            epochs=config.ppo_epochs,
            minibatches=config.minibatches,
            seed=config.seed,
            step=rollout.step,
        )
        stats.update({k: v for k, v in last.items() if not k.startswith("logprob_diff")})
        # The entropy logged is the rollout policy's on its sampled tokens (the old log-probs'
        # forward; with the engine's old log-probs, the first train step's, before any update).
        stats["entropy"] = first["entropy"] if entropy is None else masked_mean(entropy, mask)
        if config.old_logprobs == "engine":
            # The first train step's log-probs are the trainer's before any update: against the
            # engine's, they are the mismatch (on the first minibatch; no extra forward).
            stats.update(
                mismatch_mean=first["logprob_diff_mean"],
                mismatch_max=first["logprob_diff_max"],
                mismatch_kl=first["logprob_diff_kl"],
            )
        elif config.wants_logprobs:
            stats.update(mismatch_metrics(rollout.batch, old))
        return trees, stats


def main(config: PPOConfig) -> dict:
    return run(config, PPO)


if __name__ == "__main__":
    cli("ppo", main, parse_args())
