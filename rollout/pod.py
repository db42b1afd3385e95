"""The worker inside a multi-process JAX job (one process per host): the SPMD rule, checked.

Calls that change weights or KV (``sync_params``, ``load_checkpoint``, ``load_hf``,
``drop_kv``, ``rebuild_kv``, ``released_for_training``) may run collectives over every
process, so every process must make them in the same order with trees of the same structure.
Before any collective, each process publishes a cheap fingerprint of its call (name and tree
structure) in the JAX distributed runtime's key-value store and reads every other process's,
waiting at most ``timeout_s``: a disagreement or a process that never arrives is a
:class:`PodError` naming the processes, instead of a collective that hangs or mixes trees.
The processes such an error named as not arriving are remembered (:func:`gone_processes`): a
later call fails at once naming them, and ``rollout.launch.leave`` ends this process without
waiting for them.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import jax
import numpy as np

from trainer_bridge import SyncError

from .errors import RolloutError

T = TypeVar("T")
logger = logging.getLogger(__name__)

# Workers are created in the same order by every process (creation is itself an SPMD call):
# the n-th worker of each process shares the key namespace ``rollout/<n>/``.
_worker_numbers = itertools.count()

# Processes a PodError of this process named as not arriving (lost, stuck, or skipping calls), and
# the coordination service's host when it was unreachable: the job is broken for them.
_gone: set[int] = set()

# Where each process announces that it is leaving (once per process: rollout.launch.leave).
_LEAVING_PREFIX = "rollout/leaving/"


class PodError(RolloutError, RuntimeError):
    """Processes of a multi-process job disagree on a collective call, or one is lost.

    ``processes`` are the process indices that disagree or did not answer.
    """

    def __init__(self, message: str, processes: tuple[int, ...], exchanged: bool = False):
        super().__init__(message)
        self.processes = processes
        # Raised by an exchange every process made (and raises from too): nothing is left to tell
        # the others, and no process is lost.
        self.exchanged = exchanged


class PeerSyncError(PodError, SyncError):
    """Another process's part of a sync failed its checks (a SyncError there). A SyncError on
    this process too, so a trainer that skips a step on SyncError skips it on every process, and
    their calls stay in step."""

    def __init__(self, message: str, processes: tuple[int, ...]):
        PodError.__init__(self, message, processes, exchanged=True)


# The fingerprint of a settle's exchange (Pod.settle): its payload is the process's outcome.
_SETTLED = "settled"


def _failed_parts(call: str, failed: dict[int, str]) -> PodError:
    """The error for processes whose part of ``call`` failed (outcomes by process)."""
    message = (
        f"{call}: process(es) {sorted(failed)} failed their part ("
        + "; ".join(f"process {p}: {outcome}" for p, outcome in sorted(failed.items()))
        + "); nothing was changed on any process."
    )
    if all(outcome.startswith(f"{SyncError.__name__}:") for outcome in failed.values()):
        return PeerSyncError(message, tuple(sorted(failed)))
    return PodError(message, tuple(sorted(failed)), exchanged=True)


def _client():
    # The distributed runtime client jax.distributed.initialize created; jax has no public
    # accessor for its key-value store.
    from jax._src import distributed

    return distributed.global_state.client


def tree_fingerprint(flat: Mapping[str, object]) -> str:
    """A short hash of a flat tree's paths, shapes, dtypes and placements (no values read): an
    array over several processes' devices with its mesh's device order, which every process
    sees alike (a process-local one's devices are its own)."""
    parts = []
    for path, leaf in flat.items():
        sharding = getattr(leaf, "sharding", None)
        placement = (
            repr(sharding.spec) + repr(sharding.mesh.shape) if hasattr(sharding, "spec") else type(leaf).__name__
        )
        if hasattr(sharding, "mesh") and not sharding.is_fully_addressable:
            placement += repr([device.id for device in sharding.mesh.devices.flat])
        parts.append(f"{path}:{tuple(np.shape(leaf))}:{getattr(leaf, 'dtype', None)}:{placement}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@dataclasses.dataclass
class Pod:
    """This process's place in the job and the fingerprint exchange. With one process every
    check is free (nothing is exchanged)."""

    process_index: int
    process_count: int
    timeout_s: float
    namespace: str
    _calls: int = 0

    @classmethod
    def current(cls, timeout_s: float) -> Pod:
        return cls(jax.process_index(), jax.process_count(), timeout_s, f"rollout/{next(_worker_numbers)}")

    @property
    def multi_process(self) -> bool:
        return self.process_count > 1

    def agree(self, call: str, fingerprint: str = "", payload: str = "") -> list[str]:
        """Every process's ``payload`` (process order), once all of them made the same ``call``
        with the same ``fingerprint``. PodError naming the processes otherwise, after at most
        ``timeout_s`` (a process that skipped the call, is stuck, or was lost), or at once when
        an earlier call named processes missing (:func:`gone_processes`)."""
        if not self.multi_process:
            return [payload]
        gone = sorted(_gone - {self.process_index})
        if gone:
            # Once a call found processes missing, the others' call counts no longer line up:
            # every later call would wait its whole timeout to fail the same way.
            raise PodError(
                f"{call}: process(es) {gone} were lost earlier (an earlier call's PodError named them); "
                "this job can make no more weight or KV calls. Restart the job and resume from the last "
                "checkpoint (docs/pods.md).",
                tuple(gone),
            )
        self._calls += 1
        prefix = f"{self.namespace}/{self._calls}/"
        mine = f"{call}|{fingerprint}|{payload}"
        client = self._call_client(call, lambda c: c.key_value_set(prefix + str(self.process_index), mine))
        values = self._gather(client, prefix, call)
        calls = {p: v.split("|", 2) for p, v in values.items()}
        votes = collections.Counter((c, f) for c, f, _ in calls.values())
        if len(votes) > 1:
            # A process whose part of a settled call failed reached that call's exchange while
            # the others went on to the next one (a nested settle's): named as failing, not as
            # making another call.
            failed = {p: payload for p, (_, f, payload) in calls.items() if f == _SETTLED and payload}
            if failed:
                raise _failed_parts(call, failed)
            # Named: the processes off the most common call (ties: off process 0's), the same
            # list in every process.
            usual = max(votes, key=lambda k: (votes[k], k == tuple(calls[0][:2])))
            differ = sorted(p for p, (c, f, _) in calls.items() if (c, f) != usual)
            seen = "; ".join(f"process {p}: {c}({f})" for p, (c, f, _) in sorted(calls.items()))
            raise PodError(
                f"{call}: process(es) {differ} made a different call than the others ({seen}); "
                "every process must make the same "
                "weight and KV calls in the same order with trees of the same structure (the SPMD rule, "
                "docs/pods.md). Nothing was changed.",
                tuple(differ),
                exchanged=True,
            )
        if self._calls > 1:
            # Every process has finished the previous exchange (it wrote this one): drop my old key.
            client.key_value_delete(f"{self.namespace}/{self._calls - 1}/{self.process_index}")
        return [calls[p][2] for p in range(self.process_count)]

    def settle(self, call: str, action: Callable[[], T]) -> T:
        """``action()``'s result once every process's part of ``call`` succeeded: each runs its
        own, then all exchange how it went. A process whose part raised raises that error; the
        others a PodError naming it and its error, at once (not after ``timeout_s``, counted
        lost; a :class:`PeerSyncError` where that error was a SyncError). So a call whose commit
        comes after this changes nothing on any process when one of them fails its part (a NaN
        only one process's shards hold: its weight version no longer lagged the others' for
        good). ``action`` may settle calls of its own: when one process fails before reaching
        them, every process raises at that exchange, and none makes this one."""
        try:
            result, error = action(), None
        except PodError as exc:
            if exc.exchanged:  # every process raises from the exchange that raised it
                raise
            result, error = None, exc
        except Exception as exc:
            result, error = None, exc
        outcome = "" if error is None else f"{type(error).__name__}: {str(error)[:400]}"
        try:
            outcomes = self.agree(call, _SETTLED, outcome)
        except PodError:
            if error is not None:
                raise error from None
            raise
        if error is not None:
            raise error
        failed = {p: outcome for p, outcome in enumerate(outcomes) if outcome}
        if failed:
            raise _failed_parts(call, failed)
        return result

    def lost_processes(self, call: str) -> tuple[int, ...]:
        """After a collective failed: the processes that do not report the same failure within
        ``timeout_s`` (every live process of a failed collective reports it)."""
        prefix = f"{self.namespace}/failed/{self._calls}/"
        client = self._call_client(call, lambda c: c.key_value_set(prefix + str(self.process_index), call))
        try:
            self._gather(client, prefix, call)
        except PodError as exc:
            return exc.processes
        return ()

    def _call_client(self, call: str, action):
        client = _client()
        try:
            action(client)
        except Exception as exc:  # the runtime raises its own status errors
            _gone.add(0)
            raise PodError(f"{call}: the JAX coordination service (process 0) is unreachable: {exc}", (0,)) from exc
        return client

    def _gather(self, client, prefix: str, call: str) -> dict[int, str]:
        deadline = time.monotonic() + self.timeout_s
        values, missing = {}, []
        for p in range(self.process_count):
            try:
                values[p] = _read_by(client, prefix + str(p), deadline)
            except Exception:  # deadline exceeded, or the coordination service is gone
                missing.append(p)
        if missing:
            _gone.update(missing)
            raise PodError(
                f"{call}: process(es) {missing} did not reach this call within {self.timeout_s:g} s "
                "(WorkerConfig.pod_timeout_s): they skipped it, are stuck, or were lost. Restart the "
                "job and resume from the last checkpoint (docs/pods.md).",
                tuple(missing),
            )
        return {p: v for p, v in values.items()}


def _read_by(client, key: str, deadline: float) -> str:
    """``key``'s value, waited for until ``deadline`` (time.monotonic). A key already written is
    read however little time is left (the wait for an earlier key took it): a blocking read of a
    few ms timed out on it, and named processes that had arrived, this one included, as lost."""
    remaining_ms = int((deadline - time.monotonic()) * 1000)
    if remaining_ms > 0:
        try:
            return client.blocking_key_value_get(key, remaining_ms)
        except Exception:  # timed out: it may still be there
            pass
    return client.key_value_try_get(key)


def gone_processes() -> frozenset[int]:
    """The processes a :class:`PodError` in this process named as not arriving (lost, stuck or
    skipping calls; 0 when the coordination service was unreachable)."""
    return frozenset(_gone)


def announce_leaving(timeout_s: float) -> tuple[int, ...]:
    """Tell the other processes that this one is leaving. On process 0, which hosts JAX's
    coordination service, then wait at most ``timeout_s`` for every process not gone to say the
    same (process 0's exit ends the service, and JAX terminates every process still connected to
    it). Returns the processes process 0 stopped waiting for; () elsewhere."""
    me, count = jax.process_index(), jax.process_count()
    client = _client()
    try:
        client.key_value_set(_LEAVING_PREFIX + str(me), "1")
    except Exception:  # the coordination service is gone: nobody to tell
        return ()
    if me != 0:
        return ()
    deadline = time.monotonic() + timeout_s
    late = []
    for p in range(1, count):
        if p in _gone:
            continue
        try:
            _read_by(client, _LEAVING_PREFIX + str(p), deadline)
        except Exception:  # deadline exceeded
            late.append(p)
    return tuple(late)
