"""Chat prompts and tool calls: the one place the HTTP server's chat route and multi-turn
episodes render OpenAI-format messages with a model's chat template and read back the tool calls
a model writes.

Tool calls follow the convention of Qwen2.5, Qwen3 and Hermes: each call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in the assistant's text, one block per call, with text before, between or after them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import weakref
from collections.abc import Mapping
from typing import Any

from .errors import RolloutError

logger = logging.getLogger(__name__)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def completion_text(tokenizer, token_ids) -> str:
    """The text of a completion's ``token_ids``: special tokens skipped, but the tool-call markup
    kept where the tokenizer registers it as special (a fine-tune's ``add_special_tokens``; Qwen's
    own is not): skipped, every call the model wrote was lost to the parser, silently."""
    skipped = _skipped_ids(tokenizer)
    if skipped is None:
        return tokenizer.decode(token_ids, skip_special_tokens=True)
    return tokenizer.decode([i for i in token_ids if i not in skipped], skip_special_tokens=False)


# tokenizer -> the special ids completion_text skips (None where that is every one). Read once
# per tokenizer (the worker's and the server's are loaded once and never change): the streaming
# path decodes twice a token, and a tokenizer builds its added tokens anew at each read (Llama
# 3's 256 reserved ones: ~150 us; its len() ~30 us).
_SKIPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _skipped_ids(tokenizer) -> frozenset[int] | None:
    if tokenizer not in _SKIPPED:
        added = getattr(tokenizer, "added_tokens_decoder", {})
        special = {i for i, token in added.items() if token.special}
        markup = {i for i in special if added[i].content in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)}
        _SKIPPED[tokenizer] = frozenset((special | set(tokenizer.all_special_ids)) - markup) if markup else None
    return _SKIPPED[tokenizer]


class ChatError(RolloutError, ValueError):
    """Messages or tools a chat template cannot take, or a template that fails. ``field`` names
    where, as a path in an OpenAI request body (``messages[2].tool_calls[0].function.arguments``,
    ``tools[1].function.name``; ``messages`` for the template itself); the message starts with it
    or says it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One tool call a model wrote: the function's name, its arguments, and an id that the
    ``tool`` message answering it names (``tool_call_id``)."""

    name: str
    arguments: dict
    id: str

    def openai(self) -> dict:
        """OpenAI's form (``message.tool_calls[i]``): the arguments as a JSON string."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A model's turn split into its text and its tool calls.

    ``content`` is the text outside the well-formed tool-call blocks, stripped; a malformed block
    stays in it as written (the model's text is not lost, and a trainer sees what it wrote).
    ``errors`` has one message per malformed block, naming it by its place among the turn's
    blocks (from 1): ``tool call 2 is not JSON: ...``.
    """

    content: str
    tool_calls: list[ToolCall]
    errors: list[str]


def parse_tool_calls(text: str, *, id_prefix: str = "call") -> ParsedTurn:
    """Split a model's turn into content and tool calls (never raises on model output).

    The k-th well-formed call (from 0, as OpenAI's streamed ``index``) gets the id
    ``f"{id_prefix}_{k}"``: give each turn its own prefix where ids must be unique across a
    conversation. ``arguments`` may be an object or a JSON string holding one; missing or null,
    it is ``{}`` (a function without parameters).
    """
    stream = ToolCallStream(id_prefix=id_prefix)
    content, _ = stream.add(text)
    content += stream.finish()
    return ParsedTurn(content, stream.tool_calls, stream.errors)


class ToolCallStream:
    """:func:`parse_tool_calls` as a turn's text arrives (a streamed response).

    :meth:`add` returns the content that is safe to send and the tool calls the new text
    completes; :meth:`finish` returns the content left once the turn ended. Text that may be the
    start of a ``<tool_call>`` block is held back until it is known not to be, so the content sent
    never carries a well-formed call's markup; a malformed block is sent as content once it closes
    (or, unterminated, when the turn ends). Whitespace at the content's ends is held back too: the
    pieces sent, joined, are exactly ``parse_tool_calls(whole text).content``, however the text
    was split.
    """

    def __init__(self, *, id_prefix: str = "call"):
        self.id_prefix = id_prefix
        self.tool_calls: list[ToolCall] = []  # every well-formed call so far
        self.errors: list[str] = []  # one per malformed block so far
        self._pending = ""  # text not sent yet: an open block, or what may begin one
        self._blocks = 0  # blocks closed so far, well-formed or not
        self._space = ""  # whitespace after the content sent, sent only if content follows
        self._started = False  # content was sent (whitespace before it is dropped)

    def add(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        content, calls = [], []
        while True:
            if self._pending.startswith(TOOL_CALL_OPEN):
                end = self._pending.find(TOOL_CALL_CLOSE, len(TOOL_CALL_OPEN))
                if end < 0:
                    break  # the block is still being written
                end += len(TOOL_CALL_CLOSE)
                block, self._pending = self._pending[:end], self._pending[end:]
                call = self._read_block(block)
                if call is None:
                    content.append(block)
                else:
                    calls.append(call)
                continue
            start = self._pending.find(TOOL_CALL_OPEN)
            if start < 0:
                start = len(self._pending) - _opening_suffix(self._pending)
            if start == 0:
                break  # nothing, or only what may begin a block
            content.append(self._pending[:start])
            self._pending = self._pending[start:]
        return self._content("".join(content)), calls

    def finish(self) -> str:
        """The content left once the turn ended: an unterminated block (an error) or text held
        back; whitespace at the end is dropped."""
        rest, self._pending = self._pending, ""
        if rest.startswith(TOOL_CALL_OPEN):
            self._blocks += 1
            self.errors.append(
                f"tool call {self._blocks} is unterminated: no {TOOL_CALL_CLOSE} after its {TOOL_CALL_OPEN}"
            )
        content = self._content(rest)
        self._space = ""
        return content

    def _read_block(self, block: str) -> ToolCall | None:
        """The block's call, or None (its error recorded) when it is malformed."""
        self._blocks += 1
        body = block[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)]
        call, error = _tool_call(body, f"tool call {self._blocks}", f"{self.id_prefix}_{len(self.tool_calls)}")
        if error is not None:
            logger.debug("malformed %s", error)
            self.errors.append(error)
            return None
        self.tool_calls.append(call)
        return call

    def _content(self, text: str) -> str:
        """``text`` as content to send, with whitespace at the content's ends held back."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept) :]
        return kept


def _opening_suffix(text: str) -> int:
    """How many characters at the end of ``text`` may begin ``<tool_call>``."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:size]):
            return size
    return 0


def _json_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: JSON's grammar allows it, no float holds it
        raise ValueError(f"{text} is beyond a float's range")
    return value


def _loads(text: str) -> tuple[Any, str | None]:
    """``text`` parsed as strict JSON (no NaN or Infinity, no number beyond a float's range),
    or why it is not."""
    try:
        return json.loads(text, parse_constant=_json_constant, parse_float=_finite_float), None
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at char {exc.pos}"
    except (ValueError, RecursionError) as exc:  # a NaN; nesting deeper than Python recurses
        return None, str(exc) or type(exc).__name__


def _tool_call(body: str, what: str, call_id: str) -> tuple[ToolCall | None, str | None]:
    """The call a block's JSON body makes, or the error naming ``what`` is wrong."""
    value, error = _loads(body.strip())
    if error is not None:
        return None, f"{what} is not JSON: {error}"
    if not isinstance(value, dict):
        return None, f"{what} is not a JSON object"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None, f"{what} has no string 'name'"
    arguments = value.get("arguments")
    if arguments is None:
        arguments = {}
    elif isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments, error = _loads(arguments)
        if error is not None:
            return None, f"{what}'s 'arguments' is a string that is not JSON: {error}"
    if not isinstance(arguments, dict):
        return None, f"{what}'s 'arguments' is not an object"
    return ToolCall(name, arguments, call_id), None


# ---- rendering -----------------------------------------------------------------------------------


def render_chat(
    tokenizer,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text ``tokenizer``'s chat template writes for OpenAI-format ``messages`` and
    ``tools`` (see :func:`normalize_messages` and :func:`normalize_tools`).

    ``continue_final_message``: the last message (an assistant's) is left open, so the model
    continues its text (a prefill) rather than starting a turn of its own; it excludes
    ``add_generation_prompt``. ``template_kwargs``: more variables for the template, such as
    Qwen3's ``enable_thinking`` (see :func:`normalize_template_kwargs`).

    Raises :class:`ChatError` (a ``ValueError``) naming what is wrong: no chat template, a
    message's or tool's field, tools the template does not write, or the template's own error.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError("messages", "the tokenizer has no chat template")
    plain = normalize_messages(messages)
    tools = normalize_tools(tools)
    variables = normalize_template_kwargs(template_kwargs)
    if continue_final_message:
        if add_generation_prompt:
            raise ChatError(
                "continue_final_message",
                "continue_final_message leaves the last message open for the model: add_generation_prompt, which "
                "starts a new assistant turn after it, must then be false",
            )
        last = f"messages[{len(plain) - 1}]"
        if plain[-1]["role"] != "assistant":
            raise ChatError(
                "continue_final_message",
                f"continue_final_message continues an assistant message, but the last message, {last}, is a "
                f"{plain[-1]['role']!r} message",
            )
        if plain[-1].get("tool_calls"):
            raise ChatError(
                "continue_final_message",
                f"continue_final_message continues an assistant message's text: {last} makes tool calls, which "
                "the template writes after it",
            )
        if not plain[-1]["content"].strip():
            raise ChatError(f"{last}.content", f"{last}.content is empty: there is no text to continue")

    def render(with_tools):
        if continue_final_message:
            return _left_open(tokenizer, plain, with_tools, variables)
        return tokenizer.apply_chat_template(
            plain, tools=with_tools, tokenize=False, add_generation_prompt=add_generation_prompt, **variables
        )

    try:
        text = render(tools)
    except ChatError:
        raise
    except Exception as exc:  # a Jinja error (raise_exception, a missing field) says what the template wants
        raise ChatError("messages", f"cannot render messages with the chat template: {exc}") from None
    if tools:
        try:
            writes_tools = text != render(None)
        except Exception:  # a template that needs tools for these messages (tool messages) writes them
            writes_tools = True
        if not writes_tools:  # the model would never see them
            raise ChatError(
                "tools", "the chat template does not write tools into the prompt: this model cannot take tools"
            )
    return text


_OPEN_END = "\x00continued\x00"


def _left_open(tokenizer, messages: list[dict], tools, variables: dict) -> str:
    """The conversation as the template writes it, cut where the last message's text ends:
    what the template writes after any message's text (``<|im_end|>\n``) is found by rendering
    a stand-in text, and taken off. (HF's ``continue_final_message`` cuts at the last place the
    text occurs, which may be inside that closing markup: a text ``n`` left ``<|im_en``.)"""

    def render(last_text):
        conversation = [*messages[:-1], {**messages[-1], "content": last_text}]
        return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, **variables)

    text = render(messages[-1]["content"])
    marked = render(_OPEN_END)
    _, found, closing = marked.rpartition(_OPEN_END)
    if not found or not text.endswith(closing):
        raise ChatError(
            "continue_final_message",
            "the chat template does not end an assistant message the same way whatever its text: it cannot be left "
            "open",
        )
    return text[: len(text) - len(closing)]


# Names apply_chat_template takes for itself, or sets in the template's context (messages):
# passed as template variables they would change how it renders, not what the template reads.
_RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "conversation",
        "conversations",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_TEMPLATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def normalize_template_kwargs(kwargs: Mapping[str, Any] | None, field: str = "chat_template_kwargs") -> dict:
    """Extra chat-template variables (``{"enable_thinking": False}`` for Qwen3), as vLLM's and
    SGLang's ``chat_template_kwargs`` take them: names a template can read, none that the
    renderer sets itself (the messages, the tools, the generation prompt). Raises
    :class:`ChatError` naming ``field`` and the name."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ChatError(field, f"'{field}' must be an object of template variables, got {type(kwargs).__name__}")
    for name in kwargs:
        if not isinstance(name, str) or not _TEMPLATE_NAME.fullmatch(name):
            raise ChatError(field, f"'{field}' has {name!r:.60}, which is not a template variable's name")
        if name in _RESERVED_TEMPLATE_NAMES:
            raise ChatError(
                f"{field}.{name}",
                f"'{field}.{name}' is set by the renderer itself, not a template variable: pass it as its own "
                "option where there is one",
            )
    return dict(kwargs)


_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


def normalize_messages(messages: list[dict], where: str = "messages") -> list[dict]:
    """OpenAI-format messages as HF chat templates take them.

    Each message keeps its ``role`` and ``content`` (text parts joined; an assistant message with
    tool calls may have none); an assistant's ``tool_calls`` become ``{"id", "type": "function",
    "function": {"name", "arguments": dict}}`` (``arguments`` given as a JSON string is parsed:
    Qwen's templates write it with ``tojson``, which would quote a string again; :class:`ToolCall`
    objects are accepted too); a ``tool`` message keeps its ``tool_call_id`` and ``name``. Other
    fields are dropped. Raises :class:`ChatError` naming the field, under ``where`` (the name
    of the list: ``messages[2].content``).
    """
    if not isinstance(messages, list) or not messages:
        raise ChatError(where, f"'{where}' must be a non-empty list")
    return [normalize_message(message, f"{where}[{i}]") for i, message in enumerate(messages)]


def normalize_message(message: Any, where: str) -> dict:
    """One message of :func:`normalize_messages`, named ``where`` in its errors."""
    if not isinstance(message, Mapping):
        raise ChatError(
            where, f"{where} must be a message (an object with a string 'role'), got {type(message).__name__}"
        )
    role = message.get("role")
    if not isinstance(role, str):
        raise ChatError(f"{where}.role", f"{where}.role must be a string, got {role!r:.60} ({type(role).__name__})")
    # Any name a template may know (system, user, assistant, tool, developer, ipython, ...), but
    # a name: the template writes it into the prompt as it is, so a newline and markup in it
    # would open a turn of another role.
    if not _ROLE.fullmatch(role):
        raise ChatError(
            f"{where}.role",
            f"{where}.role must be a role's name (a letter, then letters, digits, '_' or '-'), got {role!r:.60}",
        )
    calls = message.get("tool_calls")
    if calls and role != "assistant":
        raise ChatError(f"{where}.tool_calls", f"{where}.tool_calls: only assistant messages make tool calls")
    plain: dict[str, Any] = {"role": role}
    if calls:
        if not isinstance(calls, list):
            raise ChatError(f"{where}.tool_calls", f"{where}.tool_calls must be a list")
        plain["tool_calls"] = [_tool_call_message(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    content = message.get("content")
    if content is None and calls:
        content = ""  # OpenAI's null content beside tool calls; templates concatenate strings
    plain["content"] = _text(content, f"{where}.content")
    if role == "tool":
        for key in ("tool_call_id", "name"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                raise ChatError(f"{where}.{key}", f"{where}.{key} must be a string")
            if value is not None:
                plain[key] = value
    return plain


def _text(content: Any, where: str) -> str:
    if isinstance(content, list):
        if not all(
            isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content
        ):
            raise ChatError(where, f"{where}: only text parts are supported")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ChatError(where, f"{where} must be a string or a list of text parts")
    return content


def _tool_call_message(call: Any, where: str) -> dict:
    """An assistant message's tool call with its arguments as an object."""
    if isinstance(call, ToolCall):
        call = call.openai()
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ChatError(where, f"{where} must be an object with a 'function' object")
    if call.get("type", "function") != "function":
        raise ChatError(f"{where}.type", f"{where}.type must be 'function', got {call['type']!r}")
    function = call["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ChatError(f"{where}.function.name", f"{where}.function.name must be a non-empty string")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = {}
    elif isinstance(arguments, str):
        arguments, error = _loads(arguments)
        if error is not None:
            raise ChatError(f"{where}.function.arguments", f"{where}.function.arguments is not JSON: {error}")
    if not isinstance(arguments, Mapping):
        raise ChatError(f"{where}.function.arguments", f"{where}.function.arguments must be a JSON object")
    plain: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}
    call_id = call.get("id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise ChatError(f"{where}.id", f"{where}.id must be a string")
        plain = {"id": call_id, **plain}
    return plain


def normalize_tools(tools: list[dict] | None) -> list[dict] | None:
    """OpenAI function tools (``{"type": "function", "function": {"name", "description",
    "parameters"}}``) checked and passed on as given (Qwen's templates list them in that form);
    None for none (or an empty list). Raises :class:`ChatError` naming the field."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatError("tools", "'tools' must be a list of function tools")
    return [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)] or None


def _tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, Mapping):
        raise ChatError(where, f"{where} must be an object")
    if tool.get("type") != "function":
        raise ChatError(f"{where}.type", f"{where}.type must be 'function', got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ChatError(f"{where}.function", f"{where}.function must be an object")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ChatError(f"{where}.function.name", f"{where}.function.name must be a non-empty string")
    for key, kind, what in (("description", str, "a string"), ("parameters", Mapping, "a JSON Schema object")):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise ChatError(f"{where}.function.{key}", f"{where}.function.{key} must be {what}")
    return {**tool, "function": dict(function)}  # copies: the template gets plain dicts
