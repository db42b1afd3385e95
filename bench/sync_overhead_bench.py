"""The fixed cost of a sync: an aliasable sync against swapping the engine's own leaves back in.

    JAX_PLATFORMS=cpu python -m bench.sync_overhead_bench [--layers 28] [--profile]

A narrow model with Qwen2.5-1.5B's leaf count (28 layers: 338 leaves) makes the per-leaf
bookkeeping, not the bytes, the cost. Measured in one run: (a) ``sync_params`` of a tree placed
with ``param_shardings()`` (0 bytes move), (b) the floor: the engine's current leaf list swapped
back in on its scheduler thread plus the prefix-cache flush that every sync does.
``--profile`` prints where (a) spends its time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
from pathlib import Path

import jax

from bench.common import median_seconds
from models import TinyModelSpec, write_tiny_model
from rollout import RolloutWorker, WorkerConfig
from trainer_bridge import load_hf_params


def main(layers: int, repeats: int, profile: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(num_hidden_layers=layers, hidden_size=128, intermediate_size=256, num_attention_heads=1)
        model_dir = write_tiny_model(Path(tmp), spec, with_tokenizer=False)
        config = WorkerConfig(
            model_path=str(model_dir),
            dtype="float32",
            load_format="dummy",
            max_total_tokens=256,
            context_length=256,
            max_running_requests=4,
            max_prefill_tokens=256,
            chunked_prefill_size=256,
            devices=tuple(jax.local_devices()[:1]),
        )
        with RolloutWorker(config) as worker:
            tree = jax.device_put(load_hf_params(model_dir), worker.param_shardings())
            report = worker.sync_params(tree)
            engine = worker.engine
            leaves = engine.weight_leaves()

            def swap_back():
                engine.replace_weight_leaves(leaves)

            # The bookkeeping alone: the finite check (on by default) is a read of every weight.
            sync_s = median_seconds(lambda: worker.sync_params(tree, check_finite=False), repeats)
            floor_s = median_seconds(swap_back, repeats)
            print(
                f"{len(worker.leaves)} engine leaves, {report.leaves_aliased} aliased, "
                f"{report.bytes_copied} bytes copied"
            )
            print(f"aliasable sync_params      {sync_s * 1e3:8.2f} ms")
            print(f"swap own leaves back in    {floor_s * 1e3:8.2f} ms")
            print(f"ratio                      {sync_s / floor_s:8.2f}x (target <= 2x)")
            if profile:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(repeats):
                    worker.sync_params(tree, check_finite=False)
                profiler.disable()
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    main(args.layers, args.repeats, args.profile)
