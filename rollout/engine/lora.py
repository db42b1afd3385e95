"""Unmerged LoRA: the engine's adapted projections compute ``x @ W + scale * ((x @ A) @ B)``.

sglang-jax 0.0.2 has no LoRA of its own (its ``lora_path`` argument is passed along and read by
no layer), so an engine started with ``EngineOptions.unmerged_lora`` gets two more weight leaves
on each adapted linear layer, ``<module>.lora_a`` [in, r] and ``<module>.lora_b`` [r, out], both
float32 and zero (the adapter is off until a sync fills them). They are attached when the model
is loaded, before the forward is traced, so the compiled forward reads them like any other weight
leaf: a sync that swaps them moves only adapter bytes and recompiles nothing. Which layers carry
them is the mapping table's business (``trainer_bridge.adapter_mappings``: the projection kernels
whose module is targeted); every one of them must be one of the engine's ``LinearBase`` layers.

Placement follows the layer's weight: A is split like the weight's input axis and B like its
output axis, so a column-parallel projection's adapter output is split as its own output is and
a row-parallel one's partial sums are reduced with the layer's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from trainer_bridge import LoraConfig, adapter_mappings

from .types import EngineError

# The factors are kept in float32 whatever the model's dtype: trainers train them in float32, so
# a sync can use their arrays as they are, and rank-r matmuls cost little.
ADAPTER_DTYPE = jnp.float32


def adapted_modules(hf_config, config: LoraConfig) -> list[str]:
    """The engine module paths (``transformer.layers.0.self_attn.q_proj``) that carry adapters."""
    from models import mappings_for

    entries = adapter_mappings(mappings_for(hf_config), config)
    return [m.engine.removesuffix(".lora_a") for m in entries if m.engine.endswith(".lora_a")]


def attach_adapters(model, modules: list[str], config: LoraConfig) -> None:
    """Give each named ``LinearBase`` of the engine's nnx ``model`` zero adapter factors."""
    from flax import nnx
    from sgl_jax.srt.layers.linear import LinearBase

    by_path = {".".join(str(part) for part in path): node for path, node in nnx.iter_graph(model)}
    for path in modules:
        layer = by_path.get(path)
        if not isinstance(layer, LinearBase):
            found = type(layer).__name__ if layer is not None else "nothing"
            raise EngineError(f"unmerged LoRA: engine module '{path}' is {found}, not a linear layer")
        weight = layer.weight.value
        in_dim, out_dim = weight.shape
        sharding = weight.sharding
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        in_axis, out_axis = (tuple(spec) + (None, None))[:2]
        for name, shape, factor_spec in (
            ("lora_a", (in_dim, config.rank), PartitionSpec(in_axis, None)),
            ("lora_b", (config.rank, out_dim), PartitionSpec(None, out_axis)),
        ):
            placed = _placed_like(sharding, factor_spec)
            setattr(layer, name, nnx.Param(jax.device_put(np.zeros(shape, ADAPTER_DTYPE), placed)))
        layer.lora_scale = float(config.scale)


def _placed_like(sharding, spec: PartitionSpec):
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, spec)
    return sharding


def patch_unmerged_lora() -> None:
    """``LinearBase.__call__`` adds the adapter term on the layers that carry adapters, and
    ``ModelRunner.load_model`` attaches them to the model of an engine started with them."""
    from sgl_jax.srt.layers.linear import LinearBase
    from sgl_jax.srt.model_executor import model_runner

    LinearBase.__call__ = _with_adapter(LinearBase.__call__)
    model_runner.ModelRunner.load_model = _attach_on_load(model_runner.ModelRunner.load_model)


def _with_adapter(call):
    def __call__(self, x):
        output, bias = call(self, x)
        lora_a = getattr(self, "lora_a", None)
        if lora_a is None:
            return output, bias
        # HIGHEST: a 16-bit engine keeps the default precision, in which TPUs and GPUs would
        # multiply the float32 factors in one bfloat16 (TF32) pass; at rank r this costs little.
        highest = jax.lax.Precision.HIGHEST
        low_rank = jnp.dot(x.astype(ADAPTER_DTYPE), lora_a.value, precision=highest)
        delta = self.lora_scale * jnp.dot(low_rank, self.lora_b.value, precision=highest)
        return output + delta.astype(output.dtype), bias

    return __call__


def _attach_on_load(load_model):
    """``ModelRunner.load_model`` wrapper: attaches the adapters of the engine being started
    (its ``StartUp.unmerged_lora``) once the model is loaded, before its forward is traced."""
    from .start_up import current_start_up

    def load_model_with_adapters(self):
        load_model(self)
        start_up = current_start_up()
        config = None if start_up is None else start_up.unmerged_lora
        if config is not None:
            attach_adapters(self.model, adapted_modules(self.model_config.hf_config, config), config)

    return load_model_with_adapters
