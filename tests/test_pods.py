"""The worker in a multi-process JAX job: 2 processes x 2 CPU devices (gloo collectives),
against one process with the same 4 engines. One launch of ``tests/pod_program.py`` runs
every multi-process check (engine start-ups are the cost); the tests read its results."""

import json
import time

import jax
import pytest

from rollout import RolloutWorker
from rollout.launch import launch_local
from tests import pod_program
from tests.helpers import tiny_worker_config
from tests.test_grpo import run_grpo
from trainer_bridge import load_hf_params

LAUNCH_TIMEOUT_S = 420
# leave() after a loss in a job of 2 ends the survivor at once; this also covers the launcher
# noticing the exit on a loaded machine. JAX's own way out takes the heartbeat timeout (300 s).
LEAVE_BOUND_S = 60


@pytest.fixture(scope="module")
def pod(qwen2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pod")
    # Process 1 is killed on purpose: process 0 goes on (grace_s) until it leaves by itself.
    argv = ["-m", "tests.pod_program", str(qwen2_dir), str(out)]
    runs = launch_local(argv, 2, devices_per_process=2, timeout_s=LAUNCH_TIMEOUT_S, grace_s=LAUNCH_TIMEOUT_S)
    returned_at = time.monotonic()
    logs = "\n".join(f"--- process {r.process_id} ({r.ended}):\n{r.log[-3000:]}" for r in runs)
    results = [json.loads((out / f"{i}.json").read_text()) if (out / f"{i}.json").exists() else {} for i in range(2)]
    return runs, results, logs, returned_at


@pytest.fixture(scope="module")
def one_process(qwen2_dir):
    """One process, the same 4 engines (one per device), the same weights."""
    with RolloutWorker(tiny_worker_config(qwen2_dir, load_format="dummy", dp_size=4)) as worker:
        worker.sync_params(jax.device_put(load_hf_params(qwen2_dir), worker.param_shardings()))
        yield worker


def _both(pod, key):
    runs, results, logs, _ = pod
    assert all(key in r for r in results), f"{key} missing from a process's results\n{logs}"
    return [r[key] for r in results]


def test_each_process_runs_its_engines_on_its_own_devices(pod):
    assert _both(pod, "local_devices") == [[0, 1], [2048, 2049]]
    errors = _both(pod, "foreign_device_error")
    assert "(process 1)" in errors[0] and "(process 0)" in errors[1]
    # The placement mesh spans every engine of every process.
    assert _both(pod, "mesh_shape")[0]["replica"] == 4


def test_same_seed_same_samples_as_one_process(pod, one_process):
    prompts = pod_program.PROMPTS
    sampled = _both(pod, "sampled")
    assert sampled[0] + sampled[1] == one_process.generate(prompts, **pod_program.SAMPLED).completions
    greedy = _both(pod, "greedy")
    assert greedy[0] + greedy[1] == one_process.generate(prompts, **pod_program.GREEDY).completions
    # The pod's engines took their decode steps from chunks; the one process's, one at a time.
    assert all(steps > 0 for steps in _both(pod, "chunk_steps_served"))
    assert one_process.engine.decode_chunk_stats is None


def test_placed_tree_syncs_at_zero_bytes_and_an_fsdp_tree_through_one_reshard(pod):
    assert _both(pod, "placed") == [{"bytes_copied": 0, "bytes_gathered": 0, "version": 1}] * 2
    fsdp = _both(pod, "fsdp")
    assert all(f["bytes_gathered"] > 0 and f["bytes_copied"] == 0 for f in fsdp), fsdp
    assert _both(pod, "fsdp_greedy") == _both(pod, "greedy")
    # On a mesh of another device order (jit refused it: "incompatible devices").
    assert all(f["bytes_gathered"] > 0 for f in _both(pod, "swapped_fsdp"))
    assert _both(pod, "swapped_fsdp_greedy") == _both(pod, "greedy")


def test_a_consistency_check_reads_replicated_params_here_and_refuses_fsdp_ones(pod):
    """Each process checks its own rows: a leaf sharded over the processes is named (the Flax
    forward over it was a collective of processes with batches of their own, which aborted one)."""
    for message in _both(pod, "consistency_fsdp"):
        assert "'model.embed_tokens.embedding' is sharded over several processes' devices" in message, message
    assert all(diff < 1e-3 for diff in _both(pod, "consistency_placed") + _both(pod, "consistency_split"))


def test_checkpoint_written_by_two_processes_loads_in_two_processes(pod):
    greedy = _both(pod, "greedy")
    assert _both(pod, "halved_greedy") != greedy  # the load really changed the weights back
    assert _both(pod, "checkpoint_greedy") == greedy
    assert [c["bytes_copied"] + c["bytes_gathered"] for c in _both(pod, "checkpoint")] == [0, 0]
    assert _both(pod, "resumed_equal") == [True, True]


def test_disagreeing_calls_are_a_named_error_and_change_nothing(pod):
    for key in ("disagree_calls", "disagree_trees"):
        errors = _both(pod, key)
        # Both processes raise and name the same process, with what each called.
        assert [e["processes"] for e in errors] == [[1], [1]], errors
        assert "process 0: sync_params(" in errors[0]["message"]
    assert "process 1: drop_kv()" in _both(pod, "disagree_calls")[0]["message"]
    assert _both(pod, "after_disagreement") == [{"bytes_copied": 0, "bytes_gathered": 0, "version": 6}] * 2
    assert _both(pod, "after_disagreement_greedy") == _both(pod, "greedy")


def test_a_sync_one_process_fails_its_part_of_changes_no_process(pod):
    """A NaN in process 1's shards only: process 1 raises its SyncError, process 0 a PeerSyncError
    (a PodError and a SyncError) naming it and its error at once, and neither commits: the next
    sync is one version on both."""
    errors = _both(pod, "one_process_nan")
    assert errors[1]["error"] == "SyncError" and "model.norm.scale" in errors[1]["message"], errors
    assert errors[0]["error"] == "PeerSyncError" and errors[0]["processes"] == [1], errors
    assert "process 1: SyncError" in errors[0]["message"] and "model.norm.scale" in errors[0]["message"]
    assert [r["version"] for r in _both(pod, "after_one_process_nan")] == [7, 7]


def test_a_process_killed_mid_sync_is_named_within_the_bound_and_the_survivor_leaves(pod):
    runs, results, logs, returned_at = pod
    assert runs[1].returncode == -9 and runs[0].returncode == 0, logs
    survivor = results[0]
    bound = pod_program.LOSS_TIMEOUT_S + 45  # the roll call's wait, the failed collective, a loaded host
    for key in ("killed_mid_sync", "next_call_after_loss"):
        assert survivor[key]["processes"] == [1] and "[1]" in survivor[key]["message"], survivor[key]
    assert survivor["killed_mid_sync"]["seconds"] < bound, survivor["killed_mid_sync"]
    # The next call does not wait for the lost process again.
    assert survivor["next_call_after_loss"]["seconds"] < pod_program.LOSS_TIMEOUT_S, survivor
    assert "were lost earlier" in survivor["next_call_after_loss"]["message"]
    # Generation is per process: the survivor's engines still serve.
    assert survivor["greedy_after_loss"] == survivor["greedy"]
    # Then rollout.launch.leave(0) ends it with status 0 (above) at once, not after JAX's
    # heartbeat timeout with status 1.
    assert returned_at - survivor["leaving_at"] < LEAVE_BOUND_S, (returned_at - survivor["leaving_at"], logs)


@pytest.mark.example_path
def test_grpo_over_two_processes_steps_as_one_process(tmp_path):
    """``--local-processes 2``: each process generates half of every step's prompts (one CPU
    device each) and the update is one data-parallel step over both, its advantages scaled by
    the std of the whole step's rewards (``--scale-rewards batch``), not each process's. With
    unmerged LoRA adapters on the tiny Llama: each sync passes the base again beside the
    adapters, under the SPMD rule, and moves the adapters alone, as in one process; the untied
    head, which the engine transposes, is copied at the first sync only (a pod's sync had copied
    it every time). Whole-model syncs across processes are tests/pod_program.py's."""
    flags = (
        "--preset",
        "tiny-llama",
        "--steps",
        "3",
        "--scale-rewards",
        "batch",
        "--lora-rank",
        "8",
        "--learning-rate",
        "3e-3",
        "--lora-unmerged",
    )
    two = run_grpo(tmp_path / "two", *flags, "--local-processes", "2")
    one = run_grpo(tmp_path / "one", *flags)
    assert [r["step"] for r in two] == [1, 2, 3]
    assert [r["bytes_copied"] for r in two] == [r["bytes_copied"] for r in one] and one[0]["bytes_copied"] > 0
    assert [r["bytes_copied"] for r in one[1:]] == [0, 0]
    # Step 1: the same prompts, weights and global seeds, so the same samples and rewards, and
    # the same update up to the order of float reductions.
    assert (two[0]["reward"], two[0]["completion_tokens"]) == (one[0]["reward"], one[0]["completion_tokens"])
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-4), (two[0], one[0])
    # Then the same global-batch update, up to the order of float reductions: rewards of 64
    # samples within noise (a fixed policy's one-step means differ by about 0.025).
    for a, b in zip(two[1:], one[1:]):
        assert abs(a["reward"] - b["reward"]) < 0.1, (two, one)


# A trainer's array that jax.device_put made of a one-device array across two processes of one
# device each: jax 0.12 cannot list its shards, and the worker's memory reads (a KV drop's
# accounting) read every live array (PPO --local-processes 2 failed at its first KV drop).
DEVICE_PUT_ACROSS = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from rollout.launch import join
from rollout.engine.buffers import device_buffers
from rollout.kv import live_device_buffers
join()
whole = NamedSharding(Mesh(np.array(jax.devices()), ("all",)), PartitionSpec())
x = jax.device_put(jnp.ones((64, 1), jnp.float32), whole)
mine = device_buffers(x)
assert set(mine) <= set(live_device_buffers())
print("BUFFERS", json.dumps({"device": jax.local_devices()[0].id, "x": [[d, n] for (d, _), n in mine.items()]}))
"""


def test_memory_reads_take_an_array_device_put_across_processes():
    runs = launch_local(["-c", DEVICE_PUT_ACROSS], 2, devices_per_process=1, timeout_s=LAUNCH_TIMEOUT_S)
    assert all(r.returncode == 0 for r in runs), [r.log[-3000:] for r in runs]
    for run in runs:
        (line,) = [line for line in run.log.splitlines() if line.startswith("BUFFERS ")]
        found = json.loads(line.removeprefix("BUFFERS "))
        assert found["x"] == [[found["device"], 64 * 4]], found


# One device a process, as multi-GPU jobs run. Params a trainer put with jax.device_put from
# arrays on one device of each process: at jax 0.12 jax cannot list such an array's shards,
# which the engines' views are made of (a sync failed in addressable_shards). Then an FSDP base
# beside unmerged adapters, passed again: it was gathered across the processes at every sync.
SYNC_DEVICE_PUT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from rollout import RolloutWorker
from rollout.launch import join
from tests.helpers import tiny_worker_config
from trainer_bridge import LoraConfig, flatten_params, init_adapters, load_hf_params, unflatten_params
join()
model_dir = sys.argv[1]
lora = LoraConfig(rank=4, alpha=8.0)
worker = RolloutWorker(
    tiny_worker_config(model_dir, load_format="dummy", devices=tuple(jax.local_devices()), unmerged_lora=lora)
)
host = flatten_params(load_hf_params(model_dir))
shardings = flatten_params(worker.param_shardings())
greedy = dict(temperature=0.0, max_new_tokens=8, ignore_eos=True)
built = {p: jax.make_array_from_callback(x.shape, shardings[p], lambda i, x=x: x[i]) for p, x in host.items()}
worker.sync_params(unflatten_params(built))
expected = worker.generate([[5, 17, 42, 8]], **greedy).completions
worker.sync_params(jax.tree_util.tree_map(lambda x: x * 0.5, unflatten_params(built)))
put = {p: jax.device_put(jnp.asarray(x), shardings[p]) for p, x in host.items()}
report = worker.sync_params(unflatten_params(put))
served = worker.generate([[5, 17, 42, 8]], **greedy).completions
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
fsdp = {
    p: jax.make_array_from_callback(
        x.shape, NamedSharding(mesh, PartitionSpec("fsdp") if x.shape[0] % 2 == 0 else PartitionSpec()),
        lambda i, x=x: x[i],
    )
    for p, x in host.items()
}
base = unflatten_params(fsdp)
adapters = init_adapters(base, lora, jax.random.key(0))
gathered = [worker.sync_params(base, adapters=adapters, lora=lora).bytes_gathered for _ in range(2)]
put_base = unflatten_params(put)  # served again: planned whole, its shards unlisted at jax 0.12
put_adapters = init_adapters(put_base, lora, jax.random.key(1))
put_gathered = [worker.sync_params(put_base, adapters=put_adapters, lora=lora).bytes_gathered for _ in range(2)]
result = {"same": served == expected, "version": report.version, "gathered": gathered, "put_gathered": put_gathered}
result["lora_same"] = worker.generate([[5, 17, 42, 8]], **greedy).completions == expected
print("SYNCED", json.dumps(result), flush=True)
worker.close()
"""


@pytest.mark.newest_end
def test_one_device_a_process_syncs_device_put_params_and_an_fsdp_base_once(qwen2_dir):
    runs = launch_local(["-c", SYNC_DEVICE_PUT, str(qwen2_dir)], 2, devices_per_process=1, timeout_s=LAUNCH_TIMEOUT_S)
    assert all(r.returncode == 0 for r in runs), [r.log[-3000:] for r in runs]
    for run in runs:
        (line,) = [line for line in run.log.splitlines() if line.startswith("SYNCED ")]
        synced = json.loads(line.removeprefix("SYNCED "))
        assert synced["gathered"][0] > 0 and synced["gathered"][1] == 0, synced  # the base, once
        assert synced["put_gathered"][1] == 0, synced
        assert {k: synced[k] for k in ("same", "version", "lora_same")} == {
            "same": True,
            "version": 3,
            "lora_same": True,
        }, run.log[-3000:]
