"""Plain types and facts shared by the engine modules (no sgl_jax import): options, outputs,
errors, names."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from trainer_bridge import LoraConfig

from ..errors import RolloutError

# Seconds without progress on a running forward after which the watchdog fails the engine.
DEFAULT_WATCHDOG_TIMEOUT_S = 1800.0


class EngineError(RolloutError, RuntimeError):
    """The engine failed: its scheduler thread raised, or it was used after it stopped."""


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What the engine is started with (a subset of sglang-jax's ServerArgs)."""

    model_path: str
    dtype: str = "bfloat16"
    tp_size: int = 1
    max_total_tokens: int = 4096
    context_length: int | None = None
    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    chunked_prefill_size: int = 2048
    page_size: int = 1
    seed: int = 0
    load_format: str = "auto"
    precompile: bool = False
    precompile_token_paddings: tuple[int, ...] | None = None
    precompile_bs_paddings: tuple[int, ...] | None = None
    attention_backend: str | None = None
    device: str | None = None
    watchdog_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S
    # The devices the engine's mesh spans, in mesh order (tp_size of them); None: all devices.
    devices: tuple[jax.Device, ...] | None = None
    # Names the engine in its thread names, logs and errors ("engine 1" -> "engine 1 (devices 2,3)").
    name: str = "engine"
    # MoE models: record the experts every token is routed to, so that generate(...,
    # return_routing=True) can return them (routing replay, rollout/engine/routing.py). Costs a
    # small fetch per forward and a host table of (KV slots x MoE layers x top-k) ids.
    record_routing: bool = False
    # Sessions (multi-turn conversations, rollout/engine/sessions.py): the tokens all their
    # pinned prefixes may hold together (None: half the KV pool), and one session's (None: no
    # bound but the total).
    session_budget_tokens: int | None = None
    max_session_tokens: int | None = None
    # False: no prefix cache; every request prefills its whole prompt (a baseline for what the
    # cache saves; sessions then pin nothing).
    prefix_cache: bool = True
    # LoRA adapters computed unmerged (rollout/engine/lora.py): each targeted projection gets
    # zero float32 factors A [in, r] and B [r, out] beside its weight, and computes
    # x @ W + (alpha / r) * (x @ A) @ B; a sync then moves only the factors. None: no adapters
    # in the engine (a LoRA sync merges them into the weights).
    unmerged_lora: LoraConfig | None = None
    # Adapter sets an unmerged engine holds at once (vLLM's max_loras): slot 0 is the default
    # one, the others are named (generate(..., lora=name)); each request's tokens use its own.
    max_loras: int = 1
    # Decode steps per dispatch (rollout/engine/multistep.py): a running batch's decode runs
    # this many steps in one compiled loop and the scheduler takes each step's ids from it, so
    # its Python leaves the path between forwards. 1: one forward per scheduler step (0.0.2's).
    # On the native or the fa attention backend; not with record_routing or max_loras > 1.
    decode_steps: int = 1
    # Decode chunks whose loop waits on the host only between its steps: each layer's attention
    # walks a number of KV chunks fixed at dispatch, and the draw (greedy, sampled, filtered) is
    # chosen on the host, for one program per batch size, draw and doubling of the rows'
    # context (compiled at start-up with precompile, else when first met) in place of one per
    # batch size (a filtering draw keeps the filters' conditionals). XLA's GPU backend drives a
    # loop of unknown trip count, and a conditional, from the host, copying its predicate back
    # and waiting at every iteration; TPU and CPU run them inside the program. None: on GPU
    # only (static_decode_chunks).
    static_decode_chunks: bool | None = None

    def __post_init__(self):
        if self.devices is None:
            return
        devices = tuple(self.devices)
        object.__setattr__(self, "devices", devices)
        if not devices or not all(isinstance(d, jax.Device) for d in devices):
            raise ValueError(f"EngineOptions.devices must be a non-empty sequence of jax.Device, got {devices!r}")
        if len(set(devices)) != len(devices):
            raise ValueError(f"EngineOptions.devices lists a device twice: {_device_ids(devices)}")
        if len(devices) != self.tp_size:
            raise ValueError(
                f"EngineOptions.devices has {len(devices)} devices ({_device_ids(devices)}) but "
                f"tp_size is {self.tp_size}: an engine's mesh is its tp_size devices"
            )


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """One finished request as the engine returned it."""

    output_ids: list[int]
    finish_reason: str
    completion_tokens: int
    cache_miss_count: int
    # Prompt tokens found in the prefix cache (the engine's count: a request it retracted and
    # prefilled again counts each admission's hits, and may pass its prompt's length). For the
    # samples of a prompt prefilled first on its own (n > 1), what the cache held before that.
    cached_tokens: int = 0
    # Tokens this request's prefills computed (its prompt less what the cache held; a retracted
    # request's prefill again of its prompt and sampled tokens added). Our count, exact. The
    # first sample of a prompt prefilled on its own also counts that prefill.
    prefill_tokens: int = 0
    # Log-prob of each output token under the distribution it was drawn from (requested only).
    logprobs: list[float] | None = None
    # Weight version of the forward that sampled each output token.
    token_versions: list[int] | None = None
    # With logprobs: how many tokens the distribution of each output token kept after top-k,
    # top-p and min-p (the vocabulary size where nothing was filtered).
    kept_counts: list[int] | None = None
    # With routing asked for: [prompt + completion tokens - 1, MoE layers, top_k] expert ids of
    # every position the engine took as input (routing.RoutingSink); None if the engine aborted it.
    routed_experts: np.ndarray | None = None


class TokenLogprobSink:
    """One request's sampled tokens as the patched sampler records them on the scheduler
    thread: each token's log-prob and its distribution's kept count."""

    __slots__ = ("logprobs", "kept_counts")

    def __init__(self):
        self.logprobs: list[float] = []
        self.kept_counts: list[int] = []

    def append(self, logprob: float, kept: int) -> None:
        self.logprobs.append(logprob)
        self.kept_counts.append(kept)

    def __len__(self) -> int:
        return len(self.logprobs)

    def first(self, count: int) -> dict:
        """The GenerateOutput fields of the first ``count`` tokens."""
        return {"logprobs": self.logprobs[:count], "kept_counts": self.kept_counts[:count]}


def _device_ids(devices) -> str:
    return ",".join(str(d.id) for d in devices)


def engine_name(name: str, devices) -> str:
    """How an engine is named in errors and thread names: ``engine 1 (devices 2,3)``."""
    return f"{name} (devices {_device_ids(devices)})"


@dataclasses.dataclass(frozen=True)
class ForwardMemory:
    """XLA's memory analysis of one compiled forward pass, bytes per device."""

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
