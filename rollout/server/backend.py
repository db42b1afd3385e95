"""What the server needs from a worker: the small interface a single-engine worker (and a pool
of engines) provides, and its adapter for :class:`rollout.RolloutWorker`."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import jax

from ..batch import RolloutBatch, StreamChunk
from .protocol import ApiError

# Why generation is refused while /admin/drop_kv holds the KV cache dropped.
KV_HELD = "the KV cache was dropped through /admin/drop_kv"


class Backend(Protocol):
    """Generation, weight and KV operations the HTTP routes call.

    Blocking methods (the admin ones) run on a server thread; ``generate`` and ``stream`` are
    awaited on the server's event loop, many at once: the backend batches them.
    """

    model_name: str  # the default served model name
    model_path: str | None  # optional: where the weights were loaded from (logged)
    tokenizer: Any  # an HF tokenizer, or None (token-id prompts only)
    context_length: int
    max_request_tokens: int  # prompt + completion tokens one request may have
    weight_version: int
    unavailable_reason: str | None  # why a generate cannot start now (None: it can)
    kv_present: bool  # False while the KV cache is dropped

    async def generate(self, prompts: list, **sampling) -> RolloutBatch: ...
    def stream(self, prompts: list, **sampling) -> AsyncIterator[StreamChunk]: ...
    def weights_checksum(self) -> dict: ...
    def perturb_weights(self, seed: int, scale: float, num_leaves: int, in_flight: bool = False) -> dict: ...
    def reload_weights(
        self, path: str, format: str, step: int | None, in_flight: bool = False, recompute_kv: bool = False
    ) -> dict: ...
    def load_lora(
        self, path: str, step: int | None, name: str | None, in_flight: bool = False, recompute_kv: bool = False
    ) -> dict: ...
    def adapter_names(self) -> list[str]: ...
    def unload_lora(self, name: str) -> bool: ...
    def drop_kv(self) -> dict: ...  # held dropped: generate calls refused with KV_HELD until rebuild_kv
    def rebuild_kv(self) -> dict: ...
    def memory(self) -> dict: ...


class WorkerBackend:
    """:class:`Backend` over one :class:`rollout.RolloutWorker` (shared by every server given it)."""

    def __init__(self, worker):
        self.worker = worker
        self.model_path = str(worker.config.model_path)
        self.model_name = Path(self.model_path.rstrip("/")).name or "model"
        # The processes of this worker's job: in a pod, weight changes and KV drops are calls
        # every process makes together (docs/pods.md), which one host's admin route cannot be.
        self.pod_processes = jax.process_count()

    def _one_host_call(self, route: str) -> None:
        if self.pod_processes > 1:
            # It would pair with another host's next trainer call, or wait for a partner that
            # never comes and write that host off as lost.
            raise ApiError(
                409,
                f"/admin/{route} is refused in a pod of {self.pod_processes} processes: changing the weights "
                "or dropping the KV cache is a call every process makes together (the SPMD rule, "
                "docs/pods.md); make it from the trainer's program on every host",
                code="pod_spmd_call",
            )

    @property
    def tokenizer(self):
        return self.worker.tokenizer

    @property
    def context_length(self) -> int:
        return self.worker.context_length

    @property
    def max_request_tokens(self) -> int:
        return self.worker.max_request_tokens

    @property
    def weight_version(self) -> int:
        return self.worker.weight_version

    @property
    def unavailable_reason(self) -> str | None:
        return self.worker.unavailable_reason

    @property
    def kv_present(self) -> bool:
        return not self.worker.closed and not self.worker.kv_dropped

    async def generate(self, prompts: list, **sampling) -> RolloutBatch:
        return await self.worker.agenerate(prompts, **sampling)

    def stream(self, prompts: list, **sampling) -> AsyncIterator[StreamChunk]:
        return self.worker.astream(prompts, **sampling)

    def weights_checksum(self) -> dict:
        return self.worker.weights_checksum()

    def perturb_weights(self, seed: int, scale: float, num_leaves: int, in_flight: bool = False) -> dict:
        self._one_host_call("perturb_weights")
        return self.worker.perturb_weights(seed, scale, num_leaves, in_flight=in_flight)

    def reload_weights(
        self, path: str, format: str, step: int | None, in_flight: bool = False, recompute_kv: bool = False
    ) -> dict:
        self._one_host_call("reload_weights")
        swap = dict(in_flight=in_flight, recompute_kv=recompute_kv)
        if format == "orbax":
            report = self.worker.load_checkpoint(path, step=step, **swap)
        else:
            report = self.worker.load_hf(path, **swap)
        return dataclasses.asdict(report)

    def load_lora(
        self, path: str, step: int | None, name: str | None, in_flight: bool = False, recompute_kv: bool = False
    ) -> dict:
        self._one_host_call("load_lora")
        # Named adapters beside the default ones need slots (max_loras > 1); otherwise the name
        # only labels the default adapters.
        named = name if self.worker.config.max_loras > 1 else None
        swap = dict(in_flight=in_flight, recompute_kv=recompute_kv)
        return dataclasses.asdict(self.worker.load_adapters(path, step=step, name=named, **swap))

    def adapter_names(self) -> list[str]:
        return self.worker.adapter_names()

    def unload_lora(self, name: str) -> bool:
        return self.worker.unload_adapters(name)

    def drop_kv(self) -> dict:
        self._one_host_call("drop_kv")
        # Held by the worker, not the routes: a request past the routes' check that reached the
        # worker after the drop would otherwise have rebuilt the cache.
        return dataclasses.asdict(self.worker.drop_kv(hold=KV_HELD))

    def rebuild_kv(self) -> dict:
        self._one_host_call("rebuild_kv")
        return dataclasses.asdict(self.worker.rebuild_kv())

    def memory(self) -> dict:
        return dataclasses.asdict(self.worker.memory())
