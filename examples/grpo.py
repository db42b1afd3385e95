"""GRPO with an in-process sglang-jax rollout worker.

    python -m examples.grpo                       # tiny preset: a few minutes on a CPU
    python -m examples.grpo --preset qwen2.5-3b   # Qwen2.5-3B-Instruct on GSM8K (TPU, network)

The qwen2.5-3b preset downloads its model and dataset; ``--model DIR`` (an HF model dir with a
chat template) and ``--dataset FILE`` (GSM8K rows as JSON lines) replace the downloads and
nothing else.

Each step: sync the trainer's params into the engine (zero copy where placements match),
sample G completions per prompt, score them, compute group-relative advantages, and take
PPO-clip steps with the KV cache dropped and the params donated to the train step. Metrics go
to ``<output_dir>/metrics.jsonl``, a reward plot to ``reward.png``; orbax checkpoints of the
trainer state let a rerun with the same output dir resume.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.grpo_math import group_advantages, ppo_clip_loss, token_logprobs
from examples.tasks import (
    Problem,
    addition_problems,
    addition_reward,
    gsm8k_problems,
    gsm8k_reward,
)
from models import QwenConfig, QwenForCausalLM, TinyModelSpec, write_tiny_model
from rollout import ConsistencyError, RolloutWorker, WorkerConfig, mismatch_stats
from trainer_bridge import load_hf_params

logger = logging.getLogger("grpo")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    preset: str = "tiny"
    model: str | None = None  # HF hub id or local dir; None builds the tiny model
    dataset: str | None = None  # GSM8K: HF hub id or a local JSON-lines file of its rows
    output_dir: str = "runs/grpo-tiny"
    steps: int = 60
    prompts_per_step: int = 8
    group_size: int = 8
    max_prompt_tokens: int = 8
    max_new_tokens: int = 3
    temperature: float = 1.0
    learning_rate: float = 6e-4
    ppo_epochs: int = 2
    clip_eps: float = 0.2
    # > 0: a KL penalty to the initial model (the reference, kept frozen beside the policy).
    kl_beta: float = 0.0
    dtype: str = "float32"
    kv_tokens: int = 4096
    tp_size: int = 1
    dp_size: int = 1  # engines in the process, each on tp_size devices (dp_size x tp_size = devices)
    seed: int = 0
    checkpoint_every: int = 20
    resync: bool = True  # False: an ablation that keeps generating with the initial weights
    progress: bool = True
    plot: bool = True
    wandb_project: str | None = None
    # Engine log-probs with every sample: the train-inference mismatch is logged each step.
    return_logprobs: bool = False
    # Truncated importance sampling: weight each token by min(p_trainer / p_engine, tis_cap),
    # the engine's log-probs being the behaviour policy (turns return_logprobs on). None: off.
    tis_cap: float | None = None
    # Every N steps run RolloutWorker.check_consistency and stop on a ConsistencyError. 0: off.
    check_consistency_every: int = 0
    consistency_atol: float = 1e-3

    @property
    def wants_logprobs(self) -> bool:
        return self.return_logprobs or self.tis_cap is not None

    def __post_init__(self):
        if self.preset not in PRESET_NAMES:
            raise ValueError(f"preset must be one of {PRESET_NAMES}, got {self.preset!r}")
        for name in ("steps", "prompts_per_step", "max_prompt_tokens", "max_new_tokens", "ppo_epochs", "kv_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are relative to the group), got {self.group_size}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.learning_rate <= 0 or self.temperature <= 0 or self.kl_beta < 0:
            raise ValueError("learning_rate and temperature must be > 0, kl_beta >= 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 (or unset), got {self.tis_cap}")
        if self.check_consistency_every < 0 or self.consistency_atol <= 0:
            raise ValueError("check_consistency_every must be >= 0 and consistency_atol > 0")
        rows = self.prompts_per_step * self.group_size
        if rows * (self.max_prompt_tokens + self.max_new_tokens) > self.kv_tokens:
            raise ValueError(
                f"kv_tokens={self.kv_tokens} cannot hold one step: {rows} rows x "
                f"({self.max_prompt_tokens} + {self.max_new_tokens}) tokens"
            )
        if self.preset != "tiny" and (self.model is None or self.dataset is None):
            raise ValueError(f"preset {self.preset!r} needs a model and a dataset")


PRESET_NAMES = ("tiny", "qwen2.5-3b")
PRESETS = {
    "tiny": GRPOConfig(),
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


@dataclasses.dataclass
class TrainState:
    params: dict
    opt_state: object
    step: int


def prepare_model(config: GRPOConfig, output_dir: Path) -> Path:
    if config.preset == "tiny":
        # Digits and operators only: a random policy often answers with a number.
        spec = TinyModelSpec(vocab_size=32, tokenizer="chars", seed=config.seed)
        return write_tiny_model(output_dir / "model", spec)
    if Path(config.model).is_dir():
        return Path(config.model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(config.model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))


class Task:
    """Prompts and rewards of the preset's task."""

    def __init__(self, config: GRPOConfig, tokenizer):
        self.config = config
        self.rng = np.random.default_rng(config.seed)
        if config.preset == "tiny":
            self.pool = None
            self.reward_fn = addition_reward
        else:
            problems = gsm8k_problems(tokenizer, config.dataset)
            # The rollout batch pads prompts to max_prompt_tokens: longer ones cannot be used.
            self.pool = [
                p for p in problems
                if len(tokenizer.encode(p.prompt, add_special_tokens=False)) <= config.max_prompt_tokens
            ]
            if len(self.pool) < config.prompts_per_step:
                raise ValueError(
                    f"{config.dataset}: {len(self.pool)} of {len(problems)} prompts fit in "
                    f"max_prompt_tokens={config.max_prompt_tokens}, fewer than prompts_per_step={config.prompts_per_step}"
                )
            if len(self.pool) < len(problems):
                logger.info("%d of %d prompts are longer than max_prompt_tokens=%d: skipped",
                            len(problems) - len(self.pool), len(problems), config.max_prompt_tokens)
            self.reward_fn = gsm8k_reward

    def sample(self, count: int) -> list[Problem]:
        if self.pool is None:
            return addition_problems(self.rng, count)
        return [self.pool[i] for i in self.rng.choice(len(self.pool), count, replace=False)]


def make_train_fns(model: QwenForCausalLM, optimizer, config: GRPOConfig):
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


def checkpoint_manager(output_dir: Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        (output_dir / "checkpoints").resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=2)
    )


def restore_or_init(manager, params, optimizer) -> TrainState:
    import orbax.checkpoint as ocp

    opt_state = optimizer.init(params)
    state = {"params": params, "opt_state": opt_state, "step": 0}
    latest = manager.latest_step()
    if latest is None:
        return TrainState(params, opt_state, 0)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=getattr(x, "sharding", None)), state
    )
    restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
    logger.info("resumed from step %d", latest)
    return TrainState(restored["params"], restored["opt_state"], int(restored["step"]))


def main(config: GRPOConfig) -> dict:
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(config, output_dir)
    worker = RolloutWorker(
        WorkerConfig(
            model_path=str(model_dir), dtype=config.dtype, load_format="dummy", tp_size=config.tp_size,
            dp_size=config.dp_size,
            # The engine takes prompt + completion <= context_length - 2 tokens whole.
            max_total_tokens=config.kv_tokens, context_length=config.max_prompt_tokens + config.max_new_tokens + 2,
            max_running_requests=config.prompts_per_step * config.group_size, seed=config.seed,
            max_prefill_tokens=max(4096, config.max_prompt_tokens * 8), chunked_prefill_size=4096,
        )
    )
    try:
        return _train(config, output_dir, model_dir, worker)
    finally:
        worker.close()


def _train(config: GRPOConfig, output_dir: Path, model_dir: Path, worker: RolloutWorker) -> dict:
    model = QwenForCausalLM(QwenConfig.from_hf(model_dir, dtype=config.dtype))
    # Placed as the engine places its weights: syncs alias these buffers instead of copying.
    shardings = worker.param_shardings()
    params = jax.tree_util.tree_map(
        lambda x, s: jax.device_put(jnp.asarray(x, config.dtype), s), load_hf_params(model_dir), shardings
    )
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(config.learning_rate))
    # The reference policy for the KL penalty is the initial model, also after a resume; a copy,
    # since the train step donates the policy's buffers.
    ref_params = jax.tree_util.tree_map(jnp.copy, params) if config.kl_beta > 0 else None
    manager = checkpoint_manager(output_dir)
    state = restore_or_init(manager, params, optimizer)
    logprobs_fn, train_step = make_train_fns(model, optimizer, config)
    task = Task(config, worker.tokenizer)
    metrics_file = (output_dir / "metrics.jsonl").open("a", encoding="utf-8")
    wandb_run = _wandb(config)
    progress = _progress(config, state.step)
    if not config.resync:
        # The ablation's engine keeps its own copy of the initial weights for the whole run.
        worker.sync_params(jax.tree_util.tree_map(jnp.copy, state.params))
    history = []
    try:
        while state.step < config.steps:
            record = _step(config, worker, state, task, logprobs_fn, train_step, ref_params)
            state.step += 1
            history.append(record)
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if wandb_run is not None:
                wandb_run.log(record, step=state.step)
            if progress is not None:
                progress.update(1)
                mismatch = {"dlogp": f"{record['mismatch_mean']:.1e}"} if "mismatch_mean" in record else {}
                progress.set_postfix(
                    reward=f"{record['reward']:.3f}", kl=f"{record['approx_kl']:.4f}", clip=f"{record['clip_fraction']:.3f}",
                    sync=f"{record['sync_s']:.2f}s", gen=f"{record['generate_s']:.2f}s", **mismatch,
                )
            if state.step % config.checkpoint_every == 0 or state.step == config.steps:
                _save(manager, state)
    finally:
        metrics_file.close()
        manager.wait_until_finished()
        if progress is not None:
            progress.close()
        if wandb_run is not None:
            wandb_run.finish()
    return _summary(config, output_dir, history)


def _step(config, worker, state: TrainState, task: Task, logprobs_fn, train_step, ref_params) -> dict:
    start = time.perf_counter()
    # check_finite: NaN weights would otherwise serve silently (the model then emits only EOS).
    report = worker.sync_params(state.params, check_finite=True) if config.resync else None
    sync_s = time.perf_counter() - start

    problems = task.sample(config.prompts_per_step)
    consistency = {}
    if config.check_consistency_every and state.step % config.check_consistency_every == 0:
        consistency = _check_consistency(config, worker, state, problems)
    start = time.perf_counter()
    batch = worker.generate(
        [p.prompt for p in problems], n=config.group_size, temperature=config.temperature,
        max_new_tokens=config.max_new_tokens, pad_prompts_to=config.max_prompt_tokens,
        return_logprobs=config.wants_logprobs,
    )
    generate_s = time.perf_counter() - start
    rewards = np.array(
        [task.reward_fn(text, problems[i].answer) for text, i in zip(batch.completion_texts, batch.prompt_index)],
        dtype=np.float32,
    )
    advantages = jnp.asarray(group_advantages(rewards, config.group_size))
    arrays = {
        "tokens": jnp.asarray(batch.tokens),
        "attention_mask": jnp.asarray(batch.attention_mask),
        "positions": jnp.asarray(batch.positions),
        "completion_mask": jnp.asarray(batch.completion_mask),
    }
    if config.tis_cap is not None:
        arrays["behaviour_logprobs"] = jnp.asarray(batch.logprobs[:, 1:])

    start = time.perf_counter()
    # With resync the engine serves the trainer's own buffers, which the train step donates:
    # released_for_training drops the KV cache and makes the next generate wait for a sync.
    context = worker.released_for_training() if config.resync else _kv_dropped(worker)
    with context:
        inputs = (arrays["tokens"], arrays["attention_mask"], arrays["positions"])
        old = logprobs_fn(state.params, *inputs)
        if ref_params is not None:
            arrays["ref_logprobs"] = logprobs_fn(ref_params, *inputs)
        for _ in range(config.ppo_epochs):
            state.params, state.opt_state, stats = train_step(state.params, state.opt_state, arrays, old, advantages)
        stats = {k: float(v) for k, v in stats.items()}
    train_s = time.perf_counter() - start
    if config.wants_logprobs:
        # Engine log-probs against the trainer's for the same tokens, before the update.
        mismatch = mismatch_stats(batch.logprobs[:, 1:], np.asarray(old), batch.completion_mask[:, 1:])
        stats.update(mismatch_mean=mismatch["mean_abs_diff"], mismatch_max=mismatch["max_abs_diff"], mismatch_kl=mismatch["kl"])
    return {
        "step": state.step + 1,
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "solved": float((rewards >= 1.0).mean()),
        "completion_tokens": float(batch.completion_lengths.mean()),
        "weight_version": batch.weight_version,
        "bytes_copied": report.bytes_copied if report else 0,
        "sync_s": sync_s,
        "generate_s": generate_s,
        "train_s": train_s,
        **consistency,
        **stats,
    }


def _check_consistency(config, worker, state: TrainState, problems) -> dict:
    """Engine against trainer on this step's prompts; a ConsistencyError stops the run."""
    try:
        report = worker.check_consistency(
            state.params, [p.prompt for p in problems], max_new_tokens=config.max_new_tokens,
            temperature=config.temperature, pad_prompts_to=config.max_prompt_tokens,
            seed=config.seed + state.step, atol=config.consistency_atol,
        )
    except ConsistencyError as error:
        raise ConsistencyError(f"step {state.step + 1}: {error}", error.report) from None
    return {"consistency_max": report.max_abs_diff, "consistency_s": report.seconds}


@contextlib.contextmanager
def _kv_dropped(worker):
    """KV dropped around the train step, for a worker that owns its weights (the ablation)."""
    yield worker.drop_kv()


def _save(manager, state: TrainState) -> None:
    import orbax.checkpoint as ocp

    tree = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
    manager.save(state.step, args=ocp.args.StandardSave(tree))


def _progress(config: GRPOConfig, initial: int):
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=config.steps, initial=initial, desc="grpo", unit="step")


def _wandb(config: GRPOConfig):
    if config.wandb_project is None:
        return None
    try:
        import wandb
    except ImportError:
        logger.warning("wandb_project is set but wandb is not installed: not logging to W&B")
        return None
    return wandb.init(project=config.wandb_project, config=dataclasses.asdict(config))


def _summary(config: GRPOConfig, output_dir: Path, history: list[dict]) -> dict:
    if not history:
        return {}
    window = max(1, min(5, len(history) // 4))
    first = float(np.mean([r["reward"] for r in history[:window]]))
    last = float(np.mean([r["reward"] for r in history[-window:]]))
    times = {k: float(sum(r[k] for r in history)) for k in ("sync_s", "generate_s", "train_s")}
    summary = {"first_reward": first, "last_reward": last, "steps": len(history), **times}
    logger.info(
        "reward %.3f -> %.3f (mean of the first and last %d steps); time sync %.1fs, generate %.1fs, train %.1fs",
        first, last, window, times["sync_s"], times["generate_s"], times["train_s"],
    )
    if config.plot:
        _plot(output_dir / "reward.png", history)
    return summary


def _plot(path: Path, history: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    mismatch = "mismatch_mean" in history[-1]
    fig, axes = plt.subplots(2 if mismatch else 1, 1, figsize=(6, 6 if mismatch else 3.5), sharex=True, squeeze=False)
    ax = axes[0, 0]
    ax.plot(steps, [r["reward"] for r in history], label="mean reward")
    ax.plot(steps, [r["solved"] for r in history], label="solved fraction")
    ax.legend()
    if mismatch:
        ax = axes[1, 0]
        for key, label in (("mismatch_mean", "mean |Δ log p|"), ("mismatch_max", "max |Δ log p|"), ("mismatch_kl", "KL estimate")):
            ax.plot(steps, [abs(r.get(key, np.nan)) for r in history], label=label)
        ax.set_yscale("log")
        ax.set_title("train-inference mismatch (engine vs trainer log-probs)", fontsize=9)
        ax.legend()
    ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv=None) -> GRPOConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    overridable = [f for f in dataclasses.fields(GRPOConfig) if f.name != "preset"]
    for field in overridable:
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = field.type.removesuffix(" | None")
            parser.add_argument(flag, type={"int": int, "float": float}.get(kind, str), default=None)
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in overridable if getattr(args, f.name) is not None}
    return dataclasses.replace(PRESETS[args.preset], **overrides)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    try:
        main(parse_args())
    except ConsistencyError as error:
        raise SystemExit(f"grpo stopped: {error}") from None
