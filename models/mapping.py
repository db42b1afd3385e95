"""Mapping-table entries: how one trainer parameter relates to an HF tensor and an engine leaf.

Tables are plain data (tuples of :class:`ParamMapping`), one module per architecture. Names may
contain ``{layer}``, expanded for every decoder layer; an HF name may contain ``{expert}``: the
trainer and engine keep those experts stacked in one array (leading axis), HF one tensor each.
"""

from __future__ import annotations

import dataclasses
import enum


class EngineTransform(enum.Enum):
    """What turns a trainer parameter into the engine's leaf (a dtype cast may come on top)."""

    IDENTITY = "identity"
    TRANSPOSE = "transpose"  # 2-D: trainer [a, b] -> engine [b, a]
    # k/v projections: the engine repeats each KV head when tp_size > num_key_value_heads.
    REPEAT_KV_HEADS = "repeat_kv_heads"


class Condition(enum.Enum):
    ALWAYS = "always"
    UNTIED = "untied"  # only when tie_word_embeddings is false
    # Mixture-of-experts models: layers with a routed expert block, and those with a dense MLP.
    SPARSE_LAYER = "sparse_layer"
    DENSE_LAYER = "dense_layer"


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    trainer: str  # "model.layers_{layer}.self_attn.q_proj.kernel"
    engine: str  # "transformer.layers.{layer}.self_attn.q_proj.weight"
    hf: str  # "model.layers.{layer}.self_attn.q_proj.weight"
    engine_transform: EngineTransform = EngineTransform.IDENTITY
    hf_transposed: bool = False  # HF stores linear weights [out, in], the trainer [in, out]
    condition: Condition = Condition.ALWAYS

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.trainer

    @property
    def stacked_experts(self) -> bool:
        """HF stores one tensor per expert (``hf`` names ``{expert}``); stacked on axis 0 here."""
        return "{expert}" in self.hf


def expand_mappings(
    table, *, num_layers: int, tied: bool, sparse_layers: frozenset[int] = frozenset()
) -> list[ParamMapping]:
    """Concrete entries for a model with ``num_layers`` layers, in table order.

    ``sparse_layers``: the layers with a routed expert block (the others have a dense MLP).
    """
    entries = []
    for entry in table:
        if entry.condition is Condition.UNTIED and tied:
            continue
        layers = range(num_layers) if entry.per_layer else [None]
        if entry.condition is Condition.SPARSE_LAYER:
            layers = [layer for layer in layers if layer in sparse_layers]
        elif entry.condition is Condition.DENSE_LAYER:
            layers = [layer for layer in layers if layer not in sparse_layers]
        for layer in layers:
            if layer is None:
                entries.append(entry)
            else:
                entries.append(
                    dataclasses.replace(
                        entry,
                        trainer=entry.trainer.format(layer=layer),
                        engine=entry.engine.format(layer=layer),
                        hf=entry.hf.format(layer=layer, expert="{expert}"),
                    )
                )
    return entries
