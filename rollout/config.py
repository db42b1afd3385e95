"""Configuration of a rollout worker."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from models import family_for, mappings_for
from models.registry import check_routing_recordable
from trainer_bridge import LoraConfig
from trainer_bridge.lora import check_unmerged_targets

from .engine import EngineOptions

# The longest pod_timeout_s: a week.
MAX_POD_TIMEOUT_S = 7 * 24 * 3600.0

# The engine's weight dtypes.
DTYPES = ("bfloat16", "float32", "float16")


@dataclasses.dataclass(frozen=True)
class WorkerConfig(EngineOptions):
    """How a :class:`rollout.RolloutWorker` starts its in-process sglang-jax engines.

    Every engine option (``EngineOptions``: dtype, KV budget, limits, tp_size, ...) is a field
    here too, by inheritance: one list of options. ``model_path`` is an HF model directory
    (``config.json``; ``model.safetensors`` unless ``load_format="dummy"``, which allocates
    random weights of the right shapes, for workers whose weights always come from
    ``sync_params``). ``max_total_tokens`` is each engine's KV cache budget in tokens: set it,
    since the engine otherwise takes a fraction of free memory.

    ``name`` prefixes the engines' names in thread names, logs and errors
    (``engine 1 (devices 2,3)``). ``dp_size`` engines run in the process, each on its own
    group of ``tp_size`` consecutive devices from ``devices`` (default: all local devices);
    ``dp_size * tp_size`` must equal the number of devices. In a multi-process job
    (``jax.distributed.initialize``) they are this process's devices: each process runs its
    own engines (docs/pods.md).
    """

    dp_size: int = 1
    # Append one JSON line per lifecycle phase (engine_ready, weights_synced, kv_dropped,
    # kv_rebuilt, generate) with its duration and a memory summary to this file.
    phase_log: str | None = None
    # Serve a context_length beyond what the model's config.json supports (max_position_embeddings,
    # times a rope-scaling factor): positions past it were never trained and outputs degrade.
    allow_long_context: bool = False
    # Admission limits of one generate call (LimitExceeded naming the setting; None: no limit):
    # rows (prompts x n), and tokens (prompt + max_new_tokens, summed over rows), which bound
    # the host memory and engine time one call can claim.
    max_rows_per_call: int | None = 65536
    max_tokens_per_call: int | None = 1 << 26
    # Multi-process jobs: how long a weight/KV call waits for every process to make the same call
    # (and, after a failed collective, for the survivors to report) before a PodError.
    pod_timeout_s: float = 60.0

    def __post_init__(self):
        positive = (
            "max_total_tokens",
            "max_running_requests",
            "max_prefill_tokens",
            "tp_size",
            "dp_size",
            "page_size",
            "max_loras",
            "decode_steps",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WorkerConfig.{name} must be a positive int, got {value!r}")
        for name in ("max_rows_per_call", "max_tokens_per_call", "session_budget_tokens", "max_session_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"WorkerConfig.{name} must be a positive int or None, got {value!r}")
        for name in ("precompile", "record_routing", "prefix_cache", "allow_long_context", "static_decode_chunks"):
            value = getattr(self, name)  # a string such as "no" would be true
            if not isinstance(value, bool) and not (name == "static_decode_chunks" and value is None):
                raise ValueError(f"WorkerConfig.{name} must be a bool, got {value!r}")
        if (
            isinstance(self.pod_timeout_s, bool)
            or not isinstance(self.pod_timeout_s, (int, float))
            or not 0 < self.pod_timeout_s <= MAX_POD_TIMEOUT_S
        ):
            # JAX's coordination service takes its waits in whole milliseconds: inf raised
            # OverflowError at the first pod call, and 1e18 s timed out at once.
            raise ValueError(
                f"WorkerConfig.pod_timeout_s must be a number of seconds in (0, {MAX_POD_TIMEOUT_S:.0f}], "
                f"got {self.pod_timeout_s!r}"
            )
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"WorkerConfig.context_length must be >= 2, got {self.context_length}")
        if self.dtype not in DTYPES:
            raise ValueError(f"WorkerConfig.dtype must be bfloat16, float32 or float16, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy", "safetensors"):
            raise ValueError(f"WorkerConfig.load_format must be auto, dummy or safetensors, got {self.load_format!r}")
        if self.unmerged_lora is not None and not isinstance(self.unmerged_lora, LoraConfig):
            raise ValueError(f"WorkerConfig.unmerged_lora must be a LoraConfig or None, got {self.unmerged_lora!r}")
        if self.max_loras > 1 and self.unmerged_lora is None:
            raise ValueError("WorkerConfig.max_loras > 1 holds several unmerged adapters: set unmerged_lora too")
        if self.max_loras > 1 and self.chunked_prefill_size <= 0:
            # Unchunked, the engine may run a prefill wider than any forward it pads to.
            raise ValueError("WorkerConfig.max_loras > 1 needs chunked_prefill_size > 0 (prefills of bounded width)")
        if self.max_loras > 1 and self.prefix_cache:
            # The radix cache keys prefixes by tokens alone: KV computed under one adapter would
            # be reused under another.
            raise ValueError(
                "WorkerConfig.max_loras > 1 needs prefix_cache=False: the engine's prefix cache keys "
                "prefixes by tokens alone, and would reuse KV computed under one adapter for another"
            )
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))
            if len(set(self.devices)) != len(self.devices):
                raise ValueError(f"WorkerConfig.devices lists a device twice: {self.devices}")

    def device_groups(self) -> list[tuple]:
        """The devices of each engine; a clear error when they do not add up."""
        devices = self.devices if self.devices is not None else tuple(jax.local_devices())
        foreign = [d for d in devices if d.process_index != jax.process_index()]
        if foreign:
            raise ValueError(
                f"WorkerConfig.devices names device(s) of other processes: "
                f"{', '.join(f'{d} (process {d.process_index})' for d in foreign)}; each process runs "
                f"engines on its own devices only (process {jax.process_index()}: "
                f"{', '.join(str(d) for d in jax.local_devices())})"
            )
        if self.dp_size * self.tp_size != len(devices):
            raise ValueError(
                f"WorkerConfig: dp_size ({self.dp_size}) x tp_size ({self.tp_size}) = "
                f"{self.dp_size * self.tp_size} devices, but the worker is given {len(devices)} "
                f"({', '.join(str(d) for d in devices)}); set devices= or change dp_size/tp_size"
            )
        return [devices[i * self.tp_size : (i + 1) * self.tp_size] for i in range(self.dp_size)]

    def engine_options(self, devices, index: int = 0) -> EngineOptions:
        """The options of engine ``index``, running on ``devices``."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineOptions)}
        # Same seed everywhere: dummy-loaded engines must start from the same weights.
        return EngineOptions(**{**shared, "devices": tuple(devices), "name": f"{self.name} {index}"})

    def check_model_dir(self) -> None:
        """A local model path must be a directory with config.json (else it is a hub id)."""
        path = Path(self.model_path)
        looks_local = path.is_absolute() or str(self.model_path).startswith(".") or path.exists()
        if looks_local and not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} does not exist or has no config.json")

    def validate(self) -> list[tuple]:
        """Checks that need the machine or the model directory, run before any engine starts.
        Returns each engine's devices. A model path that is not a local directory (an HF hub
        id) skips the model checks."""
        self.check_model_dir()
        if self.phase_log is not None and not Path(self.phase_log).parent.is_dir():
            raise ValueError(
                f"WorkerConfig.phase_log={self.phase_log!r}: its directory {str(Path(self.phase_log).parent)!r} "
                "does not exist"
            )
        groups = self.device_groups()
        check_model_family(self.model_path, self.tp_size)
        if self.record_routing:
            check_routing_recordable(self.model_path)
        if self.unmerged_lora is not None:
            check_unmerged_lora(self.model_path, self.unmerged_lora)
        limit = model_context_limit(self.model_path)
        if (
            self.context_length is not None
            and limit is not None
            and self.context_length > limit
            and not self.allow_long_context
        ):
            raise ValueError(
                f"WorkerConfig.context_length={self.context_length} exceeds the model's context length "
                f"{limit} ({Path(self.model_path) / 'config.json'}); pass allow_long_context=True to "
                "serve positions the model was not trained on"
            )
        return groups


# config.json keys the engine reads the context length from, in its order of precedence.
_CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)


def check_model_family(model_path: str, tp_size: int = 1) -> None:
    """ValueError naming the field when a local model directory's config.json asks for what the
    trainer model or the engine does not support (model_type, RoPE scaling type, head_dim), or
    has heads that ``tp_size`` devices cannot split (``models.family_for``)."""
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        family_for(json.loads(config_file.read_text()), where=str(config_file), tp_size=tp_size)


# Settings of a model's forward that its weights' shapes do not show: the engine keeps those it
# started with, so weights made for others would be served under them, silently.
_FORWARD_SETTINGS = (
    "model_type",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "num_experts_per_tok",
    "norm_topk_prob",
)


def check_same_forward(served_path: str, model_dir) -> None:
    """CheckpointError naming the fields where the HF directory ``model_dir``'s config.json sets
    the forward otherwise than the served model's (both read by transformers, defaults filled)."""
    from transformers import AutoConfig

    from trainer_bridge import CheckpointError

    served = _forward_settings(AutoConfig.from_pretrained(str(served_path)).to_dict())
    config_file = Path(model_dir) / "config.json"
    try:  # named as load_hf_params names it (transformers' own words list every model type)
        new = _forward_settings(AutoConfig.from_pretrained(str(model_dir)).to_dict())
    except (OSError, ValueError) as exc:
        reason = "no such file" if not config_file.is_file() else f"{type(exc).__name__}: {str(exc)[:200]}"
        raise CheckpointError(f"cannot read {config_file}: {reason}") from exc
    differ = [key for key in _FORWARD_SETTINGS if served.get(key) != new.get(key)]
    if differ:
        found = ", ".join(f"{key} {new.get(key)!r} (served: {served.get(key)!r})" for key in differ)
        raise CheckpointError(
            f"{config_file} sets the forward otherwise than the served model: {found}; "
            "the engine would serve these weights under the served model's settings. Start a worker on that "
            "model instead"
        )


def _forward_settings(config: dict) -> dict:
    """``config``'s forward settings as the forward reads them: an unwritten head_dim is hidden /
    heads, and rope_scaling's type may be written as ``type`` or ``rope_type`` (Qwen2.5's README
    writes the first, exports the second)."""
    settings = {key: config.get(key) for key in _FORWARD_SETTINGS}
    if settings["head_dim"] is None and config.get("hidden_size") and config.get("num_attention_heads"):
        settings["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    scaling = settings["rope_scaling"]
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        kind = scaling.pop("rope_type", None) or scaling.pop("type", None)
        scaling.pop("type", None)
        settings["rope_scaling"] = {**scaling, "rope_type": kind}
    return settings


def check_unmerged_lora(model_path: str, config: LoraConfig) -> None:
    """ValueError unless a local model directory's projections can carry the unmerged adapters
    (a hub id passes)."""
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        try:
            check_unmerged_targets(mappings_for(json.loads(config_file.read_text())), config)
        except ValueError as exc:
            raise ValueError(f"WorkerConfig.{exc} ({config_file})") from None


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
