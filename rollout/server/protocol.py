"""OpenAI request bodies -> validated generation requests, and OpenAI-style errors."""

from __future__ import annotations

import dataclasses
import hmac
import json
import math
import re
from typing import Any

from ..chat import ChatError, normalize_messages, normalize_template_kwargs, normalize_tools
from ..sampling import CALL_SEED_RANGE

MAX_N = 128
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 256
# Far above any body this server accepts (a chat message's content part is 5 deep); json.loads
# recurses once per level, so deeper bodies are refused before it runs.
MAX_JSON_DEPTH = 64
# Accepted only with their neutral value: the worker does not serve them. Penalties and a minimum
# length change the distribution the trainer's log-probs would have to recompute (no request
# carries them to the engine); repetition_penalty and min_tokens are vLLM's and SGLang's fields.
_NEUTRAL = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "functions": (None, []),
    # vLLM's chat extensions that this server does not take: another template, RAG documents.
    "chat_template": (None,),
    "documents": (None,),
    # vLLM's and SGLang's sampling extensions that would change what is sampled or returned:
    # beam search, output constraints, token filters, prompt log-probs, the stop string kept.
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "json_schema": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "include_stop_str_in_output": (None, False),
    "no_stop_trim": (None, False),
    "skip_special_tokens": (None, True),
    "structural_tag": (None,),
    "logits_processors": (None, []),
    "custom_logit_processor": (None,),
    # SGLang's per-request adapter: here a request picks named adapters by its "model".
    "lora_path": (None,),
}


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {message, type, param, code}}``; with ``close``,
    its answer closes the connection."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        close: bool = False,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.close = close

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


# A JSON string literal (escapes included), and what is left of a body once they are removed
# that is not a bracket. An unterminated string runs to the end of the body (a lone backslash
# there included): a match from every quote, so the scan is linear; a pattern that must close
# its string failed at each quote of an unterminated one after scanning to the end (60 KB of
# \" held the event loop 10 s, 1 MiB about an hour). json.loads then refuses the body.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def parse_body(raw: bytes) -> dict:
    """A request body: a JSON object nested at most :data:`MAX_JSON_DEPTH` levels whose
    strings (keys included) are all valid Unicode, else a 400 that says what is wrong where."""
    try:
        # As json.loads decodes bytes (UTF-8, -16 or -32): its view of which quotes delimit
        # strings is then the depth scan's.
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if _depth(text) > MAX_JSON_DEPTH:
        raise ApiError(400, f"request body is malformed: it nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(text, parse_int=_bounded_int)
    except _TooManyDigits as exc:
        raise ApiError(400, str(exc)) from None
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    _check_unicode(body)
    return body


class _TooManyDigits(Exception):
    pass


# Python converts at most 4300 digits (sys.get_int_max_str_digits()); no field takes a number
# near that long, so a longer one is named as such, not as invalid JSON with Python's advice.
_MAX_INT_DIGITS = 1000


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > _MAX_INT_DIGITS:
        raise _TooManyDigits(
            f"request body holds an integer of {len(digits.lstrip('-'))} digits: no field takes one over "
            f"{_MAX_INT_DIGITS} digits long"
        )
    return int(digits)


def _depth(text: str) -> int:
    """How deep ``text``'s brackets nest outside strings (the count stops past the limit)."""
    depth = deepest = 0
    for bracket in _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > MAX_JSON_DEPTH:
                break
    return deepest


def _unicode_error(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, which a JSON \ud800 escape can carry
        return f"{exc.reason} at character {exc.start}"
    return None


def _check_unicode(body: dict) -> None:
    """A 400 naming the first string (``stop[1]``, ``messages[0].content``) or key that is not
    valid Unicode: the tokenizer (and the UTF-8 error response) cannot take it."""
    try:
        # One pass in C finds whether any string is bad; the walk below only says which.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            reason = _unicode_error(value)
            if reason is not None:
                raise invalid(path, f"{path} is not valid Unicode: {reason}")
        elif isinstance(value, dict):
            for key in value:
                reason = _unicode_error(key)
                if reason is not None:
                    raise ApiError(
                        400,
                        f"{path or 'the request body'} has a key that is not valid Unicode: {reason}",
                        param=path or None,
                    )
            stack.extend((f"{path}.{key}" if path else key, item) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One completions or chat request, checked field by field."""

    prompts: list  # strings or token-id lists
    prompt_field: str  # "prompt" or "messages": where prompt errors point
    n: int
    max_tokens: int | None  # None: as many as the context allows (chat)
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    top_k: int  # extensions, as in vLLM: -1 keeps every token
    min_p: float
    stop_token_ids: tuple[int, ...]  # kept in token_ids, as the model's EOS is
    stream: bool
    include_usage: bool
    logprobs: bool = False  # each sampled token's log-prob (no top alternatives)
    ignore_eos: bool = False  # an extension (as in vLLM and sglang): generate past EOS
    # An extension: each choice's routed_experts (MoE, a worker with record_routing), for replay.
    return_routing: bool = False
    # Chat with tools (tool_choice not "none"): the reply's <tool_call> blocks are its tool_calls.
    tool_calls: bool = False


def finite_number(value) -> float | None:
    """``value`` as a float if it is a JSON number a float holds (not a bool, not an integer
    past float's range, whose conversion raised an OverflowError, a 500), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if finite_number(value) is None:
        raise invalid(name, f"'{name}' must be a number, got {value!r:.80}")
    if value > high or value < low or (low_open and value == low):
        bounds = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise invalid(name, f"'{name}' must be in {bounds}, got {value!r:.80}")
    return float(value)


def _int(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"'{name}' must be an integer, got {value!r:.80}")
    if not low <= value <= high:
        raise invalid(name, f"'{name}' must be in [{low}, {high}], got {value!r:.80}")
    return value


def _zero_or_null(body: dict, name: str) -> int | None:
    """The completions ``logprobs`` and chat ``top_logprobs``: how many top alternatives to
    return per token, which the engine does not compute, so 0 is the only count."""
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value != 0):
        raise invalid(
            name,
            f"'{name}' must be 0 or null: only the sampled token's log-prob is returned, "
            f"no top alternatives (got {value!r:.80})",
        )
    return value


def _top_k(body: dict) -> int:
    """The ``top_k`` extension: -1 (or 0, as vLLM takes it) keeps every token."""
    top_k = _int(body, "top_k", -1, -1, 2**63 - 1)
    return -1 if top_k == 0 else top_k


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_STOP_TOKEN_IDS
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in ids)
    ):
        raise invalid(
            "stop_token_ids",
            f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, got {ids!r:.80}",
        )
    return tuple(ids)


def _plain_text_format(response_format) -> None:
    """A 400 for a format the output would have to follow (JSON mode, a schema): nothing
    constrains the sampling, and a client relying on it would get a 200 and text of any shape."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if response_format is None or kind == "text":
        return
    shown = f"type {kind!r:.40}" if isinstance(kind, str) else f"{response_format!r:.80}"
    raise invalid(
        "response_format",
        f"'response_format' {shown} is not supported by this server: it does not constrain the output "
        '(leave it out, or send {"type": "text"})',
    )


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    return stop


def _common(
    body: dict, prompts: list, prompt_field: str, max_tokens: int | None, context_length: int
) -> GenerationRequest:
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        # Of the neutral value's own type: true is not 1.
        if not any(type(value) is type(v) and value == v for v in neutral):
            raise invalid(name, f"'{name}' is not supported by this server")
    _plain_text_format(body.get("response_format"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream", f"'stream' must be a boolean, got {stream!r:.80}")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise invalid("stream_options", "'stream_options' is only allowed with 'stream': true")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise invalid("stream_options", "'stream_options' must be an object")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("stream_options", f"'stream_options.include_usage' must be a boolean, got {include_usage!r:.80}")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid("ignore_eos", f"'ignore_eos' must be a boolean, got {ignore_eos!r:.80}")
    return_routing = body.get("return_routing", False)
    if not isinstance(return_routing, bool):
        raise invalid("return_routing", f"'return_routing' must be a boolean, got {return_routing!r:.80}")
    if return_routing and stream:
        raise invalid("return_routing", "'return_routing' is not supported with 'stream': true")
    if max_tokens is not None and max_tokens >= context_length:
        raise invalid(
            "max_tokens",
            f"'max_tokens' is {max_tokens}; the model's context length is {context_length} tokens (prompt included)",
        )
    return GenerationRequest(
        prompts=prompts,
        prompt_field=prompt_field,
        n=_int(body, "n", 1, 1, MAX_N),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=_int(body, "seed", None, *CALL_SEED_RANGE),
        stop=_stop(body),
        top_k=_top_k(body),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        stop_token_ids=_stop_token_ids(body),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=ignore_eos,
        return_routing=return_routing,
    )


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def completion_request(body: dict, context_length: int) -> GenerationRequest:
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a token-id list or a
    list of token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise invalid(
            "prompt",
            "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists (non-empty)",
        )
    if any(isinstance(p, str) and not p for p in prompts):
        raise invalid("prompt", "'prompt' has an empty string")
    max_tokens = _int(body, "max_tokens", 16, 1, 2**31 - 1)
    logprobs = _zero_or_null(body, "logprobs")
    request = _common(body, prompts, "prompt", max_tokens, context_length)
    return dataclasses.replace(request, logprobs=logprobs is not None)


def chat_messages(body: dict) -> list[dict]:
    """``messages`` as chat templates take them (``rollout.chat.normalize_messages``: text parts
    joined, tool-call arguments as objects)."""
    try:
        return normalize_messages(body.get("messages"))
    except ChatError as exc:
        raise invalid(exc.field, str(exc)) from None


def chat_rendering(body: dict) -> dict:
    """How the messages are rendered (``rollout.chat.render_chat``'s options), from vLLM's and
    SGLang's chat extensions: ``chat_template_kwargs`` (template variables, such as Qwen3's
    ``enable_thinking``), ``continue_final_message`` (the last, assistant, message left open for
    the model to continue) and ``add_generation_prompt`` (default: true unless continuing)."""
    continue_final = body.get("continue_final_message", False)
    if not isinstance(continue_final, bool):
        raise invalid(
            "continue_final_message", f"'continue_final_message' must be a boolean, got {continue_final!r:.80}"
        )
    generation_prompt = body.get("add_generation_prompt", not continue_final)
    if not isinstance(generation_prompt, bool):
        raise invalid(
            "add_generation_prompt", f"'add_generation_prompt' must be a boolean, got {generation_prompt!r:.80}"
        )
    try:
        variables = normalize_template_kwargs(body.get("chat_template_kwargs"))
    except ChatError as exc:
        raise invalid(exc.field, str(exc)) from None
    return {
        "add_generation_prompt": generation_prompt,
        "continue_final_message": continue_final,
        "template_kwargs": variables,
    }


TOOL_CHOICES = ("auto", "none")


def chat_tools(body: dict) -> tuple[list[dict] | None, bool]:
    """The request's function tools (None: none) and whether the reply is read for tool calls.

    ``tool_choice`` "none" keeps the tools in the prompt (as OpenAI does: the model knows them)
    and returns the text as written; "required" and a named function are refused: this server
    cannot make the model call a tool.
    """
    try:
        tools = normalize_tools(body.get("tools"))
    except ChatError as exc:
        raise invalid(exc.field, str(exc)) from None
    choice = body.get("tool_choice")
    if choice is not None and choice not in TOOL_CHOICES:
        raise invalid(
            "tool_choice",
            f"'tool_choice' must be 'auto' or 'none', got {choice!r:.80}: this server cannot make the model "
            "call a tool ('required' or a named function)",
        )
    return tools, tools is not None and choice != "none"


def chat_request(
    body: dict, prompt_ids: list[int], context_length: int, *, tool_calls: bool = False
) -> GenerationRequest:
    """``POST /v1/chat/completions`` once the messages are rendered to ``prompt_ids``
    (``tool_calls``: from :func:`chat_tools`)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None, 1, 2**31 - 1)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise invalid("logprobs", f"'logprobs' must be a boolean, got {logprobs!r:.80}")
    _zero_or_null(body, "top_logprobs")
    request = _common(body, [prompt_ids], "messages", max_tokens, context_length)
    return dataclasses.replace(request, logprobs=bool(logprobs), tool_calls=tool_calls)


def check_bearer(request, token: str, what: str) -> None:
    """401 without ``Authorization: Bearer <token>``, 403 with another token."""
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise ApiError(
            401,
            f"missing {what}: send 'Authorization: Bearer <{what}>'",
            type="authentication_error",
            code="missing_token",
        )
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(403, f"wrong {what}", type="permission_error", code="invalid_token")
