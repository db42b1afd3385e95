"""Several engines in one process: throughput of dp_size=4 x tp_size=1 against one tp_size=4
engine and one tp_size=1 engine, on the same batch and the same 4 devices; sync per engine.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m bench.dp_bench

On the CPU backend the 4 devices are fake and share the machine's cores, so the figures say
what the pool costs and whether its engines overlap, not what a TPU host gains.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax

from models import TinyModelSpec, write_tiny_model
from rollout import RolloutWorker, WorkerConfig
from trainer_bridge import load_hf_params


def run(model_dir: Path, params, *, dp_size: int, tp_size: int, devices, prompts, kwargs) -> dict:
    config = WorkerConfig(
        model_path=str(model_dir),
        dtype="float32",
        load_format="dummy",
        max_total_tokens=8192,
        context_length=512,
        max_running_requests=64,
        max_prefill_tokens=2048,
        chunked_prefill_size=2048,
        dp_size=dp_size,
        tp_size=tp_size,
        devices=tuple(devices),
    )
    with RolloutWorker(config) as worker:
        tree = jax.device_put(params, worker.param_shardings())
        worker.sync_params(tree, check_finite=False)
        sync = worker.sync_params(tree, check_finite=False)
        for _ in range(2):  # compile the padding buckets first (batches vary with timing)
            worker.generate(prompts, **kwargs)
        start = time.perf_counter()
        batch = worker.generate(prompts, **kwargs)
        seconds = time.perf_counter() - start
        tokens = int(batch.completion_lengths.sum())
        busy = [engine.busy_intervals() for engine in worker.engines]
    per_engine = sync.per_engine or (sync,)
    return {
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "tokens": tokens,
        "sync_ms": sync.seconds * 1e3,
        "sync_bytes_per_engine": [r.bytes_copied for r in per_engine],
        "engines_overlapping": _overlapping(busy),
        "compiles": batch.compiles,  # during the timed call: continuous batching can meet a new bucket
    }


def _overlapping(busy) -> bool:
    return any(s1 < e2 and s2 < e1 for i, a in enumerate(busy) for b in busy[i + 1 :] for s1, e1 in a for s2, e2 in b)


def main(prompts_count: int, new_tokens: int) -> None:
    devices = jax.devices()
    if len(devices) < 4:
        raise SystemExit("needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4")
    devices = devices[:4]
    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(
            num_hidden_layers=4,
            hidden_size=512,
            intermediate_size=1536,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=2048,
        )
        model_dir = write_tiny_model(Path(tmp), spec, with_tokenizer=False)
        params = load_hf_params(model_dir)
        prompts = [[(13 * i + j) % 2000 + 1 for j in range(32 + i % 16)] for i in range(prompts_count)]
        kwargs = dict(n=4, temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
        rows = {
            "dp=4 x tp=1": run(
                model_dir, params, dp_size=4, tp_size=1, devices=devices, prompts=prompts, kwargs=kwargs
            ),
            "dp=1 x tp=4": run(
                model_dir, params, dp_size=1, tp_size=4, devices=devices, prompts=prompts, kwargs=kwargs
            ),
            "dp=1 x tp=1": run(
                model_dir, params, dp_size=1, tp_size=1, devices=devices[:1], prompts=prompts, kwargs=kwargs
            ),
        }
    base = rows["dp=1 x tp=1"]["tokens_per_s"]
    print(f"{prompts_count} prompts x n=4 x {new_tokens} new tokens, 4-layer model (hidden 512), float32")
    print(
        f"{'layout':14s} {'tokens/s':>10s} {'vs tp=1':>8s} {'sync ms':>8s} "
        f"{'sync bytes per engine':>24s} overlap compiles"
    )
    for name, row in rows.items():
        print(
            f"{name:14s} {row['tokens_per_s']:10.1f} {row['tokens_per_s'] / base:7.2f}x {row['sync_ms']:8.2f} "
            f"{str(row['sync_bytes_per_engine']):>24s} {row['engines_overlapping']!s:>7s} {row['compiles']}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    main(args.prompts, args.new_tokens)
