"""Asynchronous RL (``--async-rollout``): generation of step k+1 overlaps the update of step k.

The trainer and the engines sit on different devices: the first half of the local devices
train, the second half serve (on 4 fake CPU devices, 2 and 2). Each step waits for its rollout,
starts generating the next step's rollout in a thread with the weights the engines have,
updates on its own rollout meanwhile, and pushes the new weights in flight: the next rollout's
running requests go on with them (``batch.token_versions`` says which version sampled each
token). The off-policy tokens are corrected with truncated importance sampling against the
engine's per-token log-probs, which are those of the weights that sampled each token.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from examples.reporting import step_log, summarize
from examples.rl_loop import (
    Algorithm,
    Policy,
    RLConfig,
    Rollout,
    Setup,
    UsageError,
    recorded_summary,
    rollout_arrays,
    rollout_metrics,
    set_up,
    step_seed,
    sync_policy,
)
from examples.run_dir import logged_elapsed_s, save_train_state
from rollout import RolloutBatch


def split_devices(tp_size: int) -> tuple[list, list]:
    """(trainer devices, engine devices): the first and second half of the local devices."""
    devices = jax.local_devices()
    half = len(devices) // 2
    if half < 1 or half % tp_size:
        raise UsageError(
            f"async_rollout puts the trainer and the engines on separate halves of the local devices: "
            f"{len(devices)} device(s) cannot give the engines a multiple of tp_size {tp_size} "
            "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=4)"
        )
    return devices[:half], devices[half:]


def run_async(config: RLConfig, make_algorithm: Callable[[RLConfig, Policy], Algorithm]) -> dict:
    """:func:`examples.rl_loop.run` with rollouts generated one step ahead (see the module doc).
    It starts as that loop does (:func:`examples.rl_loop.set_up`: the output dir's claim, every
    preset's model family, resume), the engines and the trainer on separate devices."""
    if config.tis_cap is None:  # GRPOConfig refuses it with its flags; a config given here may not
        raise UsageError("async_rollout trains on tokens of older weights: set tis_cap")
    with set_up(config, make_algorithm, split_devices) as setup:
        return _train_async(config, setup) if setup else recorded_summary(config, make_algorithm)


def _train_async(config: RLConfig, setup: Setup) -> dict:
    output_dir, worker, algorithm, manager, state, task, trainer_devices = setup
    mesh = Mesh(np.array(trainer_devices), ("data",))
    rows = config.prompts_per_step * config.samples_per_prompt
    # Rows split over the trainer's devices when they divide evenly.
    batch_sharding = NamedSharding(mesh, PartitionSpec("data" if rows % mesh.size == 0 else None))
    # The engines hold copies on their own devices: the update may donate the trainer's params.
    # Versioned by step, as the synchronous loop's: the weights it would generate step s + 1 with
    # are version s + 1 (a resume goes on with the versions of the uninterrupted run).
    sync_policy(worker, algorithm, state.trees, version=state.step + 1)
    trainer_version = worker.weight_version

    def generate(step):
        # The prompts and the call seed of ``step`` are the synchronous loop's (fixed by (seed, step)).
        problems = task.sample(config.prompts_per_step, step)
        return problems, worker.generate(
            [p.prompt for p in problems],
            n=config.samples_per_prompt,
            temperature=config.temperature,
            max_new_tokens=config.max_new_tokens,
            pad_prompts_to=config.max_prompt_tokens,
            return_logprobs=True,
            return_routing=config.routing_replay,
            seed=step_seed(config.seed, step),
        )

    history = []
    start = time.perf_counter()
    # elapsed_s is the run's wall clock, as the synchronous loop's: a resume counts on.
    run_start = start - logged_elapsed_s(output_dir / "metrics.jsonl")
    with (
        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout") as pool,
        step_log(config, output_dir, algorithm, state.step) as log,
    ):
        ahead = pool.submit(generate, state.step)
        while state.step < config.steps:
            step_start = time.perf_counter()
            problems, batch = ahead.result()
            generate_s = time.perf_counter() - step_start
            if state.step + 1 < config.steps:  # the next rollout runs during this update
                ahead = pool.submit(generate, state.step + 1)
            rewards = np.array(
                [
                    task.reward_fn(text, problems[i].answer)
                    for text, i in zip(batch.completion_texts, batch.prompt_index)
                ],
                dtype=np.float32,
            )
            arrays = {name: jax.device_put(getattr(batch, name), batch_sharding) for name in rollout_arrays(config)}
            start_train = time.perf_counter()
            state.trees, stats = algorithm.update(state.trees, Rollout(problems, batch, rewards, arrays, state.step))
            stats = {k: float(v) for k, v in stats.items()}
            train_s = time.perf_counter() - start_train
            start_sync = time.perf_counter()
            report = sync_policy(worker, algorithm, state.trees, in_flight=True, version=state.step + 2)
            sync_s = time.perf_counter() - start_sync
            record = {
                "step": state.step + 1,
                **rollout_metrics(batch, rewards),
                **staleness(batch, trainer_version),
                "bytes_copied": report.bytes_copied,
                "sync_s": sync_s,
                "generate_s": generate_s,
                "train_s": train_s,
                "step_s": time.perf_counter() - step_start,
                "elapsed_s": time.perf_counter() - run_start,
                **stats,
            }
            trainer_version = report.version
            state.step += 1
            history.append(record)
            log(record)
            if state.step % config.checkpoint_every == 0 or state.step == config.steps:
                save_train_state(manager, state)
        manager.wait_until_finished()
    return summarize(config, output_dir, history, algorithm, wall_s=time.perf_counter() - start)


def staleness(batch: RolloutBatch, trainer_version: int) -> dict[str, float]:
    """How far behind the policy being updated (``trainer_version``) the rollout's tokens are:
    the mean version lag per completion token, and the fraction of rows sampled by more than
    one version (a swap landed while they ran)."""
    mask = batch.completion_mask
    versions = batch.token_versions
    lag = (trainer_version - versions)[mask]
    low = np.where(mask, versions, np.iinfo(np.int64).max).min(axis=1)
    high = np.where(mask, versions, -1).max(axis=1)
    return {"version_lag": float(lag.mean()) if lag.size else 0.0, "mixed_rows": float((high > low).mean())}
