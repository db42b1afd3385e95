"""rollout/pod.py's call exchange as process 0 of two sees it, over a fake of the JAX distributed
runtime's key-value store in which the test writes process 1's keys. Real processes:
tests/test_pods.py."""

import types

import pytest

from rollout import pod as pod_module
from rollout.pod import PeerSyncError, Pod, PodError
from trainer_bridge import SyncError


class KeyValueStore:
    """The three calls Pod makes on the runtime's client; a missing key times out at once."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value):
        self.values[key] = value

    def key_value_delete(self, key):
        self.values.pop(key, None)

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.values:
            raise TimeoutError(f"{key}: deadline exceeded")
        return self.values[key]

    def key_value_try_get(self, key):
        if key not in self.values:
            raise KeyError(f"{key}: not found")
        return self.values[key]


@pytest.fixture
def store(monkeypatch):
    kv = KeyValueStore()
    monkeypatch.setattr(pod_module, "_client", lambda: kv)
    monkeypatch.setattr(pod_module, "_gone", set())
    return kv


def test_a_call_both_processes_made_returns_their_payloads(store):
    store.key_value_set("rollout/0/1/1", "sync_params|abc|from 1")  # process 1 arrived first
    assert Pod(0, 2, 1.0, "rollout/0").agree("sync_params", "abc", "from 0") == ["from 0", "from 1"]
    assert pod_module.gone_processes() == frozenset()


def test_after_a_process_is_found_missing_the_next_call_fails_at_once_naming_it(store):
    survivor = Pod(0, 2, 1.0, "rollout/0")
    with pytest.raises(PodError, match=r"process\(es\) \[1\] did not reach this call") as missing:
        survivor.agree("sync_params", "abc")
    assert missing.value.processes == (1,) and pod_module.gone_processes() == {1}
    written = dict(store.values)
    # Process 1 turns up late: its key for the next exchange is there, and still nothing lines up.
    store.key_value_set("rollout/0/2/1", "drop_kv||")
    with pytest.raises(PodError, match=r"process\(es\) \[1\] were lost earlier") as later:
        survivor.agree("drop_kv")
    assert later.value.processes == (1,)
    assert {k: v for k, v in store.values.items() if k in written} == written, "the failed call wrote nothing"
    assert "rollout/0/2/0" not in store.values


def test_a_part_another_process_failed_is_a_named_error_at_once_and_its_result_unused(store):
    store.key_value_set("rollout/0/1/1", "sync_params (prepared)|settled|SyncError: non-finite values in: w")
    parts = []
    with pytest.raises(PodError, match=r"process\(es\) \[1\] failed their part \(process 1: SyncError: non-fin") as e:
        Pod(0, 2, 1.0, "rollout/0").settle("sync_params (prepared)", lambda: parts.append("prepared"))
    assert e.value.processes == (1,) and parts == ["prepared"]
    # A SyncError there is one here too: a loop skipping a step on SyncError skips it everywhere.
    assert isinstance(e.value, PeerSyncError) and isinstance(e.value, SyncError)
    assert e.value.path is None and e.value.non_finite == ()  # as a SyncError's (load_hf reads path)
    assert pod_module.gone_processes() == frozenset(), "a process that failed its part is not lost"


def test_a_peer_failing_before_a_nested_settle_is_named_at_that_exchange_and_none_follows(store):
    """Process 1 failed its part of a sync before the reshard's own settle: its outcome met
    process 0's reshard exchange. Both raise there; a second exchange would have waited out the
    timeout and written process 1 off as lost."""
    store.key_value_set("rollout/0/1/1", "sync_params (prepared)|settled|SyncError: a NaN in w")
    pod = Pod(0, 2, 1.0, "rollout/0")
    with pytest.raises(PeerSyncError, match=r"process\(es\) \[1\] failed their part \(process 1: SyncError: a NaN"):
        pod.settle("sync_params (prepared)", lambda: pod.settle("sync_params (reshard)", lambda: "compiled"))
    assert pod._calls == 1 and pod_module.gone_processes() == frozenset()


def test_a_part_this_process_failed_raises_its_own_error_after_telling_the_others(store):
    store.key_value_set("rollout/0/1/1", "sync_params (prepared)|settled|")

    def fail():
        raise ValueError("a NaN here")

    with pytest.raises(ValueError, match="a NaN here"):
        Pod(0, 2, 1.0, "rollout/0").settle("sync_params (prepared)", fail)
    assert store.values["rollout/0/1/0"] == "sync_params (prepared)|settled|ValueError: a NaN here"
    store.key_value_set("rollout/0/2/1", "sync_params (prepared)|settled|")
    assert Pod(0, 2, 1.0, "rollout/0", _calls=1).settle("sync_params (prepared)", lambda: 7) == 7


def test_a_global_arrays_fingerprint_has_its_meshs_device_order():
    """Two processes whose trees differ only in their mesh's device order were one call to the
    exchange, and one of them failed alone in the reshard. A process-local array's devices are
    left out: each process's are its own."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    class GlobalSharding:  # what tree_fingerprint reads of a NamedSharding over several processes
        def __init__(self, devices):
            self.spec, self.mesh, self.is_fully_addressable = PartitionSpec("fsdp"), Mesh(devices, ("fsdp",)), False

    class GlobalLeaf:
        shape, dtype = (8, 4), np.dtype("float32")

        def __init__(self, devices):
            self.sharding = GlobalSharding(devices)

    devices = np.array(jax.devices())
    natural, reversed_ = GlobalLeaf(devices), GlobalLeaf(devices[::-1])
    assert pod_module.tree_fingerprint({"w": natural}) != pod_module.tree_fingerprint({"w": reversed_})
    assert pod_module.tree_fingerprint({"w": natural}) == pod_module.tree_fingerprint({"w": GlobalLeaf(devices)})
    local = [
        jax.device_put(np.ones((8, 4), np.float32), NamedSharding(Mesh(d, ("fsdp",)), PartitionSpec("fsdp")))
        for d in (devices, devices[::-1])
    ]
    assert pod_module.tree_fingerprint({"w": local[0]}) == pod_module.tree_fingerprint({"w": local[1]})


@pytest.mark.parametrize("arrives_before_deadline_s", [None, 0.01], ids=["never", "just-before-the-deadline"])
def test_a_late_process_is_named_alone_when_waiting_for_it_used_the_timeout(
    store, monkeypatch, arrives_before_deadline_s
):
    """Process 1 of two, process 0 late: the wait for process 0's key takes the whole timeout,
    and the keys read after it (this process's own) had a blocking read of 1 ms, which a real
    coordination service times out on however present the key: the PodError named both
    processes, this one too, as lost."""
    clock = [100.0]
    monkeypatch.setattr(pod_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    present_but_slow = store.blocking_key_value_get

    def blocking_get(key, timeout_ms):
        if key.endswith("/0"):  # the late process: waited for until (or nearly until) the deadline
            clock[0] += timeout_ms / 1000 - (arrives_before_deadline_s or 0)
            if arrives_before_deadline_s:
                return "drop_kv||"
        elif timeout_ms < 50:  # a round trip to the service takes longer
            raise TimeoutError(f"{key}: deadline exceeded")
        return present_but_slow(key, timeout_ms)

    monkeypatch.setattr(store, "blocking_key_value_get", blocking_get)
    if arrives_before_deadline_s:  # 10 ms left for this process's own key: read all the same
        assert Pod(1, 2, 10.0, "rollout/0").agree("drop_kv") == ["", ""]
        return
    with pytest.raises(PodError, match=r"process\(es\) \[0\] did not reach this call") as late:
        Pod(1, 2, 10.0, "rollout/0").agree("drop_kv")
    assert late.value.processes == (0,) and pod_module.gone_processes() == {0}
