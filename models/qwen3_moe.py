"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (qk-norm, no biases), and in each
sparse layer a router (``mlp.gate``) over ``num_experts`` SwiGLU experts of which
``num_experts_per_tok`` run per token. Trainer (MLLM-JAX layout) <-> HF <-> sglang-jax 0.0.2 names.

The trainer and the engine both keep each layer's experts stacked in one array, expert first:
``gate_proj`` / ``up_proj`` [E, hidden, moe_intermediate], ``down_proj`` [E, moe_intermediate,
hidden] (the engine's ``wi_0``, ``wi_1``, ``wo``, sharded over experts); HF keeps one [out, in]
tensor per expert. Dense layers (``mlp_only_layers``, and those ``decoder_sparse_step`` skips)
have Qwen3's MLP.
"""

import dataclasses
from collections.abc import Callable

from .mapping import Condition, EngineTransform, ParamMapping
from .qwen3 import MAPPING as QWEN3_MAPPING

T = EngineTransform
SPARSE = Condition.SPARSE_LAYER

MODEL_TYPE = "qwen3_moe"

_ROUTER_AND_EXPERTS = (
    ParamMapping(
        "model.layers_{layer}.mlp.gate.kernel",
        "transformer.layers.{layer}.moe_gate.kernel",
        "model.layers.{layer}.mlp.gate.weight",
        hf_transposed=True,
        condition=SPARSE,
    ),
    ParamMapping(
        "model.layers_{layer}.mlp.gate_proj",
        "transformer.layers.{layer}.mlp.wi_0",
        "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        hf_transposed=True,
        condition=SPARSE,
    ),
    ParamMapping(
        "model.layers_{layer}.mlp.up_proj",
        "transformer.layers.{layer}.mlp.wi_1",
        "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        hf_transposed=True,
        condition=SPARSE,
    ),
    ParamMapping(
        "model.layers_{layer}.mlp.down_proj",
        "transformer.layers.{layer}.mlp.wo",
        "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
        hf_transposed=True,
        condition=SPARSE,
    ),
)


def _from_qwen3(entry: ParamMapping) -> ParamMapping:
    """Qwen3's entry as Qwen3-MoE has it: the dense MLP only in dense layers, and the engine
    names the attention output projection ``c_proj``."""

    if ".mlp." in entry.trainer:
        return dataclasses.replace(entry, condition=Condition.DENSE_LAYER)
    if ".o_proj." in entry.engine:
        return dataclasses.replace(entry, engine=entry.engine.replace(".o_proj.", ".c_proj."))
    return entry


MAPPING = tuple(_from_qwen3(entry) for entry in QWEN3_MAPPING) + _ROUTER_AND_EXPERTS


def sparse_layers(get: Callable[[str, object], object]) -> frozenset[int]:
    """The layers with a routed expert block, by HF transformers' rule: every
    ``decoder_sparse_step``-th layer (1-based) not in ``mlp_only_layers``, when
    ``num_experts > 0``. ``get(key, default)`` reads the HF config."""
    num_layers = int(get("num_hidden_layers", 0))
    step = int(get("decoder_sparse_step", 1) or 1)
    dense = {int(layer) for layer in (get("mlp_only_layers", None) or ())}
    if int(get("num_experts", 0) or 0) <= 0:
        return frozenset()
    return frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def check_config(get: Callable[[str, object], object]) -> None:
    """ValueError for a Qwen3-MoE config the engine and the trainer model cannot both serve."""
    experts, top_k = int(get("num_experts", 0) or 0), int(get("num_experts_per_tok", 0) or 0)
    if experts and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={experts} for qwen3_moe")
