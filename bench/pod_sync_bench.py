"""sync_params across processes, on a random Qwen2.5-1.5B-shaped model (bfloat16).

    JAX_PLATFORMS=cpu python -m bench.pod_sync_bench [--layers 4] [--repeats 3]

Two runs of the same two engines (one device each), launched here: (1) one process with both
engines, (2) two processes (``jax.distributed``, gloo collectives) with one engine each. Each
run syncs (a) a tree placed by ``param_shardings()`` (zero bytes) and (b) the trainer's FSDP
tree (leading axis split over the two devices): in one process each engine gathers its copy,
across processes one collective reshard does. Prints bytes per process and median seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

RESULT_PREFIX = "POD_SYNC_RESULT "


def measure(model_dir: str, repeats: int) -> None:
    """One process of a run: prints its figures as one JSON line."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import ml_dtypes
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from bench.common import median_seconds
    from rollout import RolloutWorker, WorkerConfig
    from rollout.launch import join
    from trainer_bridge import flatten_params, load_hf_params, unflatten_params

    join()
    local = tuple(jax.local_devices())
    config = WorkerConfig(
        model_path=model_dir,
        dtype="bfloat16",
        load_format="dummy",
        max_total_tokens=256,
        context_length=256,
        max_running_requests=4,
        max_prefill_tokens=256,
        chunked_prefill_size=256,
        dp_size=len(local),
        devices=local,
        pod_timeout_s=600.0,
    )

    def global_tree(shardings):
        return unflatten_params(
            {p: jax.make_array_from_callback(x.shape, shardings[p], lambda i, x=x: x[i]) for p, x in host.items()}
        )

    figures = {"process": jax.process_index(), "processes": jax.process_count(), "engines_here": len(local)}
    with RolloutWorker(config) as worker:
        # Read after the engines start: their start-up sizes the KV pool from free memory.
        host = flatten_params(load_hf_params(model_dir, dtype=ml_dtypes.bfloat16))
        mesh = Mesh(np.array(jax.devices()), ("fsdp",))
        fsdp_shardings = {
            p: NamedSharding(mesh, P("fsdp") if x.shape[0] % mesh.size == 0 else P()) for p, x in host.items()
        }
        for name, shardings in (("placed", flatten_params(worker.param_shardings())), ("fsdp", fsdp_shardings)):
            tree = global_tree(shardings)
            report = worker.sync_params(tree, check_finite=False)  # compiles the plan
            seconds = median_seconds(lambda tree=tree: worker.sync_params(tree, check_finite=False), repeats)
            figures[name] = {
                "bytes_gathered": report.bytes_gathered,
                "bytes_copied": report.bytes_copied,
                "seconds": seconds,
            }
            del tree
    figures["tree_bytes"] = sum(x.nbytes for x in host.values())
    print(RESULT_PREFIX + json.dumps(figures), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # a launched process: the model dir
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.repeats)
        return
    from bench.common import gib, qwen25_15b_dir
    from rollout.launch import launch_local

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = qwen25_15b_dir(Path(tmp), args.layers)
        print(f"model: Qwen2.5-1.5B shape with {args.layers} of 28 layers, bfloat16; two engines on one device each")
        argv = ["-m", "bench.pod_sync_bench", "--measure", str(model_dir), "--repeats", str(args.repeats)]
        runs = {}
        for processes, devices in ((1, 2), (2, 1)):
            results = launch_local(
                argv, processes, devices_per_process=devices, timeout_s=1800, env={"JAX_PLATFORMS": "cpu"}
            )
            lines = [line for r in results for line in r.log.splitlines() if line.startswith(RESULT_PREFIX)]
            if len(lines) != processes:
                sys.exit("a bench process failed:\n" + "\n".join(r.log[-3000:] for r in results))
            runs[processes] = [json.loads(line[len(RESULT_PREFIX) :]) for line in lines]
            print(f"{processes} process(es): {runs[processes]}", flush=True)
    print(f"tree: {gib(runs[1][0]['tree_bytes'])}")
    print(f"{'run':<34} {'tree':<7} {'bytes per process (gathered + copied)':>40} {'seconds':>9}")
    for processes, per_process in runs.items():
        label = "1 process x 2 engines" if processes == 1 else "2 processes x 1 engine (jax.distributed)"
        for kind in ("placed", "fsdp"):
            moved = [gib(p[kind]["bytes_gathered"] + p[kind]["bytes_copied"]) for p in per_process]
            seconds = max(p[kind]["seconds"] for p in per_process)
            print(f"{label:<34} {kind:<7} {', '.join(moved):>40} {seconds:>9.3f}")
    ratio = max(p["fsdp"]["seconds"] for p in runs[2]) / runs[1][0]["fsdp"]["seconds"]
    print(f"fsdp sync, 2 processes / 1 process: {ratio:.2f}x")


if __name__ == "__main__":
    main()
