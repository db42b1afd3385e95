"""Tiny random Qwen3-MoE model directories (no network), like :mod:`models.tiny`'s."""

from __future__ import annotations

import dataclasses

import numpy as np

from . import qwen3_moe
from .tiny import TinyModelSpec, random_hf_weights


@dataclasses.dataclass(frozen=True)
class TinyMoeSpec(TinyModelSpec):
    """A tiny Qwen3-MoE: Qwen3 attention (``architecture`` stays "qwen3"), 8 experts of which 2
    run per token, and layer 0 dense (``mlp_only_layers``) so both kinds of layer are built."""

    architecture: str = "qwen3"
    num_key_value_heads: int = 2
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = (0,)
    decoder_sparse_step: int = 1
    # Spread of the router logits: wide enough that the top-k choice is clear-cut for most tokens
    # (engine and trainer pick the same experts), while different tokens pick different experts.
    router_scale: float = 3.0

    def __post_init__(self):
        super().__post_init__()
        if self.architecture != "qwen3":
            raise ValueError(
                f"TinyMoeSpec.architecture is the attention's and must be 'qwen3', got {self.architecture!r}"
            )

    def hf_config(self) -> dict:
        config = super().hf_config()
        config.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type=qwen3_moe.MODEL_TYPE,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            mlp_only_layers=list(self.mlp_only_layers),
            decoder_sparse_step=self.decoder_sparse_step,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
        return config

    def hf_weights(self) -> dict[str, np.ndarray]:
        """Qwen3 weights, with each sparse layer's MLP replaced by a router and its experts."""
        weights = random_hf_weights(self)
        rng = np.random.default_rng(self.seed + 1000)
        hidden, inter = self.hidden_size, self.moe_intermediate_size
        config = self.hf_config()
        for layer in sorted(qwen3_moe.sparse_layers(lambda key, default=None: config.get(key, default))):
            prefix = f"model.layers.{layer}.mlp."
            for proj in ("gate_proj", "up_proj", "down_proj"):
                del weights[prefix + proj + ".weight"]
            weights[prefix + "gate.weight"] = rng.normal(
                0.0, self.router_scale * hidden**-0.5, (self.num_experts, hidden)
            ).astype(np.float32)
            for expert in range(self.num_experts):
                p = f"{prefix}experts.{expert}."
                weights[p + "gate_proj.weight"] = rng.normal(0.0, hidden**-0.5, (inter, hidden)).astype(np.float32)
                weights[p + "up_proj.weight"] = rng.normal(0.0, hidden**-0.5, (inter, hidden)).astype(np.float32)
                weights[p + "down_proj.weight"] = rng.normal(0.0, inter**-0.5, (hidden, inter)).astype(np.float32)
        return weights
