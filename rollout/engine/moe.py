"""The routed-expert block of a mixture-of-experts layer, on any backend, experts sharded.

``routed_experts`` replaces 0.0.2's ``EPMoE.__call__`` (see WORKAROUNDS "moe-forward"). The
tokens are replicated and each layer's stacked expert weights are sharded over the engine's
("data", "tensor") devices, expert first, as the engine lays them out. Each device runs its own
experts on the token copies routed to them, sorted by expert, as grouped matmuls
(``jax.lax.ragged_dot``: a native kernel on TPU and GPU, plain XLA elsewhere), weights each row
by its routing weight, and the partial sums are added across devices. Memory per device
follows tokens x top_k, not tokens x experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.moe import route
from models.qwen3_moe import sparse_layers

from .routing import note_routing

# The mesh axes the engine shards experts over, in its order.
EXPERT_AXES = ("data", "tensor")


def routed_experts(inputs, router_logits, wi_0, wi_1, wo, *, top_k: int, norm_topk_prob: bool, mesh, dtype):
    """SwiGLU experts ``wi_0``/``wi_1`` [E, H, I], ``wo`` [E, I, H] on ``inputs`` [T, H] routed
    by ``router_logits`` [T, E]; returns [T, H] in ``dtype``."""
    weights, experts = route(router_logits, top_k, norm_topk_prob)
    shards = 1
    for axis in EXPERT_AXES:
        shards *= mesh.shape.get(axis, 1)

    def local(x, weights, experts, w0, w1, w2):
        num_local = w0.shape[0]
        shard = 0
        if shards > 1:
            shard = jax.lax.axis_index("data") * mesh.shape.get("tensor", 1) + jax.lax.axis_index("tensor")
        local_expert = experts.reshape(-1) - shard * num_local
        mine = (local_expert >= 0) & (local_expert < num_local)
        # Rows of other devices' experts sort last, outside every group: ragged_dot leaves them 0.
        key = jnp.where(mine, local_expert, num_local)
        order = jnp.argsort(key, stable=True)
        token = order // top_k
        group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
        rows = x[token].astype(dtype)
        gate = jax.lax.ragged_dot(rows, w0.astype(dtype), group_sizes)
        up = jax.lax.ragged_dot(rows, w1.astype(dtype), group_sizes)
        out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w2.astype(dtype), group_sizes)
        row_weight = jnp.where(mine, weights.reshape(-1), 0.0)[order]
        combined = jnp.zeros((x.shape[0], out.shape[-1]), jnp.float32)
        combined = combined.at[token].add(out.astype(jnp.float32) * row_weight[:, None])
        if shards > 1:
            combined = jax.lax.psum(combined, EXPERT_AXES)
        return combined.astype(dtype)

    if shards == 1:
        return local(inputs, weights, experts, wi_0, wi_1, wo)
    expert_spec = P(EXPERT_AXES, None, None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(), P(), expert_spec, expert_spec, expert_spec),
        out_specs=P(),
        check_vma=False,
    )(inputs, weights, experts, wi_0, wi_1, wo)


def patch_expert_block(enabled) -> None:
    """Install the MoE workarounds that ``enabled(name)`` allows (see WORKAROUNDS)."""
    from sgl_jax.srt.layers import moe

    qwen3_moe = import_engine_qwen3_moe()
    if enabled("moe-forward"):
        moe.EPMoE.__call__ = _expert_block_call
    if enabled("moe-expert-shapes"):
        moe.EPMoE.__init__ = _with_every_expert(moe.EPMoE.__init__)
    if enabled("moe-sparse-step"):
        qwen3_moe.Qwen3MoeForCausalLM.__init__ = _dense_layers_listed(qwen3_moe.Qwen3MoeForCausalLM.__init__)


def import_engine_qwen3_moe():
    """WORKAROUNDS "moe-jax-import": the engine's Qwen3-MoE module, imported with ``jax.jax``
    present for the duration (it does ``from jax import jax``), and registered as the engine's
    model registry would have."""
    import importlib

    from sgl_jax.srt.models.registry import ModelRegistry

    shim = not hasattr(jax, "jax")
    if shim:
        jax.jax = jax
    try:
        module = importlib.import_module("sgl_jax.srt.models.qwen3_moe")
    finally:
        if shim:
            del jax.jax
    ModelRegistry.models.setdefault(module.EntryClass.__name__, module.EntryClass)
    return module


def _expert_block_call(self, inputs, router_logits=None):
    """``EPMoE.__call__`` replacement."""
    if router_logits is None:
        raise ValueError("router_logits is required for EPMoE")
    # The ids routed_experts picks (its route() of the same logits; XLA computes them once).
    note_routing(route(router_logits, self.num_experts_per_tok, _norm_topk_prob(self))[1], router_logits.shape[-1])
    return routed_experts(
        inputs,
        router_logits,
        self.wi_0.value,
        self.wi_1.value,
        self.wo.value,
        top_k=self.num_experts_per_tok,
        norm_topk_prob=_norm_topk_prob(self),
        mesh=self.mesh,
        dtype=self.dtype,
    )


def _norm_topk_prob(block) -> bool:
    # transformers' Qwen3MoeConfig default.
    return bool(getattr(block.config, "norm_topk_prob", False))


def _with_every_expert(init):
    """``EPMoE.__init__`` creating [num_experts, ...] weights (sharded over the expert shards)
    rather than [num_experts / shards, ...]."""

    def __init__(self, *args, num_experts: int, expert_parallel_size: int, **kwargs):
        if num_experts % expert_parallel_size:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by the engine's expert shards "
                f"(data x tensor = {expert_parallel_size}): choose tp_size accordingly"
            )
        init(self, *args, num_experts=num_experts, expert_parallel_size=1, **kwargs)
        self.expert_parallel_size = expert_parallel_size
        self.experts_per_device = num_experts // expert_parallel_size

    return __init__


def _dense_layers_listed(init):
    """``Qwen3MoeForCausalLM.__init__`` seeing every dense layer in ``mlp_only_layers``, those
    ``decoder_sparse_step`` makes dense included (the same model for HF transformers)."""

    def __init__(self, config, *args, **kwargs):
        sparse = sparse_layers(lambda key, default=None: getattr(config, key, default))
        config.mlp_only_layers = [i for i in range(config.num_hidden_layers) if i not in sparse]
        init(self, config, *args, **kwargs)

    return __init__
