"""Unmerged LoRA: the engine's adapted projections compute ``x @ W + scale * ((x @ A) @ B)``.

sglang-jax 0.0.2 has no LoRA of its own (its ``lora_path`` argument is passed along and read by
no layer), so an engine started with ``EngineOptions.unmerged_lora`` gets two more weight leaves
on each adapted linear layer, ``<module>.lora_a`` [in, r] and ``<module>.lora_b`` [r, out], both
float32 and zero (the adapter is off until a sync fills them); with ``max_loras`` slots, one
such pair per slot (``lora_a_1``, ...) and each token's slot in one more leaf. They are attached
when the model is loaded, before the forward is traced, so the compiled forward reads them like
any other weight leaf: a sync that swaps them moves only adapter bytes and recompiles nothing. Which layers carry
them is the mapping table's business (``trainer_bridge.lora.adapter_mappings``: the projection kernels
whose module is targeted); every one of them must be one of the engine's ``LinearBase`` layers.

Placement follows the layer's weight: A is split like the weight's input axis and B like its
output axis, so a column-parallel projection's adapter output is split as its own output is and
a row-parallel one's partial sums are reduced with the layer's own.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from trainer_bridge import LoraConfig
from trainer_bridge.lora import adapter_mappings

from .programs import forward_cells
from .types import EngineError

# The factors are kept in float32 whatever the model's dtype: trainers train them in float32, so
# a sync can use their arrays as they are, and rank-r matmuls cost little.
ADAPTER_DTYPE = jnp.float32

# The model state leaf holding each token's adapter slot (engines with several slots).
TOKEN_SLOTS = "lora_token_slots"


def adapted_modules(hf_config, config: LoraConfig) -> list[str]:
    """The engine module paths (``transformer.layers.0.self_attn.q_proj``) that carry adapters."""
    from models import mappings_for

    entries = adapter_mappings(mappings_for(hf_config), config)
    return [m.engine.removesuffix(".lora_a") for m in entries if m.engine.endswith(".lora_a")]


def factor_names(slot: int) -> tuple[str, str]:
    """The leaf names of slot ``slot``'s factors: ``lora_a``/``lora_b`` for the default slot 0,
    ``lora_a_1``/``lora_b_1`` for slot 1, ..."""
    suffix = f"_{slot}" if slot else ""
    return f"lora_a{suffix}", f"lora_b{suffix}"


def in_slot(path: str, slot: int) -> str:
    """A factor's path (``<module>.lora_a`` or ``lora_b``) as slot ``slot`` names it."""
    module, _, name = path.rpartition(".")
    return f"{module}.{factor_names(slot)[name == 'lora_b']}"


def attach_adapters(model, modules: list[str], config: LoraConfig, slots: int = 1, max_tokens: int = 0) -> None:
    """Give each named ``LinearBase`` of the engine's nnx ``model`` zero adapter factors, one
    pair per slot. With several slots the model also gets ``lora_token_slots`` [max_tokens]:
    each token's slot, written before every forward (:func:`write_token_slots`)."""
    from flax import nnx
    from sgl_jax.srt.layers.linear import LinearBase

    by_path = {".".join(str(part) for part in path): node for path, node in nnx.iter_graph(model)}
    sharding = None
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
        for slot in range(slots):
            a_name, b_name = factor_names(slot)
            for name, shape, factor_spec in (
                (a_name, (in_dim, config.rank), PartitionSpec(in_axis, None)),
                (b_name, (config.rank, out_dim), PartitionSpec(None, out_axis)),
            ):
                placed = _placed_like(sharding, factor_spec)
                setattr(layer, name, nnx.Param(jax.device_put(np.zeros(shape, ADAPTER_DTYPE), placed)))
        layer.lora_scale = float(config.scale)
        layer.lora_slots = slots
    if slots > 1:
        ids = jax.device_put(np.zeros(max_tokens, np.int32), _placed_like(sharding, PartitionSpec()))
        setattr(model, TOKEN_SLOTS, nnx.Variable(ids))
        _patch_model_call(type(model))


def write_token_slots(scheduler, batch, slot_of_request: dict[str, int], leaf_index: int) -> None:
    """Before ``batch``'s forward (scheduler thread): each of its tokens' slot, in the order
    the forward lays them out (a prefill's requests' new tokens one after another, a decode's
    one token per request), padded with slot 0, into the forward's ``lora_token_slots`` leaf."""
    runner = scheduler.tp_worker.worker.model_runner
    slots = [slot_of_request.get(req.rid, 0) for req in batch.reqs]
    counts = batch.extend_lens if batch.forward_mode.is_extend() else [1] * len(slots)
    leaves = forward_cells(runner)["model_state_leaves"].cell_contents
    current = leaves[leaf_index]
    ids = np.zeros(current.shape, np.int32)
    tokens = np.repeat(np.asarray(slots, np.int32), counts)
    if len(tokens) > len(ids):
        raise EngineError(f"unmerged LoRA: a forward of {len(tokens)} tokens, past the {len(ids)} the slots leaf holds")
    ids[: len(tokens)] = tokens
    leaves[leaf_index] = jax.device_put(ids, current.sharding)


_trace = threading.local()


def _patch_model_call(model_class) -> None:
    """The model's forward makes its tokens' slots visible to its linear layers while traced."""
    if getattr(model_class, "_rollout_lora_slots", False):
        return
    call = model_class.__call__

    def __call__(self, forward_batch, *args, **kwargs):
        slots = getattr(self, TOKEN_SLOTS, None)
        if slots is None:
            return call(self, forward_batch, *args, **kwargs)
        previous = getattr(_trace, "slots", None)
        _trace.slots = slots.value[: forward_batch.input_ids.shape[0]]
        try:
            return call(self, forward_batch, *args, **kwargs)
        finally:
            _trace.slots = previous

    model_class.__call__ = __call__
    model_class._rollout_lora_slots = True


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
        if getattr(self, "lora_a", None) is None:
            return output, bias
        # HIGHEST: a 16-bit engine keeps the default precision, in which TPUs and GPUs would
        # multiply the float32 factors in one bfloat16 (TF32) pass; at rank r this costs little.
        highest = jax.lax.Precision.HIGHEST
        x = x.astype(ADAPTER_DTYPE)
        slots = getattr(_trace, "slots", None) if self.lora_slots > 1 else None
        if self.lora_slots > 1 and slots is None:
            raise EngineError("unmerged LoRA: a layer with several adapter slots traced outside its model's forward")
        delta = 0.0
        for slot in range(self.lora_slots):
            a_name, b_name = factor_names(slot)
            low_rank = jnp.dot(x, getattr(self, a_name).value, precision=highest)
            term = jnp.dot(low_rank, getattr(self, b_name).value, precision=highest)
            # Each token takes its own slot's term, selected after the product: rows zeroed
            # before it still met every factor of the slot, and a NaN there (adapters synced
            # with check_finite=False) made 0 * NaN of every other adapter's tokens.
            delta = term if slots is None else jnp.where((slots == slot)[:, None], term, delta)
        return output + (self.lora_scale * delta).astype(output.dtype), bias

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
            args = self.server_args
            max_tokens = max(args.max_prefill_tokens, args.chunked_prefill_size, args.max_running_requests)
            modules = adapted_modules(self.model_config.hf_config, config)
            attach_adapters(self.model, modules, config, start_up.max_loras, max_tokens)

    return load_model_with_adapters
