"""The RL loop that GRPO and PPO share, around an in-process sglang-jax rollout worker.

Each step: sync the policy's params into the engine (zero copy where placements match), sample
completions of the step's prompts, score them, then update with the KV cache dropped and the
engine's references to the trainer's buffers released (the update may donate them). Metrics go
to ``<output_dir>/metrics.jsonl`` (and the progress bar, W&B when configured), a plot to
``reward.png``; orbax checkpoints of everything the algorithm trains let a rerun with the same
output dir resume.

An algorithm (:class:`Algorithm`) supplies only what differs: the trees it trains and
checkpoints, and the update of one rollout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from examples.reporting import check_plotting, step_log, summarize
from examples.run_dir import (
    RunDirError,
    TrainState,
    check_writable,
    checkpoint_manager,
    claim_output_dir,
    keep_metrics_through,
    latest_checkpoint_step,
    logged_elapsed_s,
    output_dir_lock,
    restore_or_init,
    save_train_state,
)
from examples.tasks import Problem, addition_problems, addition_reward, gsm8k_problems, gsm8k_reward
from examples.tool_task import TOOL_PIECES, ToolTask, warm_start
from models import (
    CausalLM,
    TinyModelSpec,
    TinyMoeSpec,
    flax_model_for,
    router_choices,
    tiny_llama3_spec,
    write_tiny_model,
)
from models.registry import check_routing_recordable
from rollout import ConsistencyError, RolloutBatch, RolloutWorker, WorkerConfig, mismatch_stats
from rollout.config import DTYPES
from rollout.launch import NUM_PROCESSES_ENV, PROCESS_ID_ENV, exit_status, join, launch_local
from trainer_bridge import LoraConfig, SyncReport, apply_adapters, load_hf_params

logger = logging.getLogger(__name__)

# The tiny presets' models: digits and operators only, so a random policy often answers with a
# number. "tiny-llama" is a Llama-3-style one (GQA, llama3 RoPE scaling, untied, head_dim 64).
TINY_MODELS = {
    "tiny": lambda seed: TinyModelSpec(vocab_size=32, tokenizer="chars", seed=seed),
    "tiny-llama": lambda seed: tiny_llama3_spec(vocab_size=32, tokenizer="chars", seed=seed),
    # Qwen3-MoE: 8 experts of which 2 run per token, layer 0 dense.
    "tiny-moe": lambda seed: TinyMoeSpec(vocab_size=32, tokenizer="chars", seed=seed),
    # With a chat template, and one token per piece of tool-call markup (examples/tool_task.py).
    "tiny-tools": lambda seed: TinyModelSpec(
        vocab_size=32, tokenizer="chars", chat_template=True, extra_chars="\n", added_tokens=TOOL_PIECES, seed=seed
    ),
}
PRESET_NAMES = (*TINY_MODELS, "qwen2.5-3b", "qwen2.5-3b-tools")
# What every algorithm's qwen2.5-3b preset shares: Qwen2.5-3B-Instruct on GSM8K, in bfloat16 on a
# TPU v4-8 (tp 4), sizes in the range of the published MLLM-JAX GRPO runs.
QWEN25_3B = dict(
    preset="qwen2.5-3b",
    model="Qwen/Qwen2.5-3B-Instruct",
    dataset="openai/gsm8k",
    steps=200,
    max_prompt_tokens=256,
    max_new_tokens=512,
    temperature=1.0,
    learning_rate=1e-6,
    dtype="bfloat16",
    kv_tokens=131072,
    tp_size=4,
    checkpoint_every=50,
)


class UsageError(ValueError):
    """A setting this job or machine cannot run (its processes, its devices): the command's
    usage error, with the flags for the field names (:func:`cli`)."""


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """What every algorithm's config has. A subclass adds its own fields and a
    ``samples_per_prompt`` (a field or a property): the completions sampled per prompt, and
    its ``algorithm``'s name."""

    algorithm: ClassVar[str]

    preset: str = "tiny"
    model: str | None = None  # HF hub id or local dir; None builds the tiny model
    dataset: str | None = None  # GSM8K: HF hub id or a local JSON-lines file of its rows
    output_dir: str = "runs/tiny"
    steps: int = 60
    prompts_per_step: int = 8
    max_prompt_tokens: int = 8
    max_new_tokens: int = 3
    max_operand: int = 9  # tiny presets: the task is a+b= with digits a, b in [0, max_operand]
    # Tiny presets: the most a wrong number earns, the closer the more (1 for the exact answer).
    near_credit: float = 0.5
    temperature: float = 1.0
    learning_rate: float = 6e-4
    warmup_updates: int = 0  # train steps over which the policy's learning rate ramps up linearly from 0
    # After the warm-up, the policy's learning rate falls along a cosine to 0, reached one train
    # step after the run's last (of steps x ppo_epochs x minibatches): the last step's updates are
    # small, not void. False: it stays at learning_rate.
    lr_decay: bool = False
    ppo_epochs: int = 2
    minibatches: int = 1  # train steps per epoch, each on a shuffled 1/minibatches of the rows
    clip_eps: float = 0.2
    # Stop a step's epochs once the policy's approx KL (k3) to the rollout policy passes this. None: off.
    target_kl: float | None = None
    dtype: str = "float32"
    kv_tokens: int = 4096
    tp_size: int = 1
    # Engines in the process, each on tp_size devices (dp_size x tp_size = devices); None: as
    # many as the process's devices hold.
    dp_size: int | None = None
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
    # MoE presets: the engine records the experts each token was routed to and the trainer's
    # forwards route to them (rollout routing replay, R3), so that the gradient is taken through
    # the experts that produced the samples.
    routing_replay: bool = False
    # Every N steps run RolloutWorker.check_consistency and stop on a ConsistencyError. 0: off.
    check_consistency_every: int = 0
    consistency_atol: float = 1e-3
    # Every N steps (the first included) also roll out one fixed set of eval_prompts problems,
    # the same problems and sampling seeds each time, with the weights that step generates with:
    # eval_reward and eval_solved follow the policy without the noise of which problems a step
    # drew. They are not trained on. 0: off.
    eval_every: int = 0
    eval_prompts: int = 16
    # > 1: multi-turn episodes with the task's calculator (examples/tool_task.py); max_new_tokens
    # is then the whole conversation after the prompt, turn_tokens one turn's.
    max_turns: int = 1
    turn_tokens: int = 16
    # Supervised steps on worked episodes before RL (tool presets: the tool-call format); a resume
    # runs them again (deterministic), as its KL reference is the warm-started policy.
    warm_start_steps: int = 0
    # Decode steps per dispatch (WorkerConfig.decode_steps): the engines run this many decode
    # steps in one compiled loop, the scheduler's Python beside the device rather than between
    # forwards. Not with routing_replay. The samples are those of 1 (docs/worker.md).
    decode_steps: int = 1
    # > 1: start this many processes of one JAX job on this machine (CPU runs, tests). A job is
    # otherwise joined from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID: each
    # process generates its share of every step's prompts and the update runs over all of them.
    local_processes: int = 1

    @property
    def decay_updates(self) -> int:
        """Train steps after the warm-up over which the learning rate decays (0: none)."""
        return max(1, self.steps * self.ppo_epochs * self.minibatches - self.warmup_updates) if self.lr_decay else 0

    @property
    def prompts_drawn(self) -> int:
        """The most distinct prompts one draw takes from a task's pool (a step's, the evaluation's)."""
        return max(self.prompts_per_step, self.eval_prompts if self.eval_every else 0)

    @property
    def logprob_settings(self) -> tuple[str, ...]:
        """The settings given that need the engine's log-probs with every sample, as the
        config's messages name them."""
        given = {"return_logprobs": self.return_logprobs, "tis_cap": self.tis_cap is not None}
        return tuple(name for name, on in given.items() if on)

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprob_settings)

    def check_processes(self, processes: int, given_by: str) -> None:
        """Refuse what cannot run over ``processes`` processes of one job (``given_by``: the
        setting that asks for them), naming the settings."""
        one_process = self.logprob_settings + tuple(
            name
            for name, given in (
                ("check_consistency_every", self.check_consistency_every),
                ("max_turns", self.max_turns > 1),  # the episodes' sessions are one process's
            )
            if given
        )
        if processes > 1 and one_process:
            verb = "runs" if len(one_process) == 1 else "run"
            raise UsageError(f"{' and '.join(one_process)} {verb} in one process only, not with {given_by} {processes}")
        if self.prompts_per_step % processes:
            raise UsageError(
                f"prompts_per_step {self.prompts_per_step} does not split over {given_by} {processes}: "
                "each process generates an equal share"
            )

    @property
    def unmerged_lora(self) -> LoraConfig | None:
        """The adapters the engines compute beside the base (an algorithm training LoRA), or None."""
        return None

    def __post_init__(self):
        # Comparisons with NaN are all false: a NaN would pass every range check below.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{field.name} must be a finite number, got {value}")
        if self.preset not in PRESET_NAMES:
            raise ValueError(f"preset must be one of {PRESET_NAMES}, got {self.preset!r}")
        if self.seed < 0:  # the tiny presets' weights and every draw derive from it
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not self.output_dir:  # Path("") is the current directory
            raise ValueError("output_dir must not be empty")
        for name in (
            "steps",
            "prompts_per_step",
            "max_prompt_tokens",
            "max_new_tokens",
            "ppo_epochs",
            "kv_tokens",
            "decode_steps",
            "checkpoint_every",
            "tp_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_size is not None and self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1 (or unset: every device), got {self.dp_size}")
        if not 1 <= self.minibatches <= self.prompts_per_step * self.samples_per_prompt:
            raise ValueError(f"minibatches must be in [1, rows per step], got {self.minibatches}")
        if self.target_kl is not None and self.target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 (or unset), got {self.target_kl}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        for name in ("learning_rate", "temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.near_credit < 1:
            raise ValueError(f"near_credit must be in [0, 1), got {self.near_credit}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 (or unset), got {self.tis_cap}")
        if self.check_consistency_every < 0 or self.consistency_atol <= 0:
            raise ValueError("check_consistency_every must be >= 0 and consistency_atol > 0")
        if self.eval_every < 0 or self.eval_prompts < 1:
            raise ValueError("eval_every must be >= 0 and eval_prompts >= 1")
        rows = self.prompts_per_step * self.samples_per_prompt
        if rows * (self.max_prompt_tokens + self.max_new_tokens) > self.kv_tokens:
            raise ValueError(
                f"kv_tokens={self.kv_tokens} cannot hold one step: {rows} rows x "
                f"({self.max_prompt_tokens} + {self.max_new_tokens}) tokens"
            )
        if self.warmup_updates < 0:
            raise ValueError(f"warmup_updates must be >= 0, got {self.warmup_updates}")
        if not 0 <= self.max_operand <= 9:
            raise ValueError(f"max_operand must be a digit (0-9), got {self.max_operand}")
        if self.local_processes < 1:
            raise ValueError(f"local_processes must be >= 1, got {self.local_processes}")
        self.check_processes(self.local_processes, "local_processes")
        if self.max_turns < 1 or self.turn_tokens < 1 or self.warm_start_steps < 0:
            raise ValueError("max_turns and turn_tokens must be >= 1, warm_start_steps >= 0")
        if self.warm_start_steps and self.max_turns == 1:
            raise ValueError("warm_start_steps shows worked tool episodes: it needs max_turns > 1")
        if self.preset not in TINY_MODELS and (self.model is None or self.dataset is None):
            raise ValueError(f"preset {self.preset!r} needs a model and a dataset")
        if self.preset in TINY_MODELS:
            # Both were taken and ignored: a run trained the tiny model and recorded the other's name.
            given = [f"--{name}" for name in ("model", "dataset") if getattr(self, name) is not None]
            if given:
                raise ValueError(
                    f"preset {self.preset!r} builds its own model and task: {' and '.join(given)} "
                    f"{'is' if len(given) == 1 else 'are'} for the qwen2.5-3b presets"
                )
            if self.max_turns > 1 and not TINY_MODELS[self.preset](self.seed).chat_template:
                # Caught here, not after the engine started, at the first episode's prompts.
                raise ValueError(
                    f"max_turns > 1 (tool episodes) needs a model with a chat template: preset {self.preset!r} has none"
                )
        if self.routing_replay:  # caught here, not when the engine starts
            if self.decode_steps > 1:
                raise ValueError(
                    "routing_replay needs decode_steps 1: the engine records routing per forward, and a decode "
                    "chunk runs its forwards in one loop"
                )
            if self.preset in TINY_MODELS and not isinstance(TINY_MODELS[self.preset](self.seed), TinyMoeSpec):
                raise ValueError(
                    f"routing_replay replays an MoE model's routing: preset {self.preset!r}'s model has no experts "
                    "(the tiny-moe preset's has)"
                )
            if self.model is not None:
                check_routing_recordable(self.model, "routing_replay")


@dataclasses.dataclass
class Rollout:
    """One step's samples, scored, with the arrays the update needs on device."""

    problems: list[Problem]
    batch: RolloutBatch
    rewards: np.ndarray  # [B] float32, one per completion
    arrays: dict[str, jax.Array]  # rollout_arrays(config): [B, T] (routed_experts [B, T, L, k])
    step: int  # 0-based index of the step that produced it
    # This process's rows (numpy, [B, ...]) as an array of every process's rows, for the update.
    rows: Callable[[Any], jax.Array] = jnp.asarray


class Algorithm(Protocol):
    """What an RL algorithm supplies to :func:`run`."""

    name: str
    # Extra progress-bar fields, (label, metric key, "{:.3f}"-style template), and extra plot panels,
    # (title, ((metric key, label), ...)).
    progress_fields: tuple[tuple[str, str, str], ...]
    plot_panels: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]

    def init_trees(self, params) -> dict[str, Any]:
        """Everything trained and checkpointed; ``"params"`` is the policy the engine serves."""

    def update(self, trees: dict[str, Any], rollout: Rollout) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        """The new trees and the step's statistics. Runs with the engine released: it may donate
        ``trees``."""


def sync_policy(worker: RolloutWorker, algorithm: Algorithm, trees: dict, **kwargs) -> SyncReport:
    """Serve the policy of ``trees``: its params, or with LoRA (an algorithm whose ``lora`` is a
    LoraConfig) its frozen base with the adapters (merged at sync, or computed unmerged)."""
    lora = getattr(algorithm, "lora", None)
    if lora is None:
        return worker.sync_params(trees["params"], **kwargs)
    return worker.sync_params(algorithm.base, adapters=trees["params"], lora=lora, **kwargs)


def policy_params(algorithm: Algorithm, trees: dict) -> dict:
    """The policy's whole param tree (with LoRA, the base with the adapters applied)."""
    lora = getattr(algorithm, "lora", None)
    return trees["params"] if lora is None else apply_adapters(algorithm.base, trees["params"], lora)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The trainer's model and its initial params, placed as the engine places its weights."""

    model: CausalLM
    params: dict
    model_dir: Path


def prepare_model(config: RLConfig, output_dir: Path) -> Path:
    if config.preset in TINY_MODELS:
        return write_tiny_model(output_dir / "model", TINY_MODELS[config.preset](config.seed))
    if Path(config.model).is_dir():
        return Path(config.model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(config.model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))


class Task:
    """Prompts and rewards of the preset's task."""

    def __init__(self, config: RLConfig, tokenizer):
        self.config = config
        if config.preset in TINY_MODELS:
            self.pool = None
            self.reward_fn = partial(addition_reward, near_credit=config.near_credit)
        else:
            problems = gsm8k_problems(tokenizer, config.dataset)
            # The rollout batch pads prompts to max_prompt_tokens: longer ones cannot be used.
            self.pool = [
                p
                for p in problems
                if len(tokenizer.encode(p.prompt, add_special_tokens=False)) <= config.max_prompt_tokens
            ]
            if len(self.pool) < config.prompts_drawn:
                raise ValueError(
                    f"{config.dataset}: {len(self.pool)} of {len(problems)} prompts fit in "
                    f"max_prompt_tokens={config.max_prompt_tokens}, fewer than the {config.prompts_drawn} "
                    "a draw takes (prompts_per_step, eval_prompts)"
                )
            if len(self.pool) < len(problems):
                logger.info(
                    "%d of %d prompts are longer than max_prompt_tokens=%d: skipped",
                    len(problems) - len(self.pool),
                    len(problems),
                    config.max_prompt_tokens,
                )
            self.reward_fn = gsm8k_reward

    def sample(self, count: int, step: int) -> list[Problem]:
        """The prompts of ``step``: they depend on (seed, step) only, so a resumed run sees the
        prompts an uninterrupted one would."""
        rng = np.random.default_rng([self.config.seed, step])
        if self.pool is None:
            return addition_problems(rng, count, self.config.max_operand)
        return [self.pool[i] for i in rng.choice(len(self.pool), count, replace=False)]


class Setup(NamedTuple):
    """What both loops (:func:`run` and :func:`examples.async_rl.run_async`) start from."""

    output_dir: Path
    worker: RolloutWorker
    algorithm: Algorithm
    manager: Any  # orbax CheckpointManager of output_dir/checkpoints
    state: TrainState  # the latest checkpoint restored, or the algorithm's initial trees at step 0
    task: Task | ToolTask  # the preset's prompts and rewards (the worker's tokenizer); ToolTask: episodes
    trainer_devices: list | None  # where the trainer's params live when the engines are elsewhere


def worker_config(config: RLConfig, model_dir: Path, engine_devices: list | None = None) -> WorkerConfig:
    """The rollout worker of a run: ``config.dp_size`` engines (by default as many as the
    devices hold) on the first ``dp_size x tp_size`` of ``engine_devices`` (None: the local
    devices), the KV pool and batch the run's steps need."""
    devices = list(jax.local_devices() if engine_devices is None else engine_devices)
    dp_size = config.dp_size or len(devices) // config.tp_size
    if dp_size < 1 or dp_size * config.tp_size > len(devices):
        wants = f"tp_size {config.tp_size}"
        if config.dp_size is not None:
            wants = f"dp_size {dp_size} x {wants}"
        have = "this process has" if engine_devices is None else "the engines have"
        raise UsageError(f"{wants} needs {max(dp_size, 1) * config.tp_size} devices, but {have} {len(devices)}")
    return WorkerConfig(
        model_path=str(model_dir),
        dtype=config.dtype,
        load_format="dummy",
        tp_size=config.tp_size,
        dp_size=dp_size,
        devices=tuple(devices[: dp_size * config.tp_size]),
        # The engine takes prompt + completion <= context_length - 2 tokens whole.
        max_total_tokens=config.kv_tokens,
        context_length=config.max_prompt_tokens + config.max_new_tokens + 2,
        max_running_requests=config.prompts_per_step * config.samples_per_prompt,
        seed=config.seed,
        max_prefill_tokens=max(4096, config.max_prompt_tokens * 8),
        chunked_prefill_size=4096,
        record_routing=config.routing_replay,
        unmerged_lora=config.unmerged_lora,
        decode_steps=config.decode_steps,
    )


@contextlib.contextmanager
def set_up(
    config: RLConfig,
    make_algorithm: Callable[[RLConfig, Policy], Algorithm],
    split_devices: Callable[[int], tuple[list, list]] | None = None,
):
    """The one start-up path of both loops: lock the output dir for the run's life (process 0,
    which writes run.json and the metrics), join the job, claim the dir (a resume must be the
    same run), write or find the model, start the rollout worker, build the trainer's model
    of the checkpoint's family (``flax_model_for``: every preset's), load its params, build the
    algorithm, restore the latest checkpoint (metrics.jsonl cut back to its step), and the task
    with the worker's tokenizer. The worker is closed on leaving. Yields None, having started
    nothing, where the latest checkpoint is already at ``config.steps`` (said in a warning).

    ``split_devices`` None (the synchronous loop): the engines on the local devices
    (:func:`worker_config`), the trainer's params placed as the engine places its weights
    (syncs alias them). Given (the asynchronous loop), ``split_devices(tp_size)`` -> (trainer
    devices, engine devices), called once the job is joined: the engines on theirs (by the same
    rule), the trainer's params replicated over its own (syncs copy them onto the engines'
    devices).
    """
    output_dir = Path(config.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise RunDirError(f"{output_dir}: the output dir is a file: use another output dir")
    output_dir.mkdir(parents=True, exist_ok=True)
    check_writable(output_dir)
    # One lock for the job: its other processes share the dir, writing only their own model
    # copies and, through orbax, their shards of process 0's checkpoints. Taken before joining
    # the job, so a run refused here exits at once: a process that joined waits at its exit for
    # its peers (a second --local-processes run on a dir took 70 s to be refused, by a PodError).
    lead = int(os.environ.get(PROCESS_ID_ENV) or 0) == 0
    with output_dir_lock(output_dir) if lead else contextlib.nullcontext():
        join()
        latest = claim_output_dir(config, output_dir)
        # A pod's processes are known once joined (--local-processes were checked with the config).
        config.check_processes(jax.process_count(), NUM_PROCESSES_ENV)
        if latest is not None and warn_if_trained(config, output_dir, latest):
            # Said before anything starts: a real model's engines take minutes to start.
            if lead:
                keep_metrics_through(output_dir / "metrics.jsonl", latest)
            yield None
            return
        # Each process writes its own copy of the tiny model (the same bytes): no shared-file race.
        model_dir = prepare_model(
            config, output_dir if jax.process_count() == 1 else output_dir / f"process-{jax.process_index()}"
        )
        trainer_devices, engine_devices = split_devices(config.tp_size) if split_devices else (None, None)
        worker = RolloutWorker(worker_config(config, model_dir, engine_devices))
        try:
            model = flax_model_for(json.loads((model_dir / "config.json").read_text()), config.dtype)
            hf_params = load_hf_params(model_dir)
            if trainer_devices is None:
                # Placed as the engine places its weights: syncs alias these buffers instead of copying.
                shardings = worker.param_shardings()
            else:
                replicated = NamedSharding(Mesh(np.array(trainer_devices), ("data",)), PartitionSpec())
                shardings = jax.tree_util.tree_map(lambda _: replicated, hf_params)
            # Each process supplies its devices' slices (the shardings may span processes).
            params = jax.tree_util.tree_map(
                lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: np.asarray(x[i], config.dtype)),
                hf_params,
                shardings,
            )
            if config.warm_start_steps:  # on a resume too: the KL reference (and a LoRA base) is this policy
                params, loss = warm_start(
                    model, params, worker.tokenizer, steps=config.warm_start_steps, seed=config.seed
                )
                logger.info("warm start: %d supervised steps, loss %.3f", config.warm_start_steps, loss)
            manager = checkpoint_manager(output_dir)
            algorithm = make_algorithm(config, Policy(model, params, model_dir))
            state = restore_or_init(manager, algorithm.init_trees(params))
            if lead:  # the steps after the checkpoint run again: their records are logged again
                keep_metrics_through(output_dir / "metrics.jsonl", state.step)
            if config.max_turns > 1:
                task = ToolTask(config, worker.tokenizer, tiny=config.preset in TINY_MODELS)
            else:
                task = Task(config, worker.tokenizer)
            yield Setup(output_dir, worker, algorithm, manager, state, task, trainer_devices)
        finally:
            worker.close()


def run(config: RLConfig, make_algorithm: Callable[[RLConfig, Policy], Algorithm]) -> dict:
    """Train with the algorithm ``make_algorithm(config, policy)`` builds; returns a summary."""
    with set_up(config, make_algorithm) as setup:
        return _train(config, setup) if setup else recorded_summary(config, make_algorithm)


def recorded_summary(config: RLConfig, algorithm: type[Algorithm]) -> dict:
    """The summary of a run already trained to ``config.steps``: its recorded figures (the plot
    drawn again: its metrics were cut back to the checkpoint). ``algorithm``: its class."""
    return summarize(config, Path(config.output_dir), [], algorithm) if jax.process_index() == 0 else {}


def warn_if_trained(config: RLConfig, output_dir: Path, step: int) -> bool:
    """Whether the run resumed at ``step`` is already trained to ``config.steps``, said in a warning."""
    if step < config.steps:
        return False
    logger.warning(
        "%s: the checkpoint is at step %d and --steps is %d: nothing to train (raise --steps to go on)",
        output_dir,
        step,
        config.steps,
    )
    return True


def _train(config: RLConfig, setup: Setup) -> dict:
    output_dir, worker, algorithm, manager, state, task, _ = setup
    # Process 0 reports for the job (every process computes the same global metrics).
    lead = jax.process_index() == 0
    if not config.resync:
        # The ablation's engine keeps its own copy of the initial weights for the whole run.
        sync_policy(worker, algorithm, {"params": jax.tree_util.tree_map(jnp.copy, state.trees["params"])})
    history = []
    # elapsed_s is the run's: a resume counts on from the checkpoint's step, not from 0.
    start = time.perf_counter() - (logged_elapsed_s(output_dir / "metrics.jsonl") if lead else 0.0)
    reports = step_log(config, output_dir, algorithm, state.step) if lead else contextlib.nullcontext(lambda _: None)
    with reports as log:
        try:
            while state.step < config.steps:
                record = _step(config, worker, algorithm, state, task)
                record["elapsed_s"] = time.perf_counter() - start
                state.step += 1
                history.append(record)
                log(record)
                if state.step % config.checkpoint_every == 0 or state.step == config.steps:
                    save_train_state(manager, state)
        finally:
            manager.wait_until_finished()
    return summarize(config, output_dir, history, algorithm) if lead else {}


def _step(config: RLConfig, worker: RolloutWorker, algorithm: Algorithm, state: TrainState, task: Task) -> dict:
    start = time.perf_counter()
    # check_finite: NaN weights would otherwise serve silently (the model then emits only EOS).
    # Versioned by step: a resumed run's tokens carry the versions the uninterrupted run's would.
    report = None
    if config.resync:
        report = sync_policy(worker, algorithm, state.trees, check_finite=True, version=state.step + 1)
    sync_s = time.perf_counter() - start

    # Every process draws the same global prompts (fixed by (seed, step)) and generates its
    # share; with the same call seed prompt_offset makes each sample draw what one process
    # generating every prompt would.
    problems = task.sample(config.prompts_per_step, state.step)
    share = config.prompts_per_step // jax.process_count()
    offset = share * jax.process_index()
    problems = problems[offset : offset + share]
    consistency = {}
    if config.check_consistency_every and state.step % config.check_consistency_every == 0:
        consistency = _check_consistency(config, worker, policy_params(algorithm, state.trees), state, problems)
    start = time.perf_counter()
    batch, rewards, task_metrics = _roll_out(config, worker, task, problems, step_seed(config.seed, state.step), offset)
    generate_s = time.perf_counter() - start
    evaluation = {}
    if config.eval_every and state.step % config.eval_every == 0:
        evaluation = _evaluate(config, worker, task)
    rows = _rows_over_processes(worker)
    arrays = {name: rows(getattr(batch, name)) for name in rollout_arrays(config)}
    rollout = Rollout(problems, batch, rewards, arrays, state.step, rows)
    completion_tokens = batch.completion_lengths
    if jax.process_count() > 1:
        # The metrics are the job's: every process's rows.
        from jax.experimental import multihost_utils

        rewards, completion_tokens = (
            np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in (rewards, completion_tokens)
        )

    start = time.perf_counter()
    # With resync the engine serves the trainer's own buffers, which the update may donate:
    # released_for_training drops the KV cache and makes the next generate wait for a sync.
    context = worker.released_for_training() if config.resync else _kv_dropped(worker)
    with context:
        state.trees, stats = algorithm.update(state.trees, rollout)
        # Reading the statistics waits for the update to finish while the engine is released.
        stats = {k: float(v) for k, v in stats.items()}
    train_s = time.perf_counter() - start
    return {
        "step": state.step + 1,
        **rollout_metrics(batch, rewards, completion_tokens),
        "bytes_copied": report.bytes_copied if report else 0,
        "sync_s": sync_s,
        "generate_s": generate_s,
        "train_s": train_s,
        **task_metrics,
        **consistency,
        **evaluation,
        **stats,
    }


def _roll_out(
    config: RLConfig,
    worker: RolloutWorker,
    task: Task | ToolTask,
    problems,
    seed: int,
    offset: int = 0,
    for_training: bool = True,
):
    """``problems``' samples: (their RolloutBatch, rewards, the task's episode metrics).
    ``offset``: the index of ``problems[0]`` among the step's prompts (episodes run in one
    process). ``for_training`` False: without what only the update reads (log-probs, routing)."""
    if isinstance(task, ToolTask):
        return task.roll_out(
            worker,
            problems,
            seed=seed,
            return_logprobs=for_training and config.wants_logprobs,
            return_routing=for_training and config.routing_replay,
        )
    batch = worker.generate(
        [p.prompt for p in problems],
        n=config.samples_per_prompt,
        temperature=config.temperature,
        max_new_tokens=config.max_new_tokens,
        pad_prompts_to=config.max_prompt_tokens,
        return_logprobs=for_training and config.wants_logprobs,
        return_routing=for_training and config.routing_replay,
        prompt_offset=offset,
        seed=seed,
    )
    rewards = np.array(
        [task.reward_fn(text, problems[i].answer) for text, i in zip(batch.completion_texts, batch.prompt_index)],
        dtype=np.float32,
    )
    return batch, rewards, {}


# The prompts and seed stream of the evaluation (Task.sample's step): no training step reaches it.
EVAL_STREAM = 2**31 - 1


def _evaluate(config: RLConfig, worker: RolloutWorker, task: Task | ToolTask) -> dict[str, float]:
    """The served policy's rewards on the fixed eval problems. Every process rolls out all of
    them with the same seeds, so every process gets the job's figures."""
    start = time.perf_counter()
    problems = task.sample(config.eval_prompts, EVAL_STREAM)
    _, rewards, _ = _roll_out(config, worker, task, problems, step_seed(config.seed, EVAL_STREAM), for_training=False)
    return {
        "eval_reward": float(rewards.mean()),
        "eval_solved": float((rewards >= 1.0).mean()),
        "eval_s": time.perf_counter() - start,
    }


def rollout_metrics(
    batch: RolloutBatch, rewards: np.ndarray, completion_tokens: np.ndarray | None = None
) -> dict[str, float]:
    """A step's rewards and completion lengths (``completion_tokens``: the batch's own unless
    given, e.g. every process's)."""
    completion_tokens = batch.completion_lengths if completion_tokens is None else completion_tokens
    return {
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "solved": float((rewards >= 1.0).mean()),
        "completion_tokens": float(completion_tokens.mean()),
        "weight_version": batch.weight_version,
    }


def _rows_over_processes(worker: RolloutWorker) -> Callable[[Any], jax.Array]:
    """One process: ``jnp.asarray``. Several: each process's rows become its part of one array
    sharded over the worker mesh's ``replica`` axis, so the update is one data-parallel step."""
    if jax.process_count() == 1:
        return jnp.asarray
    sharding = NamedSharding(worker.mesh, PartitionSpec("replica"))
    return lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x))


def rollout_arrays(config: RLConfig) -> tuple[str, ...]:
    """The RolloutBatch fields the update reads, on device."""
    names = ("tokens", "attention_mask", "positions", "completion_mask")
    return names + ("routed_experts",) if config.routing_replay else names


def model_inputs(data: dict) -> tuple:
    """The policy model's inputs from a rollout's arrays: tokens, attention_mask, positions and
    routed_experts (None without routing replay)."""
    return data["tokens"], data["attention_mask"], data["positions"], data.get("routed_experts")


def routing_probe(model) -> Callable[[Any, dict], dict[str, jax.Array]]:
    """``probe(params, arrays)``: how often the policy's own routers pick other experts than the
    engine recorded (``arrays["routed_experts"]``), over the tokens the engine routed
    (``routing_differs``; a token differs when any MoE layer's top-k set does). Each router
    sees what the engine's saw: the forward replays the engine's experts in every layer."""

    @jax.jit
    def probe(params, arrays):
        inputs = (arrays["tokens"], arrays["attention_mask"], arrays["positions"])
        own = router_choices(model, params, *inputs, routed_experts=arrays["routed_experts"])
        engine = jnp.sort(arrays["routed_experts"].astype(jnp.int32), axis=-1)
        routed = (engine[..., 0, 0] >= 0) & arrays["attention_mask"].astype(bool)
        differs = jnp.any(engine != jnp.sort(own, axis=-1), axis=(-2, -1)) & routed
        return {"routing_differs": differs.sum() / jnp.maximum(routed.sum(), 1)}

    return probe


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of ``step``: fixed by (seed, step), as the prompts are."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1, dtype=np.uint32)[0]) >> 1


def mismatch_metrics(batch: RolloutBatch, trainer_logprobs, rows=slice(None)) -> dict[str, float]:
    """The engine's log-probs against the trainer's ([B', T - 1], for ``batch`` rows ``rows``) on
    the same tokens, before any update."""
    stats = mismatch_stats(batch.logprobs[rows, 1:], np.asarray(trainer_logprobs), batch.completion_mask[rows, 1:])
    return {"mismatch_mean": stats["mean_abs_diff"], "mismatch_max": stats["max_abs_diff"], "mismatch_kl": stats["kl"]}


def _check_consistency(config: RLConfig, worker: RolloutWorker, params, state: TrainState, problems) -> dict:
    """Engine against trainer (``params``) on this step's prompts; a ConsistencyError stops the run."""
    try:
        report = worker.check_consistency(
            params,
            [p.prompt for p in problems],
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            pad_prompts_to=config.max_prompt_tokens,
            seed=config.seed + state.step,
            atol=config.consistency_atol,
            routing_replay=config.routing_replay,
        )
    except ConsistencyError as error:
        raise ConsistencyError(f"step {state.step + 1}: {error}", error.report) from None
    return {"consistency_max": report.max_abs_diff, "consistency_s": report.seconds}


@contextlib.contextmanager
def _kv_dropped(worker):
    """KV dropped around the update, for a worker that owns its weights (the ablation)."""
    yield worker.drop_kv()


def parse_args(
    config_class: type[RLConfig],
    presets: dict[str, RLConfig],
    argv=None,
    description: str = "",
    prog: str | None = None,
):
    """A ``config_class`` from the command line: ``--preset`` plus one flag per field. ``prog``: the
    command in its usage line (Python 3.12's own is the file's name, ``grpo.py``, under ``-m``)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=tuple(presets), default="tiny", help="default: tiny")
    overridable = [f for f in dataclasses.fields(config_class) if f.name != "preset"]
    for field in overridable:
        help = _preset_values(presets, field.name)
        if field.type == "bool":
            parser.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            kind = field.type.removesuffix(" | None")
            kind = {"int": int, "float": float}.get(kind, str)
            parser.add_argument(_flag(field.name), type=kind, default=None, help=help)
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in overridable if getattr(args, f.name) is not None}
    try:
        return dataclasses.replace(presets[args.preset], **overrides)
    except ValueError as error:  # the config's own checks: a usage error, not a traceback
        parser.error(_as_flags(str(error), [f.name for f in dataclasses.fields(config_class)]))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _preset_values(presets: dict[str, RLConfig], name: str) -> str:
    """A flag's help: its value under the default preset, and under each preset that differs."""
    default = getattr(presets["tiny"], name)
    others = [f"{preset}: {getattr(c, name)}" for preset, c in presets.items() if getattr(c, name) != default]
    return f"default: {default}" + (f" ({', '.join(others)})" if others else "")


def _as_flags(message: str, names: list[str]) -> str:
    """A config's message as the command line says it: the field names it starts with, and those
    of more than one word anywhere, as their flags (``steps must be >= 1`` -> ``--steps ...``)."""
    first = message.split(" ", 1)[0]
    if first in names:
        message = _flag(first) + message[len(first) :]
    compound = "|".join(sorted((re.escape(name) for name in names if "_" in name), key=len, reverse=True))
    return re.sub(rf"(?<![-\w])({compound})(?!\w)", lambda match: _flag(match.group(1)), message)


def cli(name: str, main: Callable[[RLConfig], dict], config: RLConfig) -> None:
    """Run ``main(config)`` as a command: INFO logs of the loop, a ConsistencyError as the exit
    message, a UsageError as a usage error (exit status 2). ``--local-processes N`` (outside a
    job) runs the same command as N processes."""
    check_plotting(config)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("examples").setLevel(logging.INFO)
    try:
        if config.local_processes > 1 and not os.environ.get(PROCESS_ID_ENV):
            _run_local(name, config)
        else:
            main(config)
    except ConsistencyError as error:
        raise SystemExit(f"{name} stopped: {error}") from None
    except RunDirError as error:  # says which file and what to do: no traceback
        raise SystemExit(f"{name}: {error}") from None
    except UsageError as error:  # as argparse's usage errors: one line, exit status 2
        print(f"{name}: error: {_as_flags(str(error), [f.name for f in dataclasses.fields(config)])}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C: what is kept and how to go on, not a traceback
        latest = latest_checkpoint_step(Path(config.output_dir))
        if latest is None:
            print(f"{name}: interrupted before its first checkpoint: the same command starts over", file=sys.stderr)
        else:
            print(
                f"{name}: interrupted; the same command resumes from step {latest}, the latest "
                f"checkpoint in {config.output_dir}/checkpoints",
                file=sys.stderr,
            )
        raise SystemExit(130) from None


def _run_local(name: str, config: RLConfig) -> None:
    """The same command as ``config.local_processes`` processes of one JAX job, their logs printed."""
    results = launch_local(["-m", f"examples.{name}", *sys.argv[1:]], config.local_processes)
    for result in results:
        print(f"--- process {result.process_id} ({result.ended}) ---\n{result.log}", end="")
    failed = [r.process_id for r in results if r.returncode != 0]
    if failed:
        print(f"{name}: process(es) {failed} failed", file=sys.stderr)
        # The first failure's status (a usage error's 2), as rollout.launch exits.
        raise SystemExit(exit_status(results))
