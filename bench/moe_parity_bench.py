"""Engine against trainer on the tiny Qwen3-MoE (8 experts, top-2, one dense layer): greedy
tokens and the log-prob mismatch of sampled tokens, float32 and bfloat16 engines, tp 1 and 2,
with the trainer routing by its own top-k and replaying the engine's (rollout routing replay);
then what recording the routing costs.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python -m bench.moe_parity_bench [--part cost]

The trainer is the float32 Flax model (``models/qwen3_moe_flax.py``) on the HF weights; each
engine starts with dummy weights and gets them by ``sync_params``. Mismatch over 8 prompts x
n=4 x 6 tokens sampled at temperature 1 (192 tokens), as docs/benchmarks.md's table for Qwen2/Qwen3.
Two routers: the tiny model's (logits spread 3 / sqrt(hidden)) and one 10x narrower, whose
near-ties bfloat16 rounding flips. "routing differs": the fraction of routed tokens whose
trainer top-k (float32, own routing) is not the engine's recorded one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench.common import tiny_worker_config
from models import TinyMoeSpec, flax_model_for, greedy_decode, router_choices, write_tiny_model
from rollout import RolloutWorker
from trainer_bridge import load_hf_params

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11], [1], [64, 65, 66], [300, 2, 4], [9] * 7, [12, 34]]
ROUTERS = {"wide": 3.0, "near-tie": 0.3}


def parity(router: str, model_dir: Path) -> None:
    params = load_hf_params(model_dir)
    model = flax_model_for(json.loads((model_dir / "config.json").read_text()))
    reference = greedy_decode(model, params, PROMPTS, 16)
    for dtype in ("float32", "bfloat16"):
        for tp in (1, 2):
            with RolloutWorker(tiny_worker_config(model_dir, dtype, tp, record_routing=True)) as worker:
                worker.sync_params(params)
                greedy = worker.generate(PROMPTS, temperature=0.0, max_new_tokens=16, ignore_eos=True).completions
                equal = sum(a == b for g, r in zip(greedy, reference) for a, b in zip(g, r))
                check = dict(n=4, max_new_tokens=6, atol=10.0, seed=0)
                own = worker.check_consistency(params, PROMPTS, **check)
                replayed = worker.check_consistency(params, PROMPTS, routing_replay=True, **check)
                batch = worker.generate(PROMPTS, n=4, max_new_tokens=6, seed=0, return_routing=True)
            trainer = np.sort(np.asarray(router_choices(model, params, batch.tokens, batch.attention_mask)), -1)
            engine = np.sort(batch.routed_experts, -1)
            routed = engine[..., 0, 0] >= 0
            differs = np.any(engine != trainer, axis=(-2, -1))[routed].mean()
            print(
                f"{router:9s} {dtype + ' tp=' + str(tp):15s} {f'{equal}/{16 * len(PROMPTS)}':>8s} "
                f"{differs:9.3f} {own.mean_abs_diff:10.2e} {own.max_abs_diff:9.2e} {own.kl:9.1e} "
                f"{replayed.mean_abs_diff:10.2e} {replayed.max_abs_diff:9.2e} {replayed.kl:9.1e}"
            )


def recording_cost(model_dir: Path, repeats: int = 7) -> None:
    """Generate time with and without recording: two engines with the same settings (devices 0
    and 1), called in turn so that both see the same machine load; 32 rows x 64 tokens. Also the
    bytes each routed token costs, and the host table's size after the runs."""
    params = load_hf_params(model_dir)
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(32)]
    sampling = dict(max_new_tokens=64, ignore_eos=True, seed=0)
    configs = {
        record: tiny_worker_config(
            model_dir, "float32", 1, record_routing=record, devices=(jax.devices()[int(record)],)
        )
        for record in (False, True)
    }
    with RolloutWorker(configs[False]) as off, RolloutWorker(configs[True]) as on:
        workers = {False: off, True: on}
        times = {False: [], True: []}
        for worker in workers.values():
            worker.sync_params(params)
        for repeat in range(repeats + 1):  # the first compiles
            for record, worker in workers.items():
                start = time.perf_counter()
                batch = worker.generate(prompts, return_routing=record, **sampling)
                if repeat:
                    times[record].append(time.perf_counter() - start)
        tokens = int(batch.completion_mask.sum())
        for record, worker in workers.items():
            seconds = statistics.median(times[record])
            per_token = f"{batch.routed_experts[0, 0].nbytes} B" if record else "-"
            print(
                f"record_routing={record!s:5s} {seconds:8.3f} s  {tokens / seconds:7.0f} tokens/s  "
                f"per token {per_token:>4s}  host table {worker.engine.routing_table_bytes / 1024:.0f} KiB"
            )
        ratio = statistics.median(times[True]) / statistics.median(times[False])
        print(f"recording costs {ratio - 1:+.1%} of the generate time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "parity", "cost"), default="all")
    part = parser.parse_args().part
    with tempfile.TemporaryDirectory() as tmp:
        if part in ("all", "parity"):
            print_parity(Path(tmp))
        if part in ("all", "cost"):
            wide = write_tiny_model(Path(tmp) / "cost", TinyMoeSpec(router_scale=ROUTERS["wide"]), with_tokenizer=False)
            recording_cost(wide)


def print_parity(tmp: Path) -> None:
    print(
        f"{'router':9s} {'engine':15s} {'greedy':>8s} {'routing':>9s} "
        f"{'own: mean':>10s} {'max':>9s} {'KL':>9s} {'replay: mean':>10s} {'max':>9s} {'KL':>9s}"
    )
    print(f"{'':9s} {'':15s} {'equal':>8s} {'differs':>9s} {'|Δ log p|':>10s} {'':>9s} {'':>9s} {'|Δ log p|':>10s}")
    for router, scale in ROUTERS.items():
        parity(router, write_tiny_model(tmp / router, TinyMoeSpec(router_scale=scale), with_tokenizer=False))
    print()


if __name__ == "__main__":
    main()
