"""Tool calls in chat replies, in OpenAI's shapes: a whole choice's ``message`` and a streamed
choice's ``delta.tool_calls`` (which the openai client's stream accumulation joins back into
the message's calls). Reading them from the model's text is ``rollout.chat``'s."""

from __future__ import annotations

from ..chat import ParsedTurn, ToolCall, ToolCallStream


def call_id_prefix(response_id: str, row: int) -> str:
    """The ids of choice ``row``'s tool calls are ``{prefix}_{k}``: unique across responses (the
    response id's random part) so that a conversation's ``tool`` messages name one call each."""
    return f"call_{response_id.rsplit('-', 1)[-1][:16]}_{row}"


def reply_message(turn: ParsedTurn) -> dict:
    """A choice's ``message``: the text outside the well-formed calls as ``content`` (null when
    calls left none) and the calls as ``tool_calls`` (absent when there are none)."""
    if not turn.tool_calls:
        return {"role": "assistant", "content": turn.content}
    return {"role": "assistant", "content": turn.content or None, "tool_calls": [c.openai() for c in turn.tool_calls]}


def tool_call_deltas(calls: list[ToolCall], first: int) -> list[dict]:
    """``delta.tool_calls`` entries for calls completed together, ``first`` being the index of
    the first of them among the choice's calls. Each call is sent whole, in one entry (id, name
    and all of its arguments), once its block closed."""
    return [{"index": first + k, **call.openai()} for k, call in enumerate(calls)]


def split_piece(splitter: ToolCallStream | None, piece: str, finished: bool) -> tuple[str, list[dict]]:
    """A streamed choice's new text as content to send and ``delta.tool_calls`` entries
    (``finished``: the choice's last text); without a splitter (no tools) the text as it is."""
    if splitter is None:
        return piece, []
    first = len(splitter.tool_calls)
    content, calls = splitter.add(piece)
    if finished:
        content += splitter.finish()
    return content, tool_call_deltas(calls, first)
