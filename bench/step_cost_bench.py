"""The fixed cost of a decode step: what a step costs when the model's math is nearly free.

    python -m bench.step_cost_bench [--rows 64] [--new-tokens 256] [--repeats 3] [--decode-steps 1 16] [--ops 12]

A model of hidden 64, 2 layers, 2 heads, 1 KV head, head_dim 16, float32 (its forward is a few
microseconds of arithmetic), ``rows`` rows of 14-token prompts (16 prompts x n=4 at 64 rows),
temperature 1, ``ignore_eos``. The fixed cost of a step is the time of a ``new_tokens + 1``-token
call minus that of a 1-token call (the prefill, the call's own overhead), over ``new_tokens``
steps: the host's scheduling, the forward's dispatch and the sampler's, which no faster chip
removes. Median of ``repeats`` pairs after a warm-up pair; then the engine's own split of the
steps of one more long call (``rollout.engine.profile_steps``: forward, sampler, host); then
the same pairs with the device stubbed (``rollout.engine.stubbed_device``: each decode forward,
sampler and chunk returns the outputs of its first call of that shape, not dispatched), whose
fixed cost is the host's work around the device's: a lower bound on the share of a step to
project onto a faster chip. Each
``--decode-steps`` value is a worker of its own (``WorkerConfig.decode_steps``: decode steps per
dispatch), measured in this run one after another; the first is the baseline of the ratios.
``--ops N`` traces one more pair (``bench.op_profile``) and prints the N operations of the largest
self time per decode step (the long call's less the short one's, over ``new_tokens`` steps, as
the fixed cost is taken): fusions, dots and loops by program and HLO name, and the thunk
executor's own work between them; CPU time summed over XLA's threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench.op_profile import traced_ops
from models import TinyModelSpec, write_tiny_model
from rollout import RolloutWorker, WorkerConfig
from rollout.engine import profile_steps, stubbed_device

NEARLY_FREE = TinyModelSpec(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)
PROMPT_TOKENS = 14
N = 4


@dataclasses.dataclass(frozen=True)
class StepCostConfig:
    rows: int = 64
    new_tokens: int = 256
    repeats: int = 3
    decode_steps: tuple[int, ...] = (1, 16)
    ops: int = 0  # operations to list from a traced pair of calls (0: no trace)


def timed_call(worker: RolloutWorker, rows: int, new_tokens: int, seed: int) -> float:
    prompts = np.random.default_rng(seed).integers(1, NEARLY_FREE.vocab_size, (rows // N, PROMPT_TOKENS)).tolist()
    start = time.perf_counter()
    out = worker.generate(prompts, n=N, temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=seed)
    seconds = time.perf_counter() - start
    assert int(out.completion_mask.sum()) == rows * new_tokens
    return seconds


def timed_pairs(worker: RolloutWorker, config: StepCostConfig, seeds) -> tuple[list[float], list[float]]:
    """``repeats`` pairs of a long and a 1-token call after a warm-up pair: their seconds."""
    long_calls, short_calls = [], []
    for i in range(config.repeats + 1):
        long_s = timed_call(worker, config.rows, config.new_tokens + 1, next(seeds))
        short_s = timed_call(worker, config.rows, 1, next(seeds))
        if i:
            long_calls.append(long_s)
            short_calls.append(short_s)
    return long_calls, short_calls


def per_step(config: StepCostConfig, long_calls: list[float], short_calls: list[float]) -> list[float]:
    return [(lo - sh) / config.new_tokens for lo, sh in zip(long_calls, short_calls)]


def measure(config: StepCostConfig, decode_steps: int) -> dict:
    if config.rows % N:
        raise ValueError(f"--rows must be a multiple of n={N}, got {config.rows}")
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_tiny_model(Path(tmp), NEARLY_FREE, with_tokenizer=False)
        worker_config = WorkerConfig(
            model_path=str(directory),
            dtype="float32",
            max_total_tokens=4 * config.rows * (PROMPT_TOKENS + config.new_tokens + 1),
            context_length=PROMPT_TOKENS + config.new_tokens + 8,
            max_running_requests=config.rows,
            precompile=True,
            precompile_bs_paddings=(config.rows,),
            decode_steps=decode_steps,
        )
        with RolloutWorker(worker_config) as worker:
            seeds = iter(range(10**6))
            long_calls, short_calls = timed_pairs(worker, config, seeds)
            with profile_steps() as times:
                timed_call(worker, config.rows, config.new_tokens + 1, next(seeds))
            chunks = worker.engine.decode_chunk_stats
            ops = None
            if config.ops:
                with traced_ops() as long_ops:
                    timed_call(worker, config.rows, config.new_tokens + 1, next(seeds))
                with traced_ops() as short_ops:
                    timed_call(worker, config.rows, 1, next(seeds))
                ops = long_ops.minus(short_ops)
            with stubbed_device():
                host_long, host_short = timed_pairs(worker, config, seeds)
    steps = per_step(config, long_calls, short_calls)
    host_steps = per_step(config, host_long, host_short)
    split = times.split("decode")
    return {
        "step_s": statistics.median(steps),
        "steps_s": steps,
        "long_s": statistics.median(long_calls),
        "short_s": statistics.median(short_calls),
        "host_step_s": statistics.median(host_steps),
        "host_steps_s": host_steps,
        "split": None if split is None else dataclasses.asdict(split) | {"host_s": split.host_s},
        "chunks": None if chunks is None else dataclasses.asdict(chunks),
        "ops": None
        if ops is None
        else {
            "self_s_per_step": ops.total_s / config.new_tokens,
            "top": [(name, s / config.new_tokens, n) for name, s, n in ops.top(config.ops)],
        },
    }


def main(config: StepCostConfig) -> None:
    print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; load average {os.getloadavg()}")
    results = {k: measure(config, k) for k in config.decode_steps}
    print(json.dumps(results))
    base = results[config.decode_steps[0]]["step_s"]
    for k, r in results.items():
        print(
            f"{config.rows} rows, a nearly free model, decode_steps={k}: fixed cost of a decode step "
            f"{r['step_s'] * 1e3:.2f} ms (x{r['step_s'] / base:.2f} decode_steps={config.decode_steps[0]}; each pair: "
            f"{', '.join(f'{s * 1e3:.2f}' for s in r['steps_s'])} ms; {config.new_tokens + 1}-token call "
            f"{r['long_s']:.3f} s, 1-token call {r['short_s']:.3f} s)"
        )
        print(
            f"  the device stubbed (each decode forward, sampler and chunk returns its first output of that "
            f"shape): the host's cost per step {r['host_step_s'] * 1e3:.2f} ms (each pair: "
            f"{', '.join(f'{s * 1e3:.2f}' for s in r['host_steps_s'])} ms)"
        )
        if r["split"]:
            s = r["split"]
            print(
                f"  engine profile per decode step ({s['steps']} steps): {s['wall_s'] * 1e3:.2f} ms = forward "
                f"{s['forward_s'] * 1e3:.2f} + sampler {s['sample_s'] * 1e3:.2f} + host {s['host_s'] * 1e3:.2f} ms"
                + (" (a chunk's forwards and sampling are one loop: both under forward)" if k > 1 else "")
            )
        if r["ops"]:
            print(
                f"  a traced pair's operations, self time per decode step (in all "
                f"{r['ops']['self_s_per_step'] * 1e3:.2f} ms, summed over threads):"
            )
            for name, seconds, count in r["ops"]["top"]:
                print(f"    {seconds * 1e3:6.3f} ms  {count / config.new_tokens:5.1f} x  {name}")


def parse_args() -> StepCostConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = StepCostConfig()
    parser.add_argument("--rows", type=int, default=d.rows)
    parser.add_argument("--new-tokens", type=int, default=d.new_tokens)
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--decode-steps", type=int, nargs="+", default=list(d.decode_steps))
    parser.add_argument("--ops", type=int, default=d.ops, help="operations to list from a traced pair (0: none)")
    args = parser.parse_args()
    return StepCostConfig(
        rows=args.rows,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        decode_steps=tuple(args.decode_steps),
        ops=args.ops,
    )


if __name__ == "__main__":
    main(parse_args())
