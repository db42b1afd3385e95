"""Cost of engine log-probs, and of one consistency check, on a Qwen2.5-1.5B-shaped model.

    JAX_PLATFORMS=cpu python -m bench.logprobs_bench [--layers 1] [--rows 8] [--new-tokens 8]

Generates the same rollout batch with and without ``return_logprobs`` (interleaved, same run,
same seeds) and prints tokens/s of each and their ratio; then times
``RolloutWorker.check_consistency`` (sample with log-probs + the fp32 Flax trainer's forward)
against one generate of the same prompts, and prints the mismatch it measured (bf16 engine,
fp32 trainer). First, the sampler step alone on [rows, vocab] logits: a plain draw at the
temperature against the engine's draw with its log-prob (models.sampling_log_probs).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench.common import median_seconds, qwen25_15b_dir
from models import sampled_token_log_probs, sampling_log_probs
from rollout import RolloutWorker, WorkerConfig
from trainer_bridge import load_hf_params


@dataclasses.dataclass(frozen=True)
class LogprobsBenchConfig:
    layers: int = 1
    rows: int = 8
    prompt_tokens: int = 16
    new_tokens: int = 8
    check_prompts: int = 4
    dtype: str = "bfloat16"
    repeats: int = 3


def sampler_step(rows: int, vocab: int = 151936, repeats: int = 20) -> None:
    logits = jax.random.normal(jax.random.key(0), (rows, vocab)) * 4.0
    keys = jax.random.split(jax.random.key(1), rows)
    no_filter = (1.0, 2**30, 1.0, 0.0)

    @jax.jit
    def draw(logits):
        return jax.vmap(jax.random.categorical)(keys, logits / no_filter[0])

    @jax.jit
    def draw_with_log_prob(logits):
        tempered, filtered = sampling_log_probs(logits, *no_filter)
        ids = jax.vmap(jax.random.categorical)(keys, filtered)
        return ids, sampled_token_log_probs(tempered, filtered, ids, no_filter[1])

    timings = {}
    for name, fn in (("draw", draw), ("draw + log-prob", draw_with_log_prob)):
        jax.block_until_ready(fn(logits))
        timings[name] = median_seconds(lambda fn=fn: jax.block_until_ready(fn(logits)), repeats)
    print(
        f"sampler step, {rows} x {vocab} logits, temperature 1: draw {timings['draw'] * 1e3:.2f} ms, "
        f"draw + log-prob {timings['draw + log-prob'] * 1e3:.2f} ms "
        f"({timings['draw + log-prob'] / timings['draw']:.2f}x)"
    )


def main(config: LogprobsBenchConfig) -> None:
    sampler_step(config.rows)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 151936, (config.rows, config.prompt_tokens)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = qwen25_15b_dir(Path(tmp), config.layers)
        params = load_hf_params(model_dir)
        worker_config = WorkerConfig(
            model_path=str(model_dir),
            dtype=config.dtype,
            load_format="dummy",
            max_total_tokens=config.rows * (config.prompt_tokens + config.new_tokens) + 256,
            context_length=config.prompt_tokens + config.new_tokens + 8,
            max_running_requests=config.rows,
            max_prefill_tokens=1024,
            chunked_prefill_size=1024,
        )
        with RolloutWorker(worker_config) as worker:
            worker.sync_params(params)
            kwargs = dict(temperature=1.0, max_new_tokens=config.new_tokens, ignore_eos=True, seed=1)
            times = {False: [], True: []}
            for step in range(config.repeats + 1):
                for logprobs in (False, True):
                    start = time.perf_counter()
                    batch = worker.generate(prompts, return_logprobs=logprobs, **kwargs)
                    if step:  # the first round compiles
                        times[logprobs].append(time.perf_counter() - start)
                        assert batch.compiles == 0
            check_prompts = prompts[: config.check_prompts]
            check = dict(max_new_tokens=config.new_tokens, atol=10.0)
            worker.check_consistency(params, check_prompts, **check)  # compiles the trainer forward
            reports = [worker.check_consistency(params, check_prompts, **check) for _ in range(config.repeats)]
            generate_s = statistics.median(
                _timed(lambda: worker.generate(check_prompts, **kwargs)) for _ in range(config.repeats)
            )

    tokens = config.rows * config.new_tokens
    off, on = (tokens / statistics.median(times[flag]) for flag in (False, True))
    check_s = statistics.median(r.seconds for r in reports)
    report = reports[-1]
    print(
        f"Qwen2.5-1.5B shape, {config.layers} of 28 layers, {config.dtype} engine; {config.rows} rows x "
        f"{config.new_tokens} new tokens, temperature 1, median of {config.repeats}"
    )
    print(f"{'generate':36s} {'tokens/s':>10s}")
    print(f"{'  return_logprobs=False':36s} {off:10.1f}")
    print(f"{'  return_logprobs=True':36s} {on:10.1f}")
    print(f"log-probs cost: {on / off:.3f}x the tokens/s without them ({(off / on - 1) * 100:+.1f}% time)")
    print(
        f"check_consistency ({config.check_prompts} prompts x {config.new_tokens} tokens, fp32 trainer): "
        f"{check_s:.3f} s = {check_s / generate_s:.2f}x a generate of the same prompts ({generate_s:.3f} s)"
    )
    print(
        f"  bf16 engine vs fp32 trainer: mean |Δ log p| {report.mean_abs_diff:.4f}, max {report.max_abs_diff:.4f}, "
        f"KL estimate {report.kl:.2e} over {report.tokens} tokens"
    )


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(LogprobsBenchConfig):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default)
    main(LogprobsBenchConfig(**vars(parser.parse_args())))
