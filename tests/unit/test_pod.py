"""rollout/pod.py's call exchange as process 0 of two sees it, over a fake of the JAX distributed
runtime's key-value store in which the test writes process 1's keys. Real processes:
tests/test_pods.py."""

import pytest

from rollout import pod as pod_module
from rollout.pod import Pod, PodError


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
