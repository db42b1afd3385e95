"""Multi-turn episodes: the model and an environment take turns, many episodes at once.

Each episode is a loop: generate a turn -> the environment's ``step`` (user code, sync or async)
answers with an observation, a reward and whether it is done -> the observation is appended ->
the next turn, until the environment is done or a limit ends it (:class:`EpisodeLimits`).

What the trainer gets is exact:

- the tokens the model sampled are kept as sampled: never decoded and encoded again (that
  round trip can change them, and the trainer would score tokens the model never produced);
- an observation's text is encoded once, inside the chat template's delimiters for its role
  (:class:`TurnFrames`: the API adds them, not the environment); token observations are framed
  the same way;
- the loss mask is 1 exactly on sampled tokens, with their log-probs and weight versions;
- every turn is one call of the episode's session (``RolloutWorker.agenerate(session=...)``):
  its engine keeps the conversation pinned in the prefix cache while the environment works, so a
  turn prefills only what was appended since the last one (``EpisodeTurn.prefill_tokens``).

:func:`pack_episodes` lays episodes out as the :class:`~rollout.RolloutBatch` the RL examples
train on: the first prompt in the prompt region, the rest of the conversation in the completion
region, ``completion_mask`` the loss mask.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import inspect
import json
import logging
import math
import numbers
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .batch import RolloutBatch, pack_rollouts
from .chat import (
    ChatError,
    ParsedTurn,
    normalize_message,
    normalize_messages,
    normalize_template_kwargs,
    normalize_tools,
    parse_tool_calls,
    render_chat,
)
from .errors import InvalidRequest
from .sampling import (
    SamplingParams,
    as_int,
    outside_vocabulary,
    pad_width,
    row_seeds,
    token_id_list,
)

logger = logging.getLogger(__name__)
# EpisodeBatch.rewards are float32: an episode's reward must be finite there.
_FLOAT32_MAX = float(np.finfo(np.float32).max)

# How an episode ended (EpisodeResult.status).
DONE = "done"  # the environment said so
MAX_TURNS = "max_turns"
LENGTH = "length"  # no room for another turn (EpisodeLimits.max_total_tokens or the context)
ENV_ERROR = "env_error"  # the environment raised, timed out, or answered no well-formed StepResult
CONTEXT_EXCEEDED = "context_exceeded"  # overflow="error": the next turn would not fit
STATUSES = (DONE, MAX_TURNS, LENGTH, ENV_ERROR, CONTEXT_EXCEEDED)


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """When an episode ends, besides its environment saying so.

    ``max_new_tokens``: one turn's sampled tokens. ``max_total_tokens``: the whole conversation
    (prompt, every turn, every observation); None: as much as one request may hold
    (``RolloutWorker.max_request_tokens``; a turn's prompt, the conversation so far, also within
    ``RolloutWorker.max_prompt_tokens``). ``max_response_tokens``: what follows the first
    prompt (turns and observations: the width of a fixed-shape batch's completion region).
    ``overflow``: what a turn does when the conversation leaves less than ``max_new_tokens`` of
    room: ``"truncate"`` samples what fits (and the episode ends with status ``"length"`` once
    nothing fits, without the observation that left no room), ``"error"`` ends the episode with
    status ``"context_exceeded"`` and a message saying by how much, before the turn (or the
    observation) that would not fit. Either way the first turn must fit: a first prompt that
    leaves it no room (one token; ``max_new_tokens`` with ``"error"``) is refused up front
    (``InvalidRequest``). The answer to the last allowed turn is not appended.
    ``env_timeout_s``: one ``step`` of the environment (None: no limit); a step that takes
    longer ends its episode with status ``"env_error"`` at once: an async step is cancelled and
    left to end on its own, a thread running a synchronous step cannot be stopped (it finishes
    in the background on a thread of the run's own); either's late result is unused.
    ``pin_prefix``: keep each conversation pinned in the prefix cache between turns.
    """

    max_turns: int = 8
    max_new_tokens: int = 256
    max_total_tokens: int | None = None
    max_response_tokens: int | None = None
    overflow: str = "truncate"
    env_timeout_s: float | None = 60.0
    pin_prefix: bool = True

    def __post_init__(self):
        for name in ("max_turns", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EpisodeLimits.{name} must be a positive int, got {value!r}")
        total = self.max_total_tokens
        if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 2):
            raise ValueError(f"EpisodeLimits.max_total_tokens must be an int >= 2 or None, got {total!r}")
        response = self.max_response_tokens
        if response is not None and (isinstance(response, bool) or not isinstance(response, int) or response < 1):
            raise ValueError(f"EpisodeLimits.max_response_tokens must be a positive int or None, got {response!r}")
        if self.overflow not in ("truncate", "error"):
            raise ValueError(f"EpisodeLimits.overflow must be 'truncate' or 'error', got {self.overflow!r}")
        timeout = self.env_timeout_s
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0  # NaN too
        ):
            raise ValueError(f"EpisodeLimits.env_timeout_s must be a positive number or None, got {timeout!r}")
        if not isinstance(self.pin_prefix, bool):
            raise ValueError(f"EpisodeLimits.pin_prefix must be a bool, got {self.pin_prefix!r}")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One turn of the model, as the environment's ``step`` receives it."""

    index: int  # 0 for the first turn
    token_ids: list[int]  # as sampled, the stop token included
    text: str  # the tokens' text (rollout.chat.completion_text); "" without a tokenizer
    finish_reason: str  # "stop" (a stop token), "length" (the turn's token budget)
    # The message's tool calls (rollout.chat.parse_tool_calls; ids call_<index>_<k>): the text's,
    # on a first turn that continues a prefilled assistant message the prefill's and the text's.
    parsed: ParsedTurn

    @property
    def tool_calls(self):
        return self.parsed.tool_calls


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The environment's answer to a turn.

    ``observation``: text (framed by the chat template as a ``role`` message), token ids (the
    content's tokens, ints in the vocabulary, framed the same way), a list of messages
    (``{"role", "content"}`` dicts, e.g. one ``tool`` message per tool call, rendered together),
    or None (nothing to append: only with ``done``). ``reward`` (a finite number) adds to the
    episode's reward; ``done`` is a bool. Anything else ends the episode with ``"env_error"``.
    With ``done``, or after the last allowed turn, the observation is neither checked nor
    appended: no turn reads it.
    """

    observation: str | Sequence[int] | Sequence[Mapping[str, Any]] | None = None
    reward: float = 0.0
    done: bool = False
    role: str = "user"


class Environment(Protocol):
    """What an episode's environment provides: ``step`` may be a plain or an async function."""

    def step(self, turn: Turn) -> StepResult | Awaitable[StepResult]: ...


class ToolEnvironment:
    """An environment that runs the model's tool calls.

    A turn with tool calls (``<tool_call>`` blocks, :func:`rollout.chat.parse_tool_calls`) is
    answered with ``tool`` messages the model can read and correct from: first an error per
    malformed block, then one per well-formed call in the calls' order, its function's result
    (``functions[name](**arguments)``, plain or async; not a string: JSON) or an error (an
    unknown function, arguments it does not take, an exception it raised, a result JSON cannot
    encode, NaN and infinities included). The episode never fails on the model's calls. A turn
    without tool calls is the final answer: the episode ends with ``reward(turn)`` (plain or
    async). Plain functions run on threads (the episode's, in :func:`run_episodes`), so a slow
    one holds up neither the other episodes nor its step's ``env_timeout_s``; they may run at
    once for different episodes. Counts what happened (``calls``, ``failed_calls``), for metrics.
    """

    def __init__(self, functions: Mapping[str, Callable], reward: Callable[[Turn], Any]):
        self.functions = dict(functions)
        self.reward = reward
        self.calls = 0
        self.failed_calls = 0

    async def step(self, turn: Turn) -> StepResult:
        parsed = turn.parsed
        if not parsed.tool_calls and not parsed.errors:
            reward = await _call(self.reward, turn)
            try:
                if isinstance(reward, (bool, np.bool_, str, bytes)):  # float() would take them
                    raise TypeError
                reward = float(reward)
            except (TypeError, ValueError):
                raise TypeError(
                    f"the reward function returned {reward!r:.80} ({type(reward).__name__}), not a number"
                ) from None
            except OverflowError:  # an int past a float's range: float() names no reward
                raise ValueError(
                    f"the reward function returned {reward!r:.80} ({type(reward).__name__}), beyond a float's range"
                ) from None
            return StepResult(reward=reward, done=True)
        # Counted before the calls run: a step that times out still counts what it started.
        self.calls += len(parsed.tool_calls) + len(parsed.errors)
        self.failed_calls += len(parsed.errors)
        messages = [{"role": "tool", "content": f"error: {error}"} for error in parsed.errors]
        for call in parsed.tool_calls:
            messages.append({"role": "tool", "content": await self._run(call), "tool_call_id": call.id})
        return StepResult(observation=messages)

    async def _run(self, call) -> str:
        function = self.functions.get(call.name)
        if function is None:
            self.failed_calls += 1
            return f"error: no tool named {call.name!r} (tools: {', '.join(sorted(self.functions))})"
        try:
            result = await _call(function, **call.arguments)
            return result if isinstance(result, str) else json.dumps(result, allow_nan=False)
        except asyncio.CancelledError as exc:
            if asyncio.current_task().cancelling():  # the step itself is cancelled (its timeout)
                raise
            return self._failed(call, exc)  # the tool's own (a task it awaited was cancelled)
        except Exception as exc:  # the model reads what went wrong, as it would from a real tool
            return self._failed(call, exc)

    def _failed(self, call, exc: BaseException) -> str:
        self.failed_calls += 1
        return f"error: {call.name}: {type(exc).__name__}: {exc}"


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


# The threads of the episode whose environment step is running (None outside an episode: the
# event loop's default executor).
_STEP_THREADS: contextvars.ContextVar[concurrent.futures.Executor | None] = contextvars.ContextVar(
    "step_threads", default=None
)


# What an environment's function may raise that asyncio cannot carry as its error: it cannot set
# StopIteration on a future (the call would never return), and takes SystemExit and
# KeyboardInterrupt for the event loop's own end (every episode ended with an empty
# CancelledError). Raised as RuntimeErrors: the episode's error, as any other. But for a
# KeyboardInterrupt on the main thread: there it is the user's Ctrl-C, for the whole run.
_ESCAPES = (StopIteration, SystemExit, KeyboardInterrupt)


def _escaped(function: Callable, exc: BaseException) -> RuntimeError:
    if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
        raise exc
    return RuntimeError(f"{getattr(function, '__name__', function)!s} raised {exc!r}")


async def _call(function: Callable, /, *args, **kwargs):
    """``function``'s answer (awaited if it is an awaitable); a plain function runs on a thread
    (the episode's)."""
    try:
        if inspect.iscoroutinefunction(function):
            result = await function(*args, **kwargs)
        else:
            result = await _on_thread(_STEP_THREADS.get(), function, *args, **kwargs)
        return await _maybe_await(result)
    except _ESCAPES as exc:
        raise _escaped(function, exc) from exc


def _on_thread(threads: concurrent.futures.Executor | None, function: Callable, /, *args, **kwargs) -> asyncio.Future:
    """``function(*args, **kwargs)`` on one of ``threads``, its ``_ESCAPES`` raised as
    RuntimeErrors."""

    def run():
        try:
            return function(*args, **kwargs)
        except _ESCAPES as exc:
            raise _escaped(function, exc) from exc

    return asyncio.get_running_loop().run_in_executor(threads, run)


@dataclasses.dataclass(frozen=True)
class EpisodeTurn:
    """Where one turn sits in its episode's tokens, and what its prefill cost."""

    start: int  # the turn's first sampled token
    end: int  # one past its last sampled token
    observation_end: int  # one past the framing and observation that followed (== end if none)
    finish_reason: str
    prompt_tokens: int  # the conversation the turn was generated from
    cached_tokens: int  # of those, found in the prefix cache (the engine's count, see RolloutBatch)
    # What the turn's prefills computed: prompt_tokens - cached_tokens, unless the engine ran out
    # of KV during the turn and prefilled it again (RolloutBatch.prefill_tokens).
    prefill_tokens: int


@dataclasses.dataclass(frozen=True)
class EpisodeResult:
    """A finished episode: the whole conversation and what the trainer needs of it."""

    token_ids: list[int]
    prompt_length: int  # the first prompt's tokens (token_ids[:prompt_length])
    loss_mask: np.ndarray  # [len(token_ids)] bool: True exactly on sampled tokens
    logprobs: np.ndarray | None  # [len(token_ids)] float32, 0 where not sampled (return_logprobs)
    token_versions: np.ndarray  # [len(token_ids)] int64, the weight version of each sampled token, -1 elsewhere
    kept_counts: np.ndarray | None  # [len(token_ids)] int32 (return_logprobs), 0 where not sampled
    turns: list[EpisodeTurn]
    reward: float
    status: str  # one of STATUSES
    error: str | None = None  # why, for env_error and context_exceeded
    # [len(token_ids), MoE layers, top_k] (return_routing): the routing the last turn's generate
    # returned for the whole conversation it saw (each token's from the forward that computed its
    # KV, the KV that turn attended to) and its sampled tokens, -1 where no forward took the token
    # as input (the last sampled token).
    routed_experts: np.ndarray | None = None
    seed: int = 0  # the seed its turns' seeds derive from

    @property
    def prefill_tokens(self) -> int:
        return sum(t.prefill_tokens for t in self.turns)


@dataclasses.dataclass(frozen=True)
class EpisodeBatch:
    """Episodes of ``n`` samples per prompt, prompt-major, and their :class:`RolloutBatch`."""

    episodes: list[EpisodeResult]
    batch: RolloutBatch  # completion_mask = loss mask; completions = everything after the prompt
    n: int

    @property
    def rewards(self) -> np.ndarray:
        return np.array([e.reward for e in self.episodes], dtype=np.float32)


class TurnFrames:
    """The chat template's delimiters around a turn, found once per role by rendering a short
    conversation: what ends the model's turn (the text after an assistant message's content)
    and what the template writes for the messages that follow it, up to the next turn's
    generation prompt. Templates that render earlier turns differently once others follow
    (Qwen3 drops an earlier turn's reasoning) work: only what follows the assistant's content is
    used. Without a chat template, nothing: observations are appended as they are."""

    _MARK = "\x00observation\x00"
    _ANSWER = "\x01answer\x01"  # an assistant message's content, found in the rendered text

    def __init__(
        self, tokenizer, tools: Sequence[Mapping] | None = None, template_kwargs: Mapping[str, Any] | None = None
    ):
        self._tokenizer = tokenizer
        self.tools = normalize_tools(list(tools) if isinstance(tools, (list, tuple)) else tools)
        self._variables = normalize_template_kwargs(template_kwargs)
        self.templated = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
        if self.tools and not self.templated:  # nothing would write them where the model reads
            raise ChatError("tools", "tools need a tokenizer with a chat template (it writes them into the prompt)")
        self._frames: dict[str, tuple[str, str]] = {}
        self._turn_end_text = ""
        self.turn_end: list[int] = []
        self.turn_stop: list[int] = []
        if self.templated:
            self._turn_end_text = self._after_answer(self._render(self._history(), False))
            self.turn_end = self._encode(self._turn_end_text)
        # A turn ends where the template ends an assistant message, when that is a special token
        # (ChatML's <|im_end|>): sampling stops there, whatever the model's EOS tokens are.
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        special |= {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
        self.turn_stop = self.turn_end[:1] if self.turn_end and self.turn_end[0] in special else []

    def _after_answer(self, text: str) -> str:
        at = text.rfind(self._ANSWER)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content as written")
        return text[at + len(self._ANSWER) :]

    def _history(self) -> list[dict]:
        return [{"role": "user", "content": "Q"}, {"role": "assistant", "content": self._ANSWER}]

    def _render(self, messages: list[dict], generation_prompt: bool, continue_final: bool = False) -> str:
        return render_chat(
            self._tokenizer,
            messages,
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            continue_final_message=continue_final,
            template_kwargs=self._variables,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: Sequence[Mapping], field: str = "prompts") -> list[int]:
        """The first prompt's tokens: the messages rendered with the generation prompt, or, where
        the last message is the assistant's text (no tool calls), with that message left open (a
        prefill the model's first turn continues); InvalidRequest naming ``field`` without a chat
        template or for messages it cannot take."""
        if not self.templated:
            raise InvalidRequest(
                field, f"{field}: message prompts need a tokenizer with a chat template: pass token ids"
            )
        messages = list(messages)
        prefill = prefill_text(messages) is not None
        try:
            return self._encode(self._render(messages, not prefill, continue_final=prefill))
        except ChatError as error:  # its field is a path in a request body: messages[1].content
            raise InvalidRequest(field, f"{field}: {error}") from None

    def close_turn(self, sampled: Sequence[int]) -> list[int]:
        """Tokens that end the model's turn after ``sampled``: the template's end of an assistant
        message, less what the model already wrote of it (its stop token)."""
        end = self.turn_end
        if end and sampled and sampled[-1] == end[0]:
            return end[1:]
        return list(end)

    def observation(self, result: StepResult) -> list[int]:
        """An observation's tokens, with the template's delimiters and the next generation prompt.
        Raises TypeError or ValueError naming what the observation is not."""
        content = result.observation
        if isinstance(content, str):
            if self.templated:
                # Checked as the StepResult's: rendered, it is a message deep in the history.
                message = normalize_message({"role": result.role, "content": content}, "StepResult")
                return self._encode(self._between([message]))
            if self._tokenizer is None:
                raise TypeError("a text observation needs a model with a tokenizer: return token ids")
            return self._encode(content)
        if _is_messages(content):
            if not self.templated:
                raise TypeError("an observation of messages needs a tokenizer with a chat template")
            for i, message in enumerate(content):
                if not isinstance(message, Mapping):  # dict() would fail naming no element
                    raise TypeError(
                        f"observation[{i}] is {type(message).__name__} {message!r:.60}, not a message "
                        "(an object with a string 'role')"
                    )
            return self._encode(self._between(normalize_messages([dict(m) for m in content], "observation")))
        ids = _content_token_ids(content)
        if not self.templated:
            return ids
        normalize_message({"role": result.role, "content": ""}, "StepResult")  # its role, named as given
        before, after = self._frame(result.role)
        return self._encode(before) + ids + self._encode(after)

    def _frame(self, role: str) -> tuple[str, str]:
        if role not in self._frames:
            text = self._between([{"role": role, "content": self._MARK}])
            before, mark, after = text.partition(self._MARK)
            if not mark:
                raise ValueError(
                    f"the chat template does not write a {role!r} message's content as given (it quotes or "
                    f"drops it): return that observation as text or messages, not token ids"
                )
            self._frames[role] = (before, after)
        return self._frames[role]

    def _between(self, messages: list[dict]) -> str:
        """What the template writes for ``messages`` after a closed assistant turn."""
        rest = self._after_answer(self._render(self._history() + messages, True))
        if not rest.startswith(self._turn_end_text):
            raise ValueError(
                f"the chat template ends an assistant message with {rest[: len(self._turn_end_text)]!r} when "
                f"{[m['role'] for m in messages]} follow, with {self._turn_end_text!r} when it is the last"
            )
        return rest[len(self._turn_end_text) :]


async def run_episode(
    worker,
    prompt: Sequence[int] | Sequence[Mapping],
    env: Environment,
    *,
    limits: EpisodeLimits = EpisodeLimits(),
    tools: Sequence[Mapping] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    frames: TurnFrames | None = None,
    seed: int | None = None,
    threads: concurrent.futures.Executor | None = None,
    **sampling,
) -> EpisodeResult:
    """One episode on ``worker`` (see :meth:`rollout.RolloutWorker.arun_episodes`). Cancelling
    it aborts its turn in the engine (the turn's KV is freed) and releases its pinned prefix.
    ``threads`` runs a synchronous ``env.step`` and :class:`ToolEnvironment`'s plain functions
    (None: a thread of the episode's own). Shared by several episodes, it runs as many of their
    steps at once as it has threads: the others' wait, and a step abandoned at its timeout holds
    its thread until it returns. The pin's release runs on a thread of the episode's own."""
    limits = _checked_limits(limits)
    _check_threads(threads)
    frames = frames or _frames(worker, tools, chat_template_kwargs)
    prompt_ids = _first_prompt(worker, frames, limits, prompt, "prompt")
    sampling = _turn_sampling(worker, frames, sampling)
    seed = worker.call_seed(seed)
    # The release on the caller's threads would wait behind other episodes' steps, and for good
    # behind a hung one (this episode's own abandoned step on a pool of one thread).
    with _own_threads(2 if threads is None else 1) as own:
        episode = _Episode(worker, frames, limits, sampling, seed, own if threads is None else threads, own)
        return await episode.run(prompt_ids, env, prefill_text(prompt) or "")


async def run_episodes(
    worker,
    prompts: Sequence[Sequence[int] | Sequence[Mapping]],
    make_env: Callable[[int, int], Environment],
    *,
    n: int = 1,
    limits: EpisodeLimits = EpisodeLimits(),
    tools: Sequence[Mapping] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    seed: int | None = None,
    pad_prompts_to: int | None = None,
    completion_width: int | None = None,
    threads: concurrent.futures.Executor | None = None,
    **sampling,
) -> EpisodeBatch:
    """``n`` episodes of every prompt, all at once; ``make_env(i, j)`` is the environment of
    sample ``j`` of prompt ``i``. Episode ``(i, j)`` draws from a seed derived from ``(seed,
    i, j)`` (``seed=None``: one drawn as ``generate`` draws it, from the worker's stream).
    Every argument is checked (InvalidRequest naming it) and every environment made before the
    first episode starts; a first prompt whose first turn cannot run (longer than the engine
    takes, or leaving no room under ``limits``) is refused. ``threads`` runs the synchronous
    steps and plain tools as in :func:`run_episode` (None: a thread per episode of the run's
    own); the pins' releases run on a thread of the run's own either way."""
    n = as_int("n", n, minimum=1)
    limits = _checked_limits(limits)
    _check_threads(threads)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise InvalidRequest("prompts", "prompts must be a non-empty list of prompts (messages or token ids)")
    frames = _frames(worker, tools, chat_template_kwargs)
    prompt_ids = [_first_prompt(worker, frames, limits, p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    prompt_width = pad_width(pad_prompts_to, prompt_ids, worker.max_request_tokens)
    if completion_width is not None:
        completion_width = as_int("completion_width", completion_width, minimum=1)
        _check_completion_width(worker, limits, prompt_ids, completion_width)
    sampling = _turn_sampling(worker, frames, sampling)
    seeds = row_seeds(worker.call_seed(seed), len(prompts), n)
    envs = [make_env(i, j) for i in range(len(prompts)) for j in range(n)]
    for row, env in enumerate(envs):
        if not callable(getattr(env, "step", None)):
            for made in envs:
                if inspect.iscoroutine(made):  # never to run: closed, not left to warn
                    made.close()
            raise InvalidRequest(
                "make_env",
                f"make_env{divmod(row, n)} returned {type(env).__name__}, not an environment (an object with a step "
                "method; make_env itself is a plain function)",
            )
    # A thread per episode for synchronous steps (a hung one holds its own) and one for releases,
    # which on the caller's threads would wait behind its steps (for good behind a hung one).
    with _own_threads(len(envs) + 1 if threads is None else 1) as own:
        steps = own if threads is None else threads
        tasks = []
        try:
            for row, env in enumerate(envs):
                i, j = divmod(row, n)
                episode = _Episode(worker, frames, limits, sampling, int(seeds[i, j]), steps, own)
                tasks.append(asyncio.ensure_future(episode.run(prompt_ids[i], env, prefill_text(prompts[i]) or "")))
            results = await asyncio.gather(*tasks)
        except BaseException:  # one episode's error (or a cancellation) ends the others too
            for task in tasks:
                task.cancel()
            await _settle(tasks)  # their pins released while the run's threads still run
            raise
    batch = pack_episodes(
        results, n=n, pad_token_id=worker.pad_token_id, prompt_width=prompt_width, completion_width=completion_width
    )
    return EpisodeBatch(results, batch, n)


def run_until_returned(main: Coroutine):
    """``asyncio.run(main)`` on a thread of its own, returning (or raising) as soon as ``main``
    does: what ``main`` leaves running (an environment's step abandoned at its timeout, the
    thread of a plain function it called) winds down there, where ``asyncio.run`` would have
    waited for it (it waits for every task and for the default executor's threads). A thread
    that never returns still keeps the interpreter from exiting, as any thread does. Ctrl-C
    cancels ``main`` and waits for it to unwind (its sessions released)."""
    outcome: concurrent.futures.Future = concurrent.futures.Future()
    running: concurrent.futures.Future = concurrent.futures.Future()  # (loop, task)

    async def run():
        running.set_result((asyncio.get_running_loop(), asyncio.current_task()))
        try:
            outcome.set_result(await main)
        except BaseException as error:  # handed to the caller, cancellation included
            outcome.set_exception(error)

    threading.Thread(target=asyncio.run, args=(run(),), name="episodes-loop", daemon=True).start()
    try:
        return outcome.result()
    except KeyboardInterrupt:
        loop, task = running.result()
        loop.call_soon_threadsafe(task.cancel)
        concurrent.futures.wait([outcome])
        raise


def pack_episodes(
    episodes: Sequence[EpisodeResult],
    *,
    n: int,
    pad_token_id: int,
    prompt_width: int | None = None,
    completion_width: int | None = None,
) -> RolloutBatch:
    """Episodes (prompt-major, ``n`` per prompt) as a :class:`RolloutBatch`: the first prompt
    left-padded in the prompt region, the rest of the conversation after it, ``completion_mask``
    True exactly where the model sampled (the loss mask), ``finish_reasons`` the episodes'
    statuses, ``weight_version`` the oldest version that sampled a token of the batch,
    ``routed_experts`` the episodes' (with ``return_routing``) aligned with ``tokens``, ``seeds``
    each episode's. Raises ValueError unless the episodes of each prompt share its first prompt."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"pack_episodes: n must be a positive int, got {n!r}")
    if not episodes or len(episodes) % n:
        raise ValueError(f"pack_episodes: {len(episodes)} episodes are not n={n} for each of one or more prompts")
    prompts = [list(e.token_ids[: e.prompt_length]) for e in episodes[::n]]
    for row, episode in enumerate(episodes):
        if list(episode.token_ids[: episode.prompt_length]) != prompts[row // n]:
            raise ValueError(
                f"pack_episodes: episodes[{row}] starts from another first prompt than episodes[{row - row % n}]: "
                f"the n={n} episodes of each prompt must be consecutive (prompt-major), none left out"
            )

    def after_prompt(values):
        return [list(v[e.prompt_length :]) for v, e in zip(values, episodes)]

    rests = after_prompt([e.token_ids for e in episodes])
    sampled_versions = [int(v) for e in episodes for v in e.token_versions[e.loss_mask]]
    with_logprobs = all(e.logprobs is not None for e in episodes)
    batch = pack_rollouts(
        prompts,
        rests,
        n=n,
        completion_width=max(map(len, rests)) if completion_width is None else completion_width,
        pad_token_id=pad_token_id,
        finish_reasons=[e.status for e in episodes],
        weight_version=min(sampled_versions, default=-1),
        seeds=np.array([e.seed for e in episodes], np.int64),
        prompt_width=prompt_width,
        logprobs=after_prompt([e.logprobs for e in episodes]) if with_logprobs else None,
        token_versions=after_prompt([e.token_versions for e in episodes]),
        kept_counts=after_prompt([e.kept_counts for e in episodes]) if with_logprobs else None,
        routed_experts=[e.routed_experts for e in episodes],
    )
    mask = np.zeros_like(batch.completion_mask)
    for row, episode in enumerate(episodes):
        rest = episode.loss_mask[episode.prompt_length :]
        mask[row, batch.prompt_width : batch.prompt_width + len(rest)] = rest
    return dataclasses.replace(batch, completion_mask=mask)


def _frames(worker, tools, template_kwargs) -> TurnFrames:
    """The worker's chat framing with ``tools`` and ``template_kwargs``; what the template cannot
    take is an InvalidRequest naming it."""
    try:
        return TurnFrames(worker.tokenizer, tools, template_kwargs)
    except ChatError as error:
        raise InvalidRequest(error.field, str(error)) from None


def _checked_limits(limits) -> EpisodeLimits:
    if not isinstance(limits, EpisodeLimits):
        raise InvalidRequest("limits", f"limits must be an EpisodeLimits, got {limits!r} ({type(limits).__name__})")
    return limits


def _check_threads(threads) -> None:
    # Else every synchronous step failed, each its episode's env_error: an object without submit,
    # or a process pool, which cannot run the step's closure (nor share the environment).
    if threads is not None and (
        not isinstance(threads, concurrent.futures.Executor)
        or isinstance(threads, concurrent.futures.ProcessPoolExecutor)
    ):
        raise InvalidRequest(
            "threads",
            f"threads must be a thread pool (a concurrent.futures.Executor) or None, got {type(threads).__name__}",
        )


def _conversation_cap(worker, limits: EpisodeLimits, prompt_length: int) -> tuple[int, str]:
    """The most tokens an episode's conversation may reach (the limits' and the engine's), and
    the limit that sets it."""
    caps = [(worker.max_request_tokens, "the worker's max_request_tokens")]
    if worker.config.max_tokens_per_call is not None:  # each turn is a call of one row
        caps.append((worker.config.max_tokens_per_call, "WorkerConfig.max_tokens_per_call"))
    if limits.max_total_tokens is not None:
        caps.append((limits.max_total_tokens, "EpisodeLimits.max_total_tokens"))
    if limits.max_response_tokens is not None:
        caps.append((prompt_length + limits.max_response_tokens, "EpisodeLimits.max_response_tokens"))
    return min(caps, key=lambda cap: cap[0])


def _first_prompt(worker, frames: TurnFrames, limits: EpisodeLimits, prompt, field: str) -> list[int]:
    """A first prompt's tokens (messages rendered with the template and tools), refused as
    InvalidRequest naming ``field`` when its first turn could not run: an episode of it would
    end before sampling a token, whereas generate refuses such a prompt. Token ids with tools
    are refused as InvalidRequest naming ``tools``: only the template writes them into a prompt,
    and the model reads token ids as given."""
    messages = _is_messages(prompt)
    if frames.tools and not messages:
        raise InvalidRequest(
            "tools",
            f"tools are written into a prompt of messages by the chat template, and {field} is token ids, which "
            "the model reads as given: pass it as messages, or pass no tools (the token ids holding them)",
        )
    ids = list(token_id_list(field, frames.prompt(prompt, field) if messages else prompt, worker.vocab_size))
    if not ids:
        raise InvalidRequest(field, f"{field} is empty")
    if len(ids) > worker.max_prompt_tokens:
        raise InvalidRequest(
            field,
            f"{field} has {len(ids)} tokens{' with the chat template and tools' if messages else ''}; the engine "
            f"accepts prompts of at most {worker.max_prompt_tokens} tokens (the worker's max_prompt_tokens)",
        )
    cap, limit = _conversation_cap(worker, limits, len(ids))
    first_turn = limits.max_new_tokens if limits.overflow == "error" else 1
    if len(ids) + first_turn > cap:
        raise InvalidRequest(
            field,
            f"{field} has {len(ids)} tokens: its first turn's {first_turn} more would pass the episode's limit of "
            f"{cap} ({limit})",
        )
    return ids


def _check_completion_width(worker, limits: EpisodeLimits, prompt_ids: list[list[int]], width: int) -> None:
    """The batch's completion region must hold whatever may follow each first prompt, and no
    more than a conversation may hold."""
    if width > worker.max_request_tokens:
        raise InvalidRequest(
            "completion_width",
            f"completion_width={width} is wider than a conversation may be: at most {worker.max_request_tokens} "
            "tokens (the worker's max_request_tokens)",
        )
    for i, ids in enumerate(prompt_ids):
        room = _conversation_cap(worker, limits, len(ids))[0] - len(ids)
        if room > width:
            raise InvalidRequest(
                "completion_width",
                f"completion_width={width} cannot hold what may follow prompts[{i}]: up to {room} tokens under the "
                f"episode's limits; set EpisodeLimits.max_response_tokens to at most {width}",
            )


# Generate options the episode sets for each turn, and what the caller sets instead.
_TURN_OPTIONS = {
    "max_new_tokens": "EpisodeLimits.max_new_tokens",
    "session": "EpisodeLimits.pin_prefix",
    "n": "run_episodes(n=...)",
    "pad_prompts_to": "run_episodes(pad_prompts_to=...)",
    "prompt_offset": "seed",
}


def _turn_sampling(worker, frames: TurnFrames, sampling: dict) -> dict:
    """Every turn's generate options, checked as the worker's generate checks them: the
    caller's, and the template's end of turn as a stop token."""
    for name, instead in _TURN_OPTIONS.items():
        if name in sampling:
            raise InvalidRequest(name, f"{name} is set for each turn by the episode: use {instead}")
    unknown = set(sampling) - {f.name for f in dataclasses.fields(SamplingParams)}
    if unknown:
        raise TypeError(f"unexpected sampling option(s) for the episode's turns: {', '.join(sorted(unknown))}")
    params = worker.check_sampling(**sampling)
    return dict(sampling, stop_token_ids=list(params.stop_token_ids) + frames.turn_stop)


async def _settle(futures) -> None:
    """Wait until every one of ``futures`` is done, also when this wait is cancelled (the
    cancellation is raised once they are); their errors are retrieved (not logged as lost)."""
    pending, cancelled = set(futures), False
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
    for future in futures:
        if not future.cancelled():
            future.exception()
    if cancelled:
        raise asyncio.CancelledError


class _Episode:
    def __init__(self, worker, frames: TurnFrames, limits: EpisodeLimits, sampling: dict, seed: int, threads, releases):
        self.worker, self.frames, self.limits, self.sampling, self.seed = worker, frames, limits, sampling, seed
        self.threads = threads  # runs synchronous environment steps
        self.releases = releases  # runs the pin's release, on a thread a hung step leaves free
        self.prompt_length = 0
        self.session = f"episode-{uuid.uuid4().hex}" if limits.pin_prefix else None
        self.tokens: list[int] = []
        self.sampled: list[bool] = []
        self.logprobs: list[float] = []
        self.kept: list[int] = []
        self.versions: list[int] = []
        self.routing: np.ndarray | None = None  # the last turn's, for every token but its last sampled one
        self.turns: list[EpisodeTurn] = []
        self.reward = 0.0
        self.prefill = ""

    async def run(self, prompt: list[int], env: Environment, prefill: str = "") -> EpisodeResult:
        """``prefill``: the text of an assistant message the prompt leaves open (its first turn's start)."""
        self.prompt_length = len(prompt)
        self.prefill = prefill
        self._append(prompt)
        try:
            status, error = await self._loop(env)
        finally:
            if self.session is not None:  # a turn cancelled as it finished may have pinned
                release = asyncio.get_running_loop().run_in_executor(self.releases, _release, self.worker, self.session)
                await _settle([release])  # released before the episode ends, cancelled or not
                release.result()
        routed = None
        if self.routing is not None:
            routed = np.full((len(self.tokens),) + self.routing.shape[1:], -1, self.routing.dtype)
            routed[: len(self.routing)] = self.routing
        return EpisodeResult(
            token_ids=self.tokens,
            prompt_length=len(prompt),
            loss_mask=np.array(self.sampled, dtype=bool),
            logprobs=np.array(self.logprobs, np.float32) if self.sampling.get("return_logprobs") else None,
            token_versions=np.array(self.versions, np.int64),
            kept_counts=np.array(self.kept, np.int32) if self.sampling.get("return_logprobs") else None,
            turns=self.turns,
            reward=self.reward,
            status=status,
            error=error,
            routed_experts=routed,
            seed=self.seed,
        )

    async def _loop(self, env: Environment) -> tuple[str, str | None]:
        limits = self.limits
        cap = _conversation_cap(self.worker, limits, self.prompt_length)
        for index in range(self.limits.max_turns):
            ended = self._no_room(index, cap, [])
            if ended is not None:
                return ended
            turn = await self._generate(index, min(self.limits.max_new_tokens, cap[0] - len(self.tokens)))
            try:
                result = await self._step(env, turn)
            except Exception as exc:  # the environment's fault ends its episode only
                logger.warning("episode environment failed at turn %d: %s", index, exc)
                return ENV_ERROR, f"turn {index}: {type(exc).__name__}: {exc}"
            read = not result.done and index + 1 < limits.max_turns  # a later turn reads the observation
            if read:  # a malformed one ends the episode with no reward for the answer
                if result.observation is None:
                    return ENV_ERROR, f"turn {index}: the environment returned no observation and did not say done"
                try:
                    appended = self.frames.close_turn(turn.token_ids) + self.frames.observation(result)
                    if outside := outside_vocabulary(appended, self.worker.vocab_size):
                        raise ValueError(f"token ids outside the vocabulary [0, {self.worker.vocab_size}): {outside}")
                except (TypeError, ValueError) as exc:
                    return ENV_ERROR, f"turn {index}: cannot append the observation: {exc}"
            # Each step's is finite: their sum may not be, or not in the batch's float32.
            reward = self.reward + float(result.reward)
            if not abs(reward) <= _FLOAT32_MAX:  # that answer's reward is not counted
                return ENV_ERROR, f"turn {index}: the episode's reward would sum to {reward}, beyond float32's range"
            self.reward = reward
            if result.done:
                return DONE, None
            if not read:  # the last turn: no turn would read the observation
                return MAX_TURNS, None
            ended = self._no_room(index + 1, cap, appended)
            if ended is not None:  # the observation is left out: the episode ends before it
                return ended
            self._append(appended)
            self.turns[-1] = dataclasses.replace(self.turns[-1], observation_end=len(self.tokens))
        raise AssertionError("the last turn returns")  # every path of the last turn returns above

    def _no_room(self, index: int, cap: tuple[int, str], appended: list[int]) -> tuple[str, str | None] | None:
        """How the episode ends if turn ``index`` has no room after ``appended`` (None: it has)
        under ``cap`` (:func:`_conversation_cap`)."""
        cap, limit = cap
        length = len(self.tokens) + len(appended)
        wanted = self.limits.max_new_tokens
        prompt_limit = self.worker.max_prompt_tokens
        if self.limits.overflow == "error":
            if length + wanted > cap:
                return CONTEXT_EXCEEDED, (
                    f"turn {index}: the conversation would have {length} tokens; {wanted} more would pass the "
                    f"limit of {cap} ({limit})"
                )
            if length > prompt_limit:
                return CONTEXT_EXCEEDED, (
                    f"turn {index}: the conversation would have {length} tokens, more than the "
                    f"{prompt_limit} the engine takes as a prompt (the worker's max_prompt_tokens)"
                )
        if length + 1 > cap or length > prompt_limit:
            return LENGTH, None
        return None

    async def _generate(self, index: int, budget: int) -> Turn:
        turn_seed = int(row_seeds(self.seed, 1, 1, first_prompt=index)[0, 0])
        batch = await self.worker.agenerate(
            [self.tokens],
            n=1,
            max_new_tokens=budget,
            seed=turn_seed,
            session=self.session,
            **self.sampling,
        )
        sampled = batch.completions[0]
        start, width = len(self.tokens), batch.prompt_width
        span = slice(width, width + len(sampled))
        self.tokens.extend(sampled)
        self.sampled.extend([True] * len(sampled))
        self.versions.extend(int(v) for v in batch.token_versions[0, span])
        if batch.routed_experts is not None:
            # The conversation's routing as this turn's forwards found or computed it, then the
            # turn's own tokens: a later turn's generate returns all of it again.
            self.routing = batch.routed_experts[0, width - start : width + len(sampled) - 1].copy()
        if batch.logprobs is not None:
            self.logprobs.extend(float(v) for v in batch.logprobs[0, span])
            self.kept.extend(int(v) for v in batch.kept_counts[0, span])
        self.turns.append(
            EpisodeTurn(
                start=start,
                end=len(self.tokens),
                observation_end=len(self.tokens),
                finish_reason=batch.finish_reasons[0],
                prompt_tokens=start,
                cached_tokens=int(batch.cached_tokens[0]),
                prefill_tokens=int(batch.prefill_tokens[0]),
            )
        )
        text = batch.completion_texts[0] if batch.completion_texts is not None else ""
        # The first turn continues a prefill: its message, and so its tool calls, begin there.
        message = self.prefill + text if index == 0 else text
        parsed = parse_tool_calls(message, id_prefix=f"call_{index}")  # ids unique across the episode
        return Turn(index, list(sampled), text, batch.finish_reasons[0], parsed)

    async def _step(self, env: Environment, turn: Turn) -> StepResult:
        """The environment's checked answer to ``turn``; raises what ends the episode."""
        timeout = self.limits.env_timeout_s
        step = asyncio.ensure_future(self._call_step(env, turn))
        try:
            done, _ = await asyncio.wait({step}, timeout=timeout)
        finally:
            # Timed out (or this episode cancelled): asyncio.wait_for would wait for a step that
            # catches its cancellation and use its late result; it is left to end on its own.
            if not step.done():
                step.cancel()
                step.add_done_callback(_drop_late_step)
        if not done:
            raise TimeoutError(f"the environment's step took more than {timeout} s (EpisodeLimits.env_timeout_s)")
        if step.cancelled():  # not by this episode (it would be cancelled itself): what the step awaited was
            raise RuntimeError("the environment's step raised CancelledError")
        result = step.result()
        if not isinstance(result, StepResult):
            raise TypeError(f"the environment's step returned {type(result).__name__}, not a StepResult")
        reward = result.reward
        if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real) or not _finite(reward):
            raise TypeError(f"StepResult.reward must be a finite number, got {reward!r:.80} ({type(reward).__name__})")
        if not isinstance(result.done, (bool, np.bool_)):
            raise TypeError(f"StepResult.done must be a bool, got {result.done!r} ({type(result.done).__name__})")
        return result

    async def _call_step(self, env: Environment, turn: Turn):
        # In this step's task only: where a plain step (the timeout counts from its start) and
        # ToolEnvironment's plain calls run.
        _STEP_THREADS.set(self.threads)
        return await _call(env.step, turn)

    def _append(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)
        self.sampled.extend([False] * len(tokens))
        self.versions.extend([-1] * len(tokens))
        if self.sampling.get("return_logprobs"):
            self.logprobs.extend([0.0] * len(tokens))
            self.kept.extend([0] * len(tokens))


@contextlib.contextmanager
def _own_threads(count: int):
    """A pool of ``count`` threads, shut down without waiting for a hung step."""
    pool = concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="episode")
    try:
        yield pool
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _release(worker, session: str) -> None:
    if not worker.closed:
        worker.release_session(session)


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past a float's range: no float holds it
        return False


def _drop_late_step(step: asyncio.Future) -> None:
    """A step abandoned (timed out, or its episode cancelled) ended: its result is unused, its
    error retrieved (asyncio would log it as never retrieved)."""
    if not step.cancelled() and step.exception() is not None:
        logger.info("an abandoned environment step ended with %r", step.exception())


def prefill_text(prompt) -> str | None:
    """The text of the assistant message a prompt of messages ends with, which its first turn
    continues (no tool calls: such a message is closed); None if it ends otherwise."""
    last = prompt[-1] if _is_messages(prompt) and isinstance(prompt[-1], Mapping) else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    try:  # as the template renders it: a list of text parts joined
        return normalize_message(last, "prompt")["content"]
    except ChatError:
        return ""  # the render names what is wrong


def _is_messages(value) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and bool(value)
        and isinstance(value[0], Mapping)
    )


def _content_token_ids(content) -> list[int]:
    """A token-id observation's ids: Python or numpy integers (not bools); bytes, floats and
    other types are refused rather than taken as ids."""
    if isinstance(content, (bytes, bytearray)) or not isinstance(content, (Sequence, np.ndarray)):
        raise TypeError(
            f"an observation is text, token ids or a list of messages, got {type(content).__name__}: {content!r:.80}"
        )
    if isinstance(content, np.ndarray) and content.ndim != 1:
        raise TypeError(f"an observation's token ids are a flat list, got an array of shape {content.shape}")
    for j, value in enumerate(content):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"observation[{j}] must be an int token id, got {value!r} ({type(value).__name__})")
    return [int(t) for t in content]
