"""A LoRA sync (adapters merged on device at sync) against a full sync of the same tree.

    JAX_PLATFORMS=cpu python -m bench.lora_sync_bench [--layers 4] [--ranks 16,64] [--repeats 5]

A random Qwen2.5-1.5B-shaped model (some of its layers), a float32 engine and a float32 base
tree placed by ``param_shardings()``; adapters on every attention and MLP projection. Measured
in one run: (a) the full sync of the base alone (every leaf aliased: the fixed cost of a sync),
(b) for each rank, ``sync_params(base, adapters=..., lora=...)``: the merge writes every adapted
kernel anew (kernel + (alpha/r) A @ B) and the engine takes those buffers, (c) one memory pass
over the adapted kernels (a jitted ``x + 1`` of each: read once, written once), the bound of
(b)'s merge. Bytes: the adapters' (what a trainer's update changes) and the adapted kernels'
(what the merge reads and writes). Peak RSS above the level before the timed syncs.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import jax
import numpy as np

from bench.common import PeakRss, gib, median_seconds, shaped_model_dir
from bench.sync_bench import worker_config
from rollout import RolloutWorker
from trainer_bridge import DEFAULT_TARGET_MODULES, LoraConfig, flatten_params, load_hf_params, unflatten_params


@dataclasses.dataclass(frozen=True)
class LoraSyncBenchConfig:
    layers: int = 4
    ranks: tuple[int, ...] = (16, 64)
    repeats: int = 5


def adapters_for(flat: dict, rank: int, shardings: dict) -> dict:
    rng = np.random.default_rng(rank)
    adapters = {}
    for path, leaf in flat.items():
        if path.endswith(".kernel") and path.rsplit(".", 2)[-2] in DEFAULT_TARGET_MODULES:
            module, (in_dim, out_dim) = path.removesuffix(".kernel"), leaf.shape
            adapters[f"{module}.lora_a"] = rng.normal(size=(in_dim, rank)).astype(np.float32) * 0.01
            adapters[f"{module}.lora_b"] = rng.normal(size=(rank, out_dim)).astype(np.float32) * 0.01
    # On one device of the trainer's; the merge puts them beside their kernels.
    device = next(iter(shardings.values())).mesh.devices.flat[0]
    return {path: jax.device_put(leaf, device) for path, leaf in adapters.items()}


def main(config: LoraSyncBenchConfig) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shaped_model_dir(Path(tmp), "qwen2.5-1.5b", config.layers)
        flat = flatten_params(load_hf_params(model_dir))
        with RolloutWorker(worker_config(model_dir, "float32")) as worker:
            shardings = flatten_params(worker.param_shardings())
            base = {path: jax.device_put(leaf, shardings[path]) for path, leaf in flat.items()}
            tree = unflatten_params(base)
            total = sum(x.nbytes for x in base.values())
            print(
                f"Qwen2.5-1.5B shape, {config.layers} layers, float32 base {gib(total)}, "
                f"JAX {jax.__version__} on {jax.devices()[0].device_kind}"
            )
            worker.sync_params(tree, check_finite=False)
            full_s = median_seconds(lambda: worker.sync_params(tree, check_finite=False), config.repeats)
            print(f"  full sync of the base (every leaf aliased): {full_s * 1e3:.1f} ms")
            bump = jax.jit(lambda xs: [x + 1 for x in xs])
            for rank in config.ranks:
                lora = LoraConfig(rank=rank, alpha=2.0 * rank)
                adapters = adapters_for(flat, rank, shardings)
                adapted = [base[path.removesuffix(".lora_a") + ".kernel"] for path in adapters if path.endswith("_a")]
                nested = unflatten_params(adapters)

                def lora_sync():
                    return worker.sync_params(tree, adapters=nested, lora=lora, check_finite=False)

                lora_sync()
                with PeakRss() as rss:
                    lora_s = median_seconds(lora_sync, config.repeats)
                jax.block_until_ready(bump(adapted))
                pass_s = median_seconds(lambda: jax.block_until_ready(bump(adapted)), config.repeats)
                adapter_bytes = sum(x.nbytes for x in adapters.values())
                kernel_bytes = sum(x.nbytes for x in adapted)
                print(
                    f"  rank {rank}: adapters {gib(adapter_bytes)} ({adapter_bytes / total:.1%} of the base), "
                    f"adapted kernels {gib(kernel_bytes)}; LoRA sync {lora_s * 1e3:.1f} ms "
                    f"(x{lora_s / full_s:.1f} the full sync; one pass over the adapted kernels "
                    f"{pass_s * 1e3:.1f} ms: the sync is x{lora_s / (pass_s + full_s):.2f} that pass plus the "
                    f"full sync's fixed cost); peak RSS +{gib(rss.extra_bytes)}"
                )


def parse_args() -> LoraSyncBenchConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = LoraSyncBenchConfig()
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--ranks", default=",".join(map(str, d.ranks)))
    parser.add_argument("--repeats", type=int, default=d.repeats)
    args = parser.parse_args()
    return LoraSyncBenchConfig(
        layers=args.layers, ranks=tuple(int(r) for r in args.ranks.split(",")), repeats=args.repeats
    )


if __name__ == "__main__":
    main(parse_args())
