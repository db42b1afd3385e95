"""Checkpoint hot-load on a Qwen2.5-1.5B-shaped model: orbax restore straight into the engine
vs restoring to host and syncing.

    JAX_PLATFORMS=cpu python -m bench.checkpoint_bench [--layers 4]

Both paths read the same orbax checkpoint (saved from a float32 trainer tree) into a float32
engine. ``worker.load_checkpoint`` restores each leaf with the sharding (and dtype) it will have
in the engine, so the sync aliases it; the baseline restores the tree as numpy arrays on the
host and hands them to ``sync_params``, which must copy every leaf to the device.
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
import orbax.checkpoint as ocp

from bench.common import PeakRss, gib, qwen25_15b_dir
from rollout import RolloutWorker, WorkerConfig
from trainer_bridge import load_hf_params


@dataclasses.dataclass(frozen=True)
class CheckpointBenchConfig:
    layers: int = 4
    repeats: int = 3


def restore_to_host(path: Path):
    checkpointer = ocp.StandardCheckpointer()
    metadata = checkpointer.metadata(path)
    tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
    target = jax.tree_util.tree_map(lambda m: np.empty(m.shape, m.dtype), dict(tree))
    restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    return ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))


def main(config: CheckpointBenchConfig) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = qwen25_15b_dir(Path(tmp) / "model", config.layers)
        params = load_hf_params(model_dir)
        total = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(Path(tmp) / "ckpt", params)
        checkpointer.wait_until_finished()
        del params
        path = Path(tmp) / "ckpt"
        worker_config = WorkerConfig(
            model_path=str(model_dir),
            dtype="float32",
            load_format="dummy",
            max_total_tokens=256,
            context_length=256,
            max_running_requests=4,
            max_prefill_tokens=256,
            chunked_prefill_size=256,
        )
        with RolloutWorker(worker_config) as worker:
            worker.load_checkpoint(path)
            direct, host = [], []
            for _ in range(config.repeats):
                with PeakRss() as mem_direct:
                    start = time.perf_counter()
                    report = worker.load_checkpoint(path)
                    direct.append(time.perf_counter() - start)
                with PeakRss() as mem_host:
                    start = time.perf_counter()
                    host_report = worker.sync_params(restore_to_host(path), check_finite=False)
                    host.append(time.perf_counter() - start)
            expected = worker.generate([[1, 2, 3]], temperature=0.0, max_new_tokens=8).completions
            worker.load_checkpoint(path)
            assert worker.generate([[1, 2, 3]], temperature=0.0, max_new_tokens=8).completions == expected

    direct_s, host_s = statistics.median(direct), statistics.median(host)
    print(f"Qwen2.5-1.5B shape, {config.layers} of 28 layers: checkpoint {gib(total)} float32")
    print(f"{'path':44s} {'seconds':>9s} {'synced by copy':>15s} {'peak extra RSS':>15s}")
    print(
        f"{'load_checkpoint (restore into engine layout)':44s} {direct_s:9.3f} {gib(report.bytes_copied):>15s} "
        f"{gib(max(0, mem_direct.extra_bytes)):>15s}"
    )
    print(
        f"{'restore to host, then sync_params':44s} {host_s:9.3f} {gib(host_report.bytes_copied):>15s} "
        f"{gib(max(0, mem_host.extra_bytes)):>15s}"
    )
    print(
        f"load_checkpoint: {host_s / direct_s:.2f}x faster; aliased {report.leaves_aliased} of "
        f"{report.leaves_aliased + report.leaves_copied} leaves"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=CheckpointBenchConfig.layers)
    parser.add_argument("--repeats", type=int, default=CheckpointBenchConfig.repeats)
    args = parser.parse_args()
    main(CheckpointBenchConfig(layers=args.layers, repeats=args.repeats))
