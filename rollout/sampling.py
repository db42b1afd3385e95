"""Sampling parameters and prompt checks: every generate argument is validated here, once.

Nothing is coerced silently: a float where an int is expected, a bool, a nested list or bytes
is an error naming the argument (``prompts[3]``), never a truncated or flattened value.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from models.registry import check_routing_recordable

from .engine.workarounds import workaround_enabled
from .errors import InvalidRequest, check_limit

# Seeds travel to the engine as int32; a call's seed may be any int64 (row seeds derive from it).
MAX_SAMPLING_SEED = 2**31 - 1
CALL_SEED_RANGE = (-(2**63), 2**63 - 1)


def as_int(name: str, value, *, minimum: int | None = None) -> int:
    """An int (Python or numpy integer, not bool), or InvalidRequest naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidRequest(name, f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidRequest(name, f"{name} must be >= {minimum}, got {value}")
    return value


def as_call_seed(value) -> int:
    """A call's seed: an int64, or InvalidRequest (a wider one would wrap onto another's draws)."""
    seed = as_int("seed", value)
    low, high = CALL_SEED_RANGE
    if not low <= seed <= high:
        raise InvalidRequest("seed", f"seed must be an int64 (in [{low}, {high}]), got {seed}")
    return seed


def _as_float(name: str, value) -> float:
    """A finite real number (int, float or numpy scalar, not bool), or InvalidRequest."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidRequest(name, f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidRequest(name, f"{name} must be finite, got {value}")
    return value


def outside_vocabulary(ids, vocab_size: int) -> list[int]:
    """The first five of ``ids`` that are not token ids of a ``vocab_size`` vocabulary."""
    return [t for t in ids if not 0 <= t < vocab_size][:5]


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
            raise InvalidRequest(name, f"{name}[{j}] must be an int token id, got {value!r} ({type(value).__name__})")
        ids.append(int(value))
    if bad := outside_vocabulary(ids, vocab_size):
        raise InvalidRequest(name, f"{name} has token ids outside [0, {vocab_size}): {bad}")
    return tuple(ids)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample: validated on construction, immutable afterwards.

    A temperature below 1e-6 (``0`` included; the engine's threshold) is greedy decoding.
    ``top_k=-1``, or any value at least the vocabulary's size, keeps every token. ``seed=None`` lets
    the worker draw a fresh seed for the call. ``stop_token_ids`` end a completion (the stop
    token is kept in it); the worker adds the model's EOS ids unless ``ignore_eos``.
    ``return_logprobs`` asks for the log-probability of every sampled token, ``return_routing``
    (MoE models, a worker with ``record_routing``) for the experts every token was routed to.
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
    return_routing: bool = False
    # A conversation's key: its calls run on one engine, which keeps each call's tokens pinned
    # in its prefix cache for the next (rollout/engine/sessions.py). One prompt, n=1.
    session: str | None = None
    # The named LoRA adapter the call's rows use (a worker with several adapter slots,
    # WorkerConfig.max_loras); None: the default adapters.
    lora: str | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "n", as_int("n", self.n, minimum=1))
        set_(self, "max_new_tokens", as_int("max_new_tokens", self.max_new_tokens, minimum=1))
        temperature = _as_float("temperature", self.temperature)
        if temperature < 0:
            raise InvalidRequest("temperature", f"temperature must be >= 0, got {temperature}")
        set_(self, "temperature", temperature)
        top_p = _as_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise InvalidRequest("top_p", f"top_p must be in (0, 1], got {top_p}")
        set_(self, "top_p", top_p)
        top_k = as_int("top_k", self.top_k)
        if top_k < 1 and top_k != -1:
            raise InvalidRequest("top_k", f"top_k must be -1 (all tokens) or >= 1, got {top_k}")
        set_(self, "top_k", top_k)
        min_p = _as_float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise InvalidRequest("min_p", f"min_p must be in [0, 1], got {min_p}")
        set_(self, "min_p", min_p)
        for flag in ("ignore_eos", "return_logprobs", "return_routing"):
            if not isinstance(getattr(self, flag), (bool, np.bool_)):
                raise InvalidRequest(flag, f"{flag} must be a bool, got {getattr(self, flag)!r}")
            set_(self, flag, bool(getattr(self, flag)))
        if self.seed is not None:
            set_(self, "seed", as_call_seed(self.seed))
        if self.session is not None and (not isinstance(self.session, str) or not self.session):
            raise InvalidRequest("session", f"session must be a non-empty string or None, got {self.session!r}")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise InvalidRequest("lora", f"lora must be a non-empty adapter name or None, got {self.lora!r}")
        stop = self.stop_token_ids
        if stop is None:
            stop = ()
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (Sequence, np.ndarray)):
            raise InvalidRequest("stop_token_ids", f"stop_token_ids must be a list of token ids, got {stop!r}")
        ids = []
        for j, value in enumerate(stop):
            ids.append(as_int(f"stop_token_ids[{j}]", value, minimum=0))
        set_(self, "stop_token_ids", tuple(ids))


def row_seeds(seed: int, num_prompts: int, n: int, *, first_prompt: int = 0) -> np.ndarray:
    """[num_prompts, n] int64 sampling seeds: sample ``j`` of prompt ``i`` gets a seed derived
    from ``(seed, first_prompt + i, j)`` alone, so its samples depend neither on the other
    prompts of the call nor on ``n`` nor on how rows are split over engines."""
    seeds = np.empty((num_prompts, n), dtype=np.int64)
    for i in range(num_prompts):
        for j in range(n):
            word = np.random.SeedSequence([seed % 2**64, first_prompt + i, j]).generate_state(1, dtype=np.uint32)[0]
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
                    f"prompts[{i}] is a string but the model directory {model_path} has no tokenizer: pass token ids",
                )
            tokens = encode_text(tokenizer, prompt, f"prompts[{i}]")
            if outside := outside_vocabulary(tokens, vocab_size):
                # tokens added to the tokenizer with no embedding: a NaN row in the batch
                raise InvalidRequest(
                    f"prompts[{i}]",
                    f"prompts[{i}] encodes to token ids outside the model's vocabulary [0, {vocab_size}): "
                    f"{outside} (the tokenizer has tokens the model has no embeddings for)",
                )
        else:
            tokens = list(token_id_list(f"prompts[{i}]", prompt, vocab_size))
        if not tokens:
            raise InvalidRequest(f"prompts[{i}]", f"prompts[{i}] is empty")
        ids.append(tokens)
    return ids


def call_tokens(prompt_ids: Sequence[Sequence[int]], n: int, max_new_tokens: int) -> int:
    """The most tokens a call's rows may hold: every prompt and its completions, ``n`` of each."""
    return n * sum(len(p) + max_new_tokens for p in prompt_ids)


def encode_text(tokenizer, text: str, field: str) -> list[int]:
    """``text``'s token ids; text that is not valid Unicode (a lone surrogate, which JSON's
    ``\\ud800`` escape can carry) is an error naming ``field``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(field, f"{field} is not valid Unicode: {exc.reason} at character {exc.start}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def pad_width(value, prompt_ids: Sequence[Sequence[int]], max_request_tokens: int) -> int | None:
    """``pad_prompts_to`` checked: None, or an int at least the longest prompt and at most what
    a request may hold (a wider prompt region could never be filled)."""
    if value is None:
        return None
    width = as_int("pad_prompts_to", value, minimum=1)
    longest = max(map(len, prompt_ids))
    if longest > width:
        raise InvalidRequest("pad_prompts_to", f"a prompt has {longest} tokens, more than pad_prompts_to={width}")
    if width > max_request_tokens:
        raise InvalidRequest(
            "pad_prompts_to",
            f"pad_prompts_to={width} is wider than a request may be: at most {max_request_tokens} tokens "
            "(prompt + completion)",
        )
    return width


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
                f"{kv_pool_tokens} tokens)",
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
                "request (prompt + completion)",
            )


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """A validated generate call, before it is split over engines."""

    prompts: list[list[int]]
    params: SamplingParams  # stop ids final (EOS added), seed drawn
    seeds: np.ndarray  # [P, n]
    pad_prompts_to: int | None


class RequestValidator:
    """Checks a generate call's arguments against the worker's limits (``config``'s), its
    engines' (``engine``: every engine has the same), and the model's vocabulary, and draws the
    call seed of calls without one from its own stream (seeded with ``config.seed``)."""

    def __init__(self, config, engine, tokenizer, eos_token_ids: set[int]):
        self._config = config
        self._engine = engine
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._rng = np.random.default_rng(config.seed)
        self._rng_lock = threading.Lock()  # calls come from any thread

    def call_seed(self, seed) -> int:
        """``seed`` checked (:func:`as_call_seed`), or for None the next seed of the stream."""
        if seed is not None:
            return as_call_seed(seed)
        with self._rng_lock:
            return int(self._rng.integers(MAX_SAMPLING_SEED))

    def validate(self, prompts, options: Mapping) -> GenerateRequest:
        """``options``: the call's keyword arguments (``RolloutWorker.generate``'s names)."""
        extra = ("pad_prompts_to", "prompt_offset")
        params = self.check_sampling({k: v for k, v in options.items() if k not in extra})
        config, engine = self._config, self._engine
        prompt_ids = prompt_token_ids(
            prompts, vocab_size=engine.vocab_size, tokenizer=self._tokenizer, model_path=config.model_path
        )
        rows = len(prompt_ids) * params.n
        if params.session is not None and rows != 1:
            raise InvalidRequest(
                "session",
                f"a session's call continues one conversation: one prompt and n=1, got {len(prompt_ids)} "
                f"prompt(s) x n={params.n}",
            )
        check_limit("n", "rows (prompts x n)", rows, "WorkerConfig.max_rows_per_call", config.max_rows_per_call)
        check_request_lengths(
            prompt_ids,
            params.max_new_tokens,
            context_length=engine.context_length,
            max_request_tokens=engine.max_request_tokens,
            max_prompt_tokens=engine.max_prompt_tokens,
            kv_pool_tokens=engine.kv_pool_tokens,
        )
        tokens = call_tokens(prompt_ids, params.n, params.max_new_tokens)
        check_limit(
            "prompts",
            "tokens (prompt + max_new_tokens, over every row)",
            tokens,
            "WorkerConfig.max_tokens_per_call",
            config.max_tokens_per_call,
        )
        pad_to = pad_width(options.get("pad_prompts_to"), prompt_ids, engine.max_request_tokens)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos_token_ids)
        call_seed = self.call_seed(params.seed)
        params = dataclasses.replace(params, stop_token_ids=tuple(sorted(stop)), seed=call_seed)
        offset = as_int("prompt_offset", options.get("prompt_offset", 0), minimum=0)
        seeds = row_seeds(call_seed, len(prompt_ids), params.n, first_prompt=offset)
        return GenerateRequest(prompt_ids, params, seeds, pad_to)

    def check_sampling(self, sampling: Mapping) -> SamplingParams:
        """The :class:`SamplingParams` of ``sampling`` (generate's sampling options), checked
        against the worker: what needs no prompt."""
        unknown = set(sampling) - {f.name for f in dataclasses.fields(SamplingParams)}
        if unknown:
            raise TypeError(f"generate() got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        params = SamplingParams(**sampling)
        config, engine = self._config, self._engine
        if params.return_routing and not config.record_routing:
            try:
                check_routing_recordable(config.model_path, "return_routing")
            except ValueError as no_experts:  # then record_routing would not help either
                raise InvalidRequest("return_routing", str(no_experts)) from None
            raise InvalidRequest(
                "return_routing",
                "return_routing needs a worker that records routing: WorkerConfig(record_routing=True)",
            )
        if params.return_routing and params.n > 1 and not workaround_enabled("one-request-per-sample"):
            raise InvalidRequest(
                "return_routing",
                "return_routing with n > 1 needs workaround one-request-per-sample (the engine's own n "
                "gives the samples request ids of its own, whose routing cannot be followed)",
            )
        if params.lora is not None and params.lora not in engine.lora_names:
            raise InvalidRequest(
                "lora",
                f"no LoRA adapter named {params.lora!r} is loaded (loaded: {sorted(engine.lora_names)}); load one "
                "with sync_adapters(..., name=...) on a worker with WorkerConfig.max_loras > 1",
            )
        if params.lora is not None and params.n > 1 and not workaround_enabled("one-request-per-sample"):
            raise InvalidRequest("lora", "lora with n > 1 needs workaround one-request-per-sample (request ids)")
        vocab = engine.vocab_size
        for j, stop in enumerate(params.stop_token_ids):
            if stop >= vocab:
                raise InvalidRequest(f"stop_token_ids[{j}]", f"stop_token_ids[{j}] = {stop} is outside [0, {vocab})")
        return params
