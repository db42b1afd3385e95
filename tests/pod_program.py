"""One process of the 2-process test job (``tests/test_pods.py`` launches it with
``rollout.launch.launch_local``): many checks per launch, since a launch costs engine start-ups.

Usage: python -m tests.pod_program MODEL_DIR OUT_DIR. Writes OUT_DIR/<process>.json after each
step (a later step kills process 1), then process 0 leaves with ``rollout.launch.leave``.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from rollout import InvalidRequest, PodError, RolloutWorker  # noqa: E402
from rollout.launch import join, leave  # noqa: E402
from tests.helpers import tiny_worker_config  # noqa: E402
from trainer_bridge import SyncError, flatten_params, load_hf_params, restore_params, unflatten_params  # noqa: E402

# Six global prompts: process p generates prompts[3p : 3p + 3] with prompt_offset=3p.
PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11], [30, 31], [60, 61, 62], [7]]
SAMPLED = dict(n=3, temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=2024)
GREEDY = dict(temperature=0.0, max_new_tokens=8, ignore_eos=True)
# Generous for the SPMD checks (processes drift apart by whole compiles on a loaded machine),
# short once a process is about to be lost, so that the test measures the bound quickly.
POD_TIMEOUT_S = 120.0
LOSS_TIMEOUT_S = 10.0


def global_tree(flat_host: dict, shardings: dict) -> dict:
    """Host arrays as global arrays, each process giving its own devices' slices (what a
    multi-process trainer holds)."""
    return {p: jax.make_array_from_callback(x.shape, shardings[p], lambda i, x=x: x[i]) for p, x in flat_host.items()}


def sync_figures(report) -> dict:
    return {"bytes_copied": report.bytes_copied, "bytes_gathered": report.bytes_gathered, "version": report.version}


def main(model_dir: str, out_dir: str) -> None:
    # JAX terminates the survivors this long after a process stops sending heartbeats: longer
    # than the loss checks below take on a loaded machine.
    join(heartbeat_timeout_s=300)
    me = jax.process_index()
    out = Path(out_dir)
    results: dict = {"process": me, "local_devices": [d.id for d in jax.local_devices()]}

    def save():
        (out / f"{me}.json").write_text(json.dumps(results))

    other = next(d for d in jax.devices() if d.process_index != me)
    try:
        RolloutWorker(tiny_worker_config(model_dir, devices=(other,)))
    except ValueError as exc:
        results["foreign_device_error"] = str(exc)

    # Decode chunks of 4 steps: the one-process worker of tests/test_pods.py decodes a step at a
    # time, and must sample the same tokens.
    worker = RolloutWorker(
        tiny_worker_config(
            model_dir,
            load_format="dummy",
            dp_size=2,
            devices=tuple(jax.local_devices()),
            pod_timeout_s=POD_TIMEOUT_S,
            decode_steps=4,
        )
    )
    host = flatten_params(load_hf_params(model_dir))
    placed_shardings = flatten_params(worker.param_shardings())
    results["mesh_shape"] = dict(next(iter(placed_shardings.values())).mesh.shape)
    placed = global_tree(host, placed_shardings)
    results["placed"] = sync_figures(worker.sync_params(unflatten_params(placed)))

    mine = slice(3 * me, 3 * me + 3)
    results["sampled"] = worker.generate(PROMPTS[mine], prompt_offset=3 * me, **SAMPLED).completions
    results["greedy"] = worker.generate(PROMPTS[mine], **GREEDY).completions
    results["chunk_steps_served"] = sum(engine.decode_chunk_stats.steps_served for engine in worker.engines)
    save()

    # The trainer's FSDP layout over the global mesh: leading axis split over all 4 devices.
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    fsdp_shardings = {p: NamedSharding(mesh, P("fsdp") if x.shape[0] % 4 == 0 else P()) for p, x in host.items()}
    fsdp = global_tree(host, fsdp_shardings)
    start = time.perf_counter()
    results["fsdp"] = {
        **sync_figures(worker.sync_params(unflatten_params(fsdp))),
        "seconds": time.perf_counter() - start,
    }
    results["fsdp_greedy"] = worker.generate(PROMPTS[mine], **GREEDY).completions
    # The Flax recompute runs on this process's rows: over FSDP leaves it was a collective of
    # both processes, each with a batch of its own (one aborted); replicated ones are read here.
    try:
        worker.check_consistency(unflatten_params(fsdp), PROMPTS[mine], max_new_tokens=4)
    except InvalidRequest as exc:
        results["consistency_fsdp"] = str(exc)
    results["consistency_placed"] = worker.check_consistency(
        unflatten_params(placed), PROMPTS[mine], max_new_tokens=4
    ).max_abs_diff
    # Split over each process's own devices, whole on them (param_shardings() with tp > 1).
    per_process = Mesh(np.array(jax.devices()).reshape(2, 2), ("processes", "local"))
    split = {
        p: jax.make_array_from_callback(
            x.shape,
            NamedSharding(per_process, P(None, "local") if x.ndim == 2 and x.shape[1] % 2 == 0 else P()),
            lambda i, x=x: x[i],
        )
        for p, x in host.items()
    }
    results["consistency_split"] = worker.check_consistency(
        unflatten_params(split), PROMPTS[mine], max_new_tokens=4
    ).max_abs_diff
    # The same layout on a mesh whose devices run in another order than jax.devices() (as
    # jax.make_mesh may order a TPU's), the processes' devices swapped.
    swapped = Mesh(np.array(jax.devices()[2:] + jax.devices()[:2]), ("fsdp",))
    results["swapped_fsdp"] = sync_figures(
        worker.sync_params(
            unflatten_params(global_tree(host, {p: s.update(mesh=swapped) for p, s in fsdp_shardings.items()}))
        )
    )
    results["swapped_fsdp_greedy"] = worker.generate(PROMPTS[mine], **GREEDY).completions
    save()

    # An orbax checkpoint written by both processes (each its own shards), loaded by both.
    ckpt = out / "ckpt"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(ckpt, unflatten_params(fsdp))
    checkpointer.wait_until_finished()
    halved = {p: x * 0.5 for p, x in fsdp.items()}
    worker.sync_params(unflatten_params(halved))
    results["halved_greedy"] = worker.generate(PROMPTS[mine], **GREEDY).completions
    results["checkpoint"] = sync_figures(worker.load_checkpoint(ckpt))
    results["checkpoint_greedy"] = worker.generate(PROMPTS[mine], **GREEDY).completions
    resumed = flatten_params(restore_params(ckpt, unflatten_params(fsdp)))
    results["resumed_equal"] = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for p in host
        for a, b in zip(resumed[p].addressable_shards, fsdp[p].addressable_shards)
    )
    save()

    # The SPMD rule: different calls, then the same call with different trees.
    try:
        worker.sync_params(unflatten_params(placed)) if me == 0 else worker.drop_kv()
    except PodError as exc:
        results["disagree_calls"] = {"message": str(exc), "processes": list(exc.processes)}
    short = dict(placed) if me == 0 else {p: x for p, x in placed.items() if not p.endswith("norm.scale")}
    try:
        worker.sync_params(unflatten_params(short))
    except PodError as exc:
        results["disagree_trees"] = {"message": str(exc), "processes": list(exc.processes)}
    results["after_disagreement"] = sync_figures(worker.sync_params(unflatten_params(placed)))
    results["after_disagreement_greedy"] = worker.generate(PROMPTS[mine], **GREEDY).completions
    # A NaN in process 1's part of the tree alone: neither process commits (process 0 did, and
    # the two processes' weight versions stayed apart for good).
    nan_norm = np.full_like(host["model.norm.scale"], np.nan)
    poisoned = {**host, "model.norm.scale": nan_norm} if me == 1 else host
    try:
        worker.sync_params(unflatten_params(global_tree(poisoned, placed_shardings)), check_finite=True)
    except (PodError, SyncError) as exc:
        results["one_process_nan"] = {"error": type(exc).__name__, "message": str(exc)}
        results["one_process_nan"]["processes"] = list(getattr(exc, "processes", ()))
    results["after_one_process_nan"] = sync_figures(worker.sync_params(unflatten_params(placed)))
    save()

    # A process killed inside a sync: after every check, as the collective reshard starts
    # (compiled by the FSDP sync above, so both processes arrive together).
    worker._group.pod.timeout_s = LOSS_TIMEOUT_S
    if me == 1:
        agree = worker._group.pod.agree

        def agree_then_die(call, *args):
            agree(call, *args)
            if call.endswith("(reshard)"):
                os.kill(os.getpid(), signal.SIGKILL)

        worker._group.pod.agree = agree_then_die
    start = time.perf_counter()
    try:
        worker.sync_params(unflatten_params(fsdp))
    except PodError as exc:
        results["killed_mid_sync"] = {
            "message": str(exc),
            "processes": list(exc.processes),
            "seconds": time.perf_counter() - start,
        }
    save()
    # Its generates still run (they are local), and the next weight call names the lost process.
    results["greedy_after_loss"] = worker.generate(PROMPTS[mine], **GREEDY).completions
    start = time.perf_counter()
    try:
        worker.drop_kv()
    except PodError as exc:
        results["next_call_after_loss"] = {
            "message": str(exc),
            "processes": list(exc.processes),
            "seconds": time.perf_counter() - start,
        }
    worker.close()
    results["leaving_at"] = time.monotonic()  # CLOCK_MONOTONIC: the test compares it with its own
    save()
    # The way out after a loss (docs/pods.md): JAX's shutdown barrier would wait for the killed
    # process until the heartbeat timeout, then end this one with status 1.
    leave(0)


if __name__ == "__main__":
    main(*sys.argv[1:3])
