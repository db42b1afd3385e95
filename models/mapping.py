"""Mapping-table entries: how one trainer parameter relates to an HF tensor and an engine leaf.

Tables are plain data (tuples of :class:`ParamMapping`), one module per architecture. Names may
contain ``{layer}``, expanded for every decoder layer.
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


def expand_mappings(table, *, num_layers: int, tied: bool) -> list[ParamMapping]:
    """Concrete entries for a model with ``num_layers`` layers, in table order."""
    entries = []
    for entry in table:
        if entry.condition is Condition.UNTIED and tied:
            continue
        layers = range(num_layers) if entry.per_layer else [None]
        for layer in layers:
            if layer is None:
                entries.append(entry)
            else:
                entries.append(
                    dataclasses.replace(
                        entry,
                        trainer=entry.trainer.format(layer=layer),
                        engine=entry.engine.format(layer=layer),
                        hf=entry.hf.format(layer=layer),
                    )
                )
    return entries
