"""Configuration of a rollout worker."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from .engine import DEFAULT_WATCHDOG_TIMEOUT_S, EngineOptions


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """How a :class:`rollout.RolloutWorker` starts its in-process sglang-jax engine.

    ``model_path`` is an HF model directory (``config.json``; ``model.safetensors`` unless
    ``load_format="dummy"``, which allocates random weights of the right shapes, for workers
    whose weights always come from ``sync_params``). ``max_total_tokens`` is the KV cache
    budget in tokens: set it, since the engine otherwise takes a fraction of free memory.
    """

    model_path: str
    dtype: str = "bfloat16"
    max_total_tokens: int = 4096
    context_length: int | None = None
    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    chunked_prefill_size: int = 2048
    tp_size: int = 1
    seed: int = 0
    load_format: str = "auto"
    page_size: int = 1
    # Compile the forward for the engine's padding buckets at start-up instead of on first use.
    precompile: bool = False
    precompile_token_paddings: tuple[int, ...] | None = None
    precompile_bs_paddings: tuple[int, ...] | None = None
    watchdog_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S
    attention_backend: str | None = None
    # Append one JSON line per lifecycle phase (engine_ready, weights_synced, kv_dropped,
    # kv_rebuilt, generate) with its duration and a memory summary to this file.
    phase_log: str | None = None
    # Serve a context_length beyond what the model's config.json supports (max_position_embeddings,
    # times a rope-scaling factor): positions past it were never trained and outputs degrade.
    allow_long_context: bool = False

    def __post_init__(self):
        positive = ("max_total_tokens", "max_running_requests", "max_prefill_tokens", "tp_size", "page_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"WorkerConfig.{name} must be a positive int, got {value!r}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"WorkerConfig.context_length must be >= 2, got {self.context_length}")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"WorkerConfig.dtype must be bfloat16, float32 or float16, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy", "safetensors"):
            raise ValueError(f"WorkerConfig.load_format must be auto, dummy or safetensors, got {self.load_format!r}")

    def validate(self, devices: Sequence | None = None) -> None:
        """Checks that need the machine or the model directory; run before the engine starts.

        ``devices`` are the devices the engine will use (default: ``jax.devices()``). A model
        path that is not a local directory (an HF hub id) skips the model checks.
        """
        if devices is None:
            import jax

            devices = jax.devices()
        if self.tp_size > len(devices):
            raise ValueError(
                f"WorkerConfig.tp_size={self.tp_size} needs {self.tp_size} devices, but only "
                f"{len(devices)} are available ({devices[0].platform}: {len(devices)} device(s))"
            )
        limit = model_context_limit(self.model_path)
        if self.context_length is not None and limit is not None and self.context_length > limit and not self.allow_long_context:
            raise ValueError(
                f"WorkerConfig.context_length={self.context_length} exceeds the model's context length "
                f"{limit} ({Path(self.model_path) / 'config.json'}); pass allow_long_context=True to "
                "serve positions the model was not trained on"
            )

    def engine_options(self) -> EngineOptions:
        """The engine's settings, after :meth:`validate` (the worker starts the engine from these)."""
        self.validate()
        return EngineOptions(
            model_path=str(self.model_path),
            dtype=self.dtype,
            tp_size=self.tp_size,
            max_total_tokens=self.max_total_tokens,
            context_length=self.context_length,
            max_running_requests=self.max_running_requests,
            max_prefill_tokens=self.max_prefill_tokens,
            chunked_prefill_size=self.chunked_prefill_size,
            page_size=self.page_size,
            seed=self.seed,
            load_format=self.load_format,
            precompile=self.precompile,
            precompile_token_paddings=self.precompile_token_paddings,
            precompile_bs_paddings=self.precompile_bs_paddings,
            watchdog_timeout_s=self.watchdog_timeout_s,
            attention_backend=self.attention_backend,
        )


# config.json keys the engine reads the context length from, in its order of precedence.
_CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")


def model_context_limit(model_path: str) -> int | None:
    """The longest context a local model directory's config.json supports, as the engine derives
    it (a rope-scaling ``factor`` extends it unless ``original_max_position_embeddings`` is
    given or the rope type is llama3); None for a hub id or a config without such a key."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    scaling = config.get("rope_scaling") or {}
    factor = scaling.get("factor", 1)
    if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
        factor = 1
    for key in _CONTEXT_LENGTH_KEYS:
        if config.get(key) is not None:
            return int(factor * config[key])
    return None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(model_path: str) -> bool:
    """False for a local model directory without tokenizer files (then prompts are token ids).

    A path that is not a local directory (an HF hub id) is assumed to have a tokenizer.
    """
    path = Path(model_path)
    if not path.is_dir():
        return True
    return any((path / name).exists() for name in _TOKENIZER_FILES)
