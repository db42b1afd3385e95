"""Flax (linen) Qwen3-MoE causal LM in the MLLM-JAX layout: Qwen3's model (``decoder_flax``) with a
routed expert block as the feed-forward of each sparse layer.

A sparse layer's ``mlp`` holds ``gate`` {'kernel' [H, E]} (the router) and the stacked experts
``gate_proj`` / ``up_proj`` [E, H, moe_intermediate] and ``down_proj`` [E, moe_intermediate, H];
dense layers keep Qwen3's ``mlp``. Experts are dispatched densely (every expert runs on every
token, weighted by its routing weight, 0 unless among the top k): simple and exact, fine for
tiny models and reference log-probs; a trainer at scale groups tokens by expert instead.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import qwen3_moe
from .decoder_flax import MLP, DecoderConfig, read_hf_config
from .hf_config import with_hf_defaults
from .moe import replay_route, route

_expert_init = nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
)


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(DecoderConfig):
    """``architecture`` is "qwen3_moe"; ``sparse_layers`` the layers with routed experts."""

    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()

    @property
    def attention_bias(self) -> bool:
        return False

    @property
    def qk_norm(self) -> bool:
        return True

    def routing_index(self, layer: int) -> int | None:
        return self.sparse_layers.index(layer) if layer in self.sparse_layers else None

    @property
    def routed_per_token(self) -> int:
        return self.num_experts_per_tok

    def feed_forward(self, layer: int) -> nn.Module:
        if layer in self.sparse_layers:
            return SparseMoeBlock(self, name="mlp")
        return MLP(self, name="mlp")

    @classmethod
    def from_hf(cls, source: str | Path | dict, dtype: str = "float32") -> Qwen3MoeConfig:
        source = with_hf_defaults(read_hf_config(source))
        if source.get("model_type") != qwen3_moe.MODEL_TYPE:
            raise ValueError(f"model_type {source.get('model_type')!r} is not {qwen3_moe.MODEL_TYPE!r}")
        qwen3_moe.check_config(source.get)
        # As Qwen3's attention, but without Qwen3's head_dim default (transformers' Qwen3MoeConfig
        # has none: hidden size over heads, as the engine takes it).
        head_dim = source.get("head_dim") or source["hidden_size"] // source["num_attention_heads"]
        base = DecoderConfig.from_hf({**source, "model_type": "qwen3", "head_dim": head_dim}, dtype=dtype)
        return cls(
            **{
                **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                "architecture": qwen3_moe.MODEL_TYPE,
            },
            num_experts=int(source["num_experts"]),
            num_experts_per_tok=int(source["num_experts_per_tok"]),
            moe_intermediate_size=int(source["moe_intermediate_size"]),
            norm_topk_prob=bool(source["norm_topk_prob"]),
            sparse_layers=tuple(sorted(qwen3_moe.sparse_layers(source.get))),
        )


class SparseMoeBlock(nn.Module):
    config: Qwen3MoeConfig

    @nn.compact
    def __call__(self, x, routed=None):
        """``routed`` [..., top_k]: experts to use instead of this router's choice (-1: its own)."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        experts, hidden, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
        logits = nn.Dense(experts, use_bias=False, dtype=dtype, param_dtype=dtype, name="gate")(x)
        weights, chosen = route(logits, c.num_experts_per_tok, c.norm_topk_prob)
        # This router's own choice, replayed or not (router_choices reads it).
        self.sow("intermediates", "router_choice", chosen)
        if routed is not None:
            weights, chosen = replay_route(logits, routed, c.num_experts_per_tok, c.norm_topk_prob)
        # [..., E]: each expert's routing weight for each token, 0 where not chosen.
        combine = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=jnp.float32) * weights[..., None], axis=-2)
        gate_proj = self.param("gate_proj", _expert_init, (experts, hidden, inter), dtype)
        up_proj = self.param("up_proj", _expert_init, (experts, hidden, inter), dtype)
        down_proj = self.param("down_proj", _expert_init, (experts, inter, hidden), dtype)
        x = x.astype(dtype)
        gate = jnp.einsum("...h,ehi->...ei", x, gate_proj)
        up = jnp.einsum("...h,ehi->...ei", x, up_proj)
        out = jnp.einsum("...ei,eih->...eh", nn.silu(gate) * up, down_proj)
        return jnp.einsum("...eh,...e->...h", out.astype(jnp.float32), combine).astype(dtype)


def router_choices(model, params, tokens, attention_mask=None, positions=None, routed_experts=None):
    """The experts the model's own routers pick for each token, [B, T, MoE layers, top_k] int32
    (as ``RolloutBatch.routed_experts`` lays them out), from a forward over ``tokens``; with
    ``routed_experts`` that forward replays them (later layers see the replayed experts' output)."""
    _, state = model.apply(
        {"params": params}, tokens, attention_mask, positions, routed_experts=routed_experts, mutable=["intermediates"]
    )
    layers = state["intermediates"]["model"]
    sparse = model.config.sparse_layers
    return jnp.stack([layers[f"layers_{i}"]["mlp"]["router_choice"][0] for i in sparse], axis=2)
