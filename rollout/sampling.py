"""Sampling parameters and prompt checks: every generate argument is validated here, once.

Nothing is coerced silently: a float where an int is expected, a bool, a nested list or bytes
is an error naming the argument (``prompts[3]``), never a truncated or flattened value.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np

from .errors import InvalidRequest

# Seeds travel to the engine as int32.
MAX_SAMPLING_SEED = 2**31 - 1


def _as_int(name: str, value, *, minimum: int | None = None) -> int:
    """An int (Python or numpy integer, not bool), or InvalidRequest naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidRequest(name, f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidRequest(name, f"{name} must be >= {minimum}, got {value}")
    return value


def _as_float(name: str, value) -> float:
    """A finite real number (int, float or numpy scalar, not bool), or InvalidRequest."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidRequest(name, f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidRequest(name, f"{name} must be finite, got {value}")
    return value


def token_id_list(name: str, values, vocab_size: int) -> tuple[int, ...]:
    """A flat sequence of token ids in ``[0, vocab_size)``: ints only, no floats, bools,
    strings, bytes or nesting."""
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, (Sequence, np.ndarray)):
        raise InvalidRequest(name, f"{name} must be a list of token ids, got {type(values).__name__}")
    if isinstance(values, np.ndarray) and values.ndim != 1:
        raise InvalidRequest(name, f"{name} must be a flat list of token ids, got an array of shape {values.shape}")
    ids = []
    for j, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise InvalidRequest(
                name, f"{name}[{j}] must be an int token id, got {value!r} ({type(value).__name__})"
            )
        ids.append(int(value))
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(name, f"{name} has token ids outside [0, {vocab_size}): {bad[:5]}")
    return tuple(ids)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample: validated on construction, immutable afterwards.

    ``temperature=0`` is greedy decoding. ``top_k=-1`` keeps every token. ``seed=None`` lets
    the worker draw a fresh seed for the call. ``stop_token_ids`` end a completion (the stop
    token is kept in it); the worker adds the model's EOS ids unless ``ignore_eos``.
    ``return_logprobs`` asks for the log-probability of every sampled token.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    return_logprobs: bool = False

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "n", _as_int("n", self.n, minimum=1))
        set_(self, "max_new_tokens", _as_int("max_new_tokens", self.max_new_tokens, minimum=1))
        temperature = _as_float("temperature", self.temperature)
        if temperature < 0:
            raise InvalidRequest("temperature", f"temperature must be >= 0, got {temperature}")
        set_(self, "temperature", temperature)
        top_p = _as_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise InvalidRequest("top_p", f"top_p must be in (0, 1], got {top_p}")
        set_(self, "top_p", top_p)
        top_k = _as_int("top_k", self.top_k)
        if top_k < 1 and top_k != -1:
            raise InvalidRequest("top_k", f"top_k must be -1 (all tokens) or >= 1, got {top_k}")
        set_(self, "top_k", top_k)
        min_p = _as_float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise InvalidRequest("min_p", f"min_p must be in [0, 1], got {min_p}")
        set_(self, "min_p", min_p)
        for flag in ("ignore_eos", "return_logprobs"):
            if not isinstance(getattr(self, flag), (bool, np.bool_)):
                raise InvalidRequest(flag, f"{flag} must be a bool, got {getattr(self, flag)!r}")
            set_(self, flag, bool(getattr(self, flag)))
        if self.seed is not None:
            seed = _as_int("seed", self.seed)
            if not 0 <= seed <= MAX_SAMPLING_SEED:
                raise InvalidRequest("seed", f"seed must be in [0, {MAX_SAMPLING_SEED}], got {seed}")
            set_(self, "seed", seed)
        stop = self.stop_token_ids
        if stop is None:
            stop = ()
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (Sequence, np.ndarray)):
            raise InvalidRequest("stop_token_ids", f"stop_token_ids must be a list of token ids, got {stop!r}")
        ids = []
        for j, value in enumerate(stop):
            ids.append(_as_int(f"stop_token_ids[{j}]", value, minimum=0))
        set_(self, "stop_token_ids", tuple(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def row_seeds(seed: int, num_prompts: int, n: int, *, first_prompt: int = 0) -> np.ndarray:
    """[num_prompts, n] int64 sampling seeds: sample ``j`` of prompt ``i`` gets a seed derived
    from ``(seed, first_prompt + i, j)`` alone, so its samples depend neither on the other
    prompts of the call nor on ``n`` nor on how rows are split over engines."""
    seeds = np.empty((num_prompts, n), dtype=np.int64)
    for i in range(num_prompts):
        for j in range(n):
            word = np.random.SeedSequence([seed, first_prompt + i, j]).generate_state(1, dtype=np.uint32)[0]
            seeds[i, j] = int(word) & MAX_SAMPLING_SEED
    return seeds


def prompt_token_ids(prompts, *, vocab_size: int, tokenizer=None, model_path: str = "") -> list[list[int]]:
    """Token ids of each prompt: strings are encoded with ``tokenizer``; id lists are checked
    (ints in the vocabulary, flat, non-empty). Errors name ``prompts[i]``."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InvalidRequest(
            "prompts", f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise InvalidRequest("prompts", "prompts is empty")
    ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise InvalidRequest(
                    f"prompts[{i}]",
                    f"prompts[{i}] is a string but the model directory {model_path} has no "
                    "tokenizer: pass token ids"
                )
            tokens = list(tokenizer.encode(prompt, add_special_tokens=False))
        else:
            tokens = list(token_id_list(f"prompts[{i}]", prompt, vocab_size))
        if not tokens:
            raise InvalidRequest(f"prompts[{i}]", f"prompts[{i}] is empty")
        ids.append(tokens)
    return ids


def check_request_lengths(
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    context_length: int,
    max_request_tokens: int,
    max_prompt_tokens: int,
    kv_pool_tokens: int,
) -> None:
    """Every request must fit whole: a request that cannot would be cut short by the engine
    (finish reason "length") with no error. Limits as the engine enforces them."""
    for i, tokens in enumerate(prompt_ids):
        if len(tokens) > max_prompt_tokens:
            raise InvalidRequest(
                f"prompts[{i}]",
                f"prompts[{i}] has {len(tokens)} tokens; the engine accepts prompts of at most "
                f"{max_prompt_tokens} tokens (context length {context_length}, KV pool "
                f"{kv_pool_tokens} tokens)"
            )
        total = len(tokens) + max_new_tokens
        if total > max_request_tokens:
            limit = (
                f"the context length {context_length}"
                if context_length <= kv_pool_tokens
                else f"the KV cache pool of {kv_pool_tokens} tokens (WorkerConfig.max_total_tokens)"
            )
            raise InvalidRequest(
                "max_new_tokens",
                f"prompts[{i}] has {len(tokens)} tokens and max_new_tokens={max_new_tokens}: "
                f"{total} tokens do not fit {limit}; at most {max_request_tokens} tokens per "
                "request (prompt + completion)"
            )
