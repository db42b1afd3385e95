"""Rollout routing replay (R3): the experts the engine routed each token to, for the trainer.

The engine's expert block (``moe._expert_block_call``) notes each sparse layer's top-k expert ids
while the forward is traced, and the patched Qwen3-MoE model returns them stacked, [tokens, MoE
layers, k], as the third output the engine's runner discards (``_forward`` keeps it). With
``EngineOptions.record_routing`` the scheduler thread fetches them after every forward and files
them by KV slot: a token's routing lives exactly as long as its KV, so a prompt served from the
prefix cache gets the routing of the forward that computed its KV (the KV its continuation
attends to). A request that asked for routing has its rows copied out as its forwards run (its
slots may be reused once it ends).

A token's routing is recorded by the forward that takes it as input, the one that samples the
next token: under an in-flight swap, the weights that sampled token ``t + 1`` routed token ``t``.
The last sampled token is never an input: it has no routing (-1). An in-flight swap with
``recompute_kv`` prefills each running request again under the new weights, whose routing then
replaces the old for every token before the swap: the routing the later tokens' KV was computed
with, not the one that sampled the tokens before the swap (one table cannot hold both; their
``token_versions`` are the older version).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

# Marks a position without recorded routing (padding, a completion's last token).
NOT_ROUTED = -1

_trace = threading.local()


def routing_dtype(num_experts: int) -> np.dtype:
    """The narrowest signed integer holding expert ids (0 to ``num_experts - 1``) and ``NOT_ROUTED``."""
    return np.dtype(np.int8 if num_experts - 1 <= np.iinfo(np.int8).max else np.int16)


def note_routing(experts, num_experts: int) -> None:
    """Called by the expert block with its top-k ids [T, k] while a forward is traced."""
    layers = getattr(_trace, "layers", None)
    if layers is not None:
        layers.append(experts.astype(routing_dtype(num_experts)))


@contextlib.contextmanager
def routing_traced():
    """Collects the ids ``note_routing`` sees during a trace (a list, one entry per MoE layer)."""
    previous = getattr(_trace, "layers", None)
    _trace.layers = []
    try:
        yield _trace.layers
    finally:
        _trace.layers = previous


def patch_routing_output() -> None:
    """The engine's Qwen3-MoE forward returns its routing; its runner keeps it."""
    from sgl_jax.srt.model_executor import model_runner

    from .moe import import_engine_qwen3_moe

    model = import_engine_qwen3_moe().Qwen3MoeForCausalLM
    model.__call__ = _returning_routing(model.__call__)
    model_runner.ModelRunner._forward = _forward_keeping_routing


def _returning_routing(call):
    def __call__(self, *args, **kwargs):
        with routing_traced() as layers:
            output, layers_kv_fused, _ = call(self, *args, **kwargs)
        return output, layers_kv_fused, jnp.stack(layers, axis=1) if layers else None

    return __call__


def _forward_keeping_routing(self, forward_batch, logits_metadata):
    """``ModelRunner._forward`` keeping the forward's third output (routing, or the engine's
    ``True``) as ``_rollout_routing``."""
    import jax._src.test_util as jtu

    with jtu.count_pjit_cpp_cache_miss() as count:
        output, layers_kv_fused, extra = self.jitted_run_model(forward_batch, logits_metadata)
        cache_miss_count = count()
    self._set_kv_cache_after_forward(layers_kv_fused, forward_batch)
    # Dense models return the engine's True (a 0-d array once jitted): no routing.
    self._rollout_routing = extra if getattr(extra, "ndim", 0) == 3 else None
    return output, cache_miss_count


class RoutingSink:
    """One request's routing, per position of its prompt and completion: the rows its prefill
    found (cached or computed), then one row per decode step."""

    __slots__ = ("prefilled", "decoded")

    def __init__(self):
        self.prefilled: np.ndarray | None = None
        self.decoded: list[np.ndarray] = []

    def __len__(self) -> int:
        return (0 if self.prefilled is None else len(self.prefilled)) + len(self.decoded)

    def rows(self) -> np.ndarray:
        """[positions, MoE layers, k]."""
        if not self.decoded:
            return self.prefilled
        return np.concatenate([self.prefilled, np.stack(self.decoded)])


class RoutingRecorder:
    """One engine's routing by KV slot, and the sinks of the requests that asked for theirs.
    Filled on the scheduler thread; the request loop adds and removes sinks and other threads
    read ``host_bytes`` (single dict and attribute operations, atomic under the GIL)."""

    def __init__(self):
        self.sinks: dict[str, RoutingSink] = {}
        self._by_slot: np.ndarray | None = None

    def record(self, batch, routing, req_to_token: np.ndarray) -> None:
        """After ``batch``'s forward: file its tokens' ``routing`` [padded tokens, layers, k]
        under their KV slots, and copy out the rows of the requests with a sink."""
        slots = np.asarray(batch.out_cache_loc).reshape(-1)
        rows = np.asarray(jax.device_get(routing))[: len(slots)]
        self._file(slots, rows)
        extend = batch.forward_mode.is_extend()
        for i, req in enumerate(batch.reqs):
            sink = self.sinks.get(req.rid)
            if sink is None:
                continue
            if extend:
                # Every position so far, cached prefix included (a retracted request's re-prefill
                # or a later chunk starts over).
                sink.prefilled = self._by_slot[req_to_token[req.req_pool_idx, : len(req.fill_ids)]]
                sink.decoded = []
            else:
                sink.decoded.append(rows[i].copy())  # not a view keeping the step's padded rows

    def _file(self, slots: np.ndarray, rows: np.ndarray) -> None:
        needed = int(slots.max(initial=-1)) + 1
        if self._by_slot is None or needed > len(self._by_slot):
            grown = np.full(
                (max(needed, 2 * (0 if self._by_slot is None else len(self._by_slot))),) + rows.shape[1:],
                NOT_ROUTED,
                rows.dtype,
            )
            if self._by_slot is not None:
                grown[: len(self._by_slot)] = self._by_slot
            self._by_slot = grown
        self._by_slot[slots] = rows

    @property
    def host_bytes(self) -> int:
        """Host memory the slot table holds."""
        return 0 if self._by_slot is None else int(self._by_slot.nbytes)
