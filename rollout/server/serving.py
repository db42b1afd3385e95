"""Generation routes: a serving base (checks, sampling, responses, server-sent events) and its
completions and chat flavours, which differ only in how a request is read and how text and
log-probs are laid out."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..chat import ChatError, ToolCallStream, parse_tool_calls, render_chat
from ..errors import check_limit
from ..sampling import call_tokens, encode_text
from .errors import api_error
from .protocol import (
    GenerationRequest,
    chat_messages,
    chat_rendering,
    chat_request,
    chat_tools,
    completion_request,
    invalid,
)
from .state import SharedState
from .text import IncrementalText, TokenBytes
from .tools import call_id_prefix, reply_message, split_piece

logger = logging.getLogger(__name__)

WEIGHT_VERSION_HEADER = "X-Weight-Version"
_FINISH_REASONS = {"length": "length"}  # every other engine finish (eos, stop token) is "stop"


class Serving:
    """One generation route over the shared state; subclasses say how requests and choices look."""

    id_prefix: str
    object_name: str
    chunk_object_name: str
    # usage.prompt_tokens_details.cached_tokens: the prompt tokens found in the prefix cache.
    reports_cached_tokens = False

    def __init__(self, state: SharedState):
        self.state = state
        self.backend = state.backend
        tokenizer = state.backend.tokenizer
        self.token_bytes = TokenBytes(tokenizer) if tokenizer is not None else None

    # ---- what subclasses define ----------------------------------------------------------------

    def parse(self, body: dict) -> GenerationRequest:
        raise NotImplementedError

    def content(self, text: str) -> dict:
        """A whole choice's text."""
        raise NotImplementedError

    def reply(self, req: GenerationRequest, text: str, call_ids: str) -> tuple[dict, bool]:
        """A whole choice's fields for its text, and whether it called tools (its tool calls'
        ids start with ``call_ids``)."""
        return self.content(text), False

    def splitter(self, req: GenerationRequest, call_ids: str) -> ToolCallStream | None:
        """What splits a streamed choice's text into content and tool calls (None: no tools)."""
        return None

    def delta(self, row: int, piece: str | None, tool_calls: list[dict] | None = None) -> dict:
        """A streamed choice's new text (None: no text, the last event of the choice) and the
        tool calls it completed."""
        raise NotImplementedError

    def opening_choices(self, rows: int) -> list[dict]:
        """Choices sent before any text (one event each)."""
        return []

    def logprobs_body(self, ids: list[int], values: list[float], offsets: list[int]) -> dict:
        """The log-probs object of tokens ``ids`` whose texts start at ``offsets``."""
        raise NotImplementedError

    # ---- the route -----------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        self.state.check_api_key(request)
        body = await self.state.read_json(request)
        lora = self.state.check_model(body)
        # Rendering and tokenizing run on a thread: a megabyte prompt took the event loop 2 s,
        # every other client's stream and /health with it.
        return await self.respond(request, await asyncio.to_thread(self.parse, body), lora)

    async def respond(self, request: Request, req: GenerationRequest, lora: str | None = None) -> Response:
        request.state.prompt_field = req.prompt_field
        self.state.check_available()
        config = self.state.config
        check_limit(
            req.prompt_field,
            "prompts",
            len(req.prompts),
            "ServerConfig.max_prompts_per_request",
            config.max_prompts_per_request,
        )
        check_limit(
            "n",
            "rows (prompts x n)",
            len(req.prompts) * req.n,
            "ServerConfig.max_rows_per_request",
            config.max_rows_per_request,
        )
        prompts = await asyncio.to_thread(self.prompt_ids, req)
        sampling = self.sampling(req, prompts)
        if lora is not None:
            sampling["lora"] = lora
        tokens = call_tokens(prompts, req.n, sampling["max_new_tokens"])
        what = "tokens (prompt + max_tokens, over every row"
        if req.max_tokens is None:  # a chat's default: the client never named the field
            what += f"; with no max_tokens sent, a row may take the rest of the context: {sampling['max_new_tokens']}"
        what += ")"
        check_limit(
            "max_tokens",
            what,
            tokens,
            "ServerConfig.max_tokens_per_request",
            config.max_tokens_per_request,
        )
        base = {
            "id": f"{self.id_prefix}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": lora or self.state.model_name,
        }
        if req.stream:
            chunks = self.backend.stream(prompts, **sampling)
            # A client may leave while its rows wait for admission, before any chunk: watched
            # as a whole answer's is, so its rows never run for nobody.
            first = await _unless_disconnected(request, anext(chunks))
            if first is None:
                await chunks.aclose()
                return Response(status_code=499)
            base["weight_version"] = first.weight_version
            events = self.events(request, req, prompts, base, first, chunks)
            headers = {WEIGHT_VERSION_HEADER: str(first.weight_version), "Cache-Control": "no-cache"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)

        batch = await _unless_disconnected(request, self.backend.generate(prompts, **sampling))
        if batch is None:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        choices = [self.choice(req, batch, row, base["id"]) for row in range(len(batch.completions))]
        completion_tokens = sum(len(choice["token_ids"]) for choice in choices)
        request.state.tokens = (sum(map(len, batch.prompts)), completion_tokens)
        cached = _cached_prompt_tokens(batch) if self.reports_cached_tokens else None
        body = {
            **base,
            "weight_version": batch.weight_version,
            "object": self.object_name,
            "choices": choices,
            "usage": _usage(sum(map(len, batch.prompts)), completion_tokens, cached),
        }
        return JSONResponse(body, headers={WEIGHT_VERSION_HEADER: str(batch.weight_version)})

    def choice(self, req: GenerationRequest, batch, row: int, request_id: str) -> dict:
        """Row ``row`` of a generated batch as the response's choice: the text up to a stop
        string, the tokens that make it and their log-probs, versions and routing."""
        ids = batch.completions[row]
        text, logprobs, stopped = batch.completion_texts[row] if batch.completion_texts is not None else "", None, False
        if req.stop or req.logprobs:  # which tokens make the returned text
            row_text = IncrementalText(self.backend.tokenizer, req.stop)
            row_text.add(ids)
            row_text.finish()
            text, ids, stopped = row_text.text, ids[: row_text.kept], row_text.stopped
            if req.logprobs:
                start = batch.prompt_width
                values = batch.logprobs[row, start : start + len(ids)].tolist()
                logprobs = self.logprobs_body(ids, values, [row_text.start_offset(i) for i in range(len(ids))])
        fields, called = self.reply(req, text, call_id_prefix(request_id, row))
        choice = {
            "index": row,
            **fields,
            "finish_reason": _finish_reason(batch.finish_reasons[row], stopped, called),
            "logprobs": logprobs,
            "token_ids": ids,
        }
        if batch.token_versions is not None:  # extension: the weight version that sampled each token
            start = batch.prompt_width
            choice["token_versions"] = batch.token_versions[row, start : start + len(ids)].tolist()
        if req.return_routing:  # extension: [prompt + completion tokens][MoE layers][top_k], -1 for none
            prompt = batch.prompts[batch.prompt_index[row]]
            first = batch.prompt_width - len(prompt)
            choice["routed_experts"] = batch.routed_experts[row, first : batch.prompt_width + len(ids)].tolist()
            # The tokens the routing's first entries belong to: a chat prompt is the template's
            # rendering, which a client would otherwise have to repeat exactly to line them up.
            choice["prompt_token_ids"] = list(prompt)
        return choice

    # ---- request to sampling -------------------------------------------------------------------

    def prompt_ids(self, req: GenerationRequest) -> list[list[int]]:
        """Token ids of every prompt (strings encoded as the worker would), for exact usage."""
        tokenizer = self.backend.tokenizer
        ids = []
        for i, prompt in enumerate(req.prompts):
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise invalid(
                        req.prompt_field,
                        f"{req.prompt_field}[{i}] is a string but the model has no tokenizer: send token ids",
                    )
                prompt = encode_text(tokenizer, prompt, f"prompts[{i}]")  # named as the worker names it
                if not prompt:
                    raise invalid(req.prompt_field, f"{req.prompt_field}[{i}] encodes to no tokens")
            ids.append(list(prompt))
        return ids

    def sampling(self, req: GenerationRequest, prompts: list[list[int]]) -> dict:
        max_tokens = req.max_tokens
        if max_tokens is None:  # chat without a limit: as many as the engine allows the prompt
            max_tokens = self.backend.max_request_tokens - len(prompts[0])
            if max_tokens < 1:
                raise invalid(
                    "messages",
                    f"the rendered messages have {len(prompts[0])} tokens: no room for a completion "
                    f"(at most {self.backend.max_request_tokens} tokens per request)",
                )
        return dict(
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            max_new_tokens=max_tokens,
            stop_token_ids=[*req.stop_token_ids, *self.single_token_stops(req.stop)] or None,
            seed=req.seed,
            return_logprobs=req.logprobs,
            ignore_eos=req.ignore_eos,
            return_routing=req.return_routing,
        )

    def single_token_stops(self, stop: list[str]) -> list[int] | None:
        """Stop strings that are one token stop the engine itself; the others cut the text."""
        tokenizer = self.backend.tokenizer
        if tokenizer is None or not stop:
            return []
        ids = [tokenizer.encode(s, add_special_tokens=False) for s in stop]
        return [t[0] for t in ids if len(t) == 1]

    def token_texts(self, ids: list[int]) -> list[str]:
        tokenizer = self.backend.tokenizer
        return [tokenizer.decode([t]) if tokenizer is not None else str(t) for t in ids]

    # ---- streaming -----------------------------------------------------------------------------

    async def events(self, request, req, prompts, base, first, chunks) -> AsyncIterator[str]:
        """Server-sent events as the engine's tokens arrive: per choice, text increments (with
        the log-probs of the tokens that make them; chat with tools: content and each tool call
        once its block closed), then a last event with its finish reason and token ids;
        optionally usage; then [DONE]. Once every choice has stopped (a stop string) the rest of
        the generation is abandoned."""
        usage = {"usage": None} if req.include_usage else {}

        def event(choices: list[dict], **extra) -> str:
            return (
                "data: "
                + json.dumps({**base, "object": self.chunk_object_name, "choices": choices, **usage, **extra})
                + "\n\n"
            )

        def choice(row: int, piece: str | None, finish: str | None = None, tool_calls=None, **extra) -> dict:
            return {**self.delta(row, piece, tool_calls), "finish_reason": finish, "logprobs": None, **extra}

        rows = len(prompts) * req.n
        texts = [IncrementalText(self.backend.tokenizer, req.stop) for _ in range(rows)]
        splitters = [self.splitter(req, call_id_prefix(base["id"], row)) for row in range(rows)]
        # Per prompt, the prompt tokens the engine found cached (on each chunk; its first
        # choice's, as usage counts each prompt once); None until one of its rows reports it.
        cached: list[int | None] = [None] * len(prompts)
        values: list[list[float]] = [[] for _ in range(rows)]  # log-probs so far
        versions: list[list[int] | None] = [[] for _ in range(rows)]  # weight version per token so far
        released = [0] * rows  # tokens whose log-probs were sent
        done = [False] * rows
        try:
            for opening in self.opening_choices(rows):
                yield event([opening])
            chunk = first
            while chunk is not None and not all(done):
                text = texts[chunk.row]
                if chunk.cached_tokens is not None and (cached[chunk.prompt_index] is None or chunk.sample_index == 0):
                    cached[chunk.prompt_index] = chunk.cached_tokens
                if not done[chunk.row]:
                    if req.logprobs:
                        values[chunk.row].extend(chunk.logprobs)
                    if chunk.token_versions is None or versions[chunk.row] is None:
                        versions[chunk.row] = None
                    else:
                        versions[chunk.row] += chunk.token_versions
                    piece = text.add(chunk.token_ids)
                    finished = chunk.finish_reason is not None or text.stopped
                    if finished:
                        piece += text.finish()
                    piece, calls = split_piece(splitters[chunk.row], piece, finished)
                    start, end = released[chunk.row], text.kept
                    if piece or calls or (req.logprobs and end > start):
                        logprobs = None
                        if req.logprobs:
                            ids = text.token_ids[start:end]
                            logprobs = self.logprobs_body(
                                ids, values[chunk.row][start:end], [text.start_offset(i) for i in range(start, end)]
                            )
                            released[chunk.row] = end
                        yield event([choice(chunk.row, piece, tool_calls=calls, logprobs=logprobs)])
                    if finished:
                        done[chunk.row] = True
                        splitter = splitters[chunk.row]
                        called = splitter is not None and bool(splitter.tool_calls)
                        reason = _finish_reason(chunk.finish_reason, text.stopped, called)
                        extra = {"token_ids": text.token_ids[: text.kept]}
                        if versions[chunk.row] is not None:
                            extra["token_versions"] = versions[chunk.row][: text.kept]
                        yield event([choice(chunk.row, None, reason, **extra)])
                if not all(done):
                    chunk = await anext(chunks, None)
        except Exception as exc:  # the status line is sent: the error goes into the stream
            error = api_error(exc, prompt_field=req.prompt_field, where=f"stream {base['id']}")
            yield "data: " + json.dumps(error.body()) + "\n\n"
            return
        finally:
            request.state.tokens = (sum(map(len, prompts)), sum(t.kept for t in texts))
            await chunks.aclose()  # abandons rows still generating
        if req.include_usage:
            known = sum(c or 0 for c in cached) if self.reports_cached_tokens else None
            yield event([], usage=_usage(sum(map(len, prompts)), sum(t.kept for t in texts), known))
        yield "data: [DONE]\n\n"


class CompletionServing(Serving):
    """``POST /v1/completions``."""

    id_prefix = "cmpl"
    object_name = chunk_object_name = "text_completion"

    def parse(self, body: dict) -> GenerationRequest:
        return completion_request(body, self.backend.context_length)

    def content(self, text: str) -> dict:
        return {"text": text}

    def delta(self, row: int, piece: str | None, tool_calls: list[dict] | None = None) -> dict:
        return {"index": row, "text": piece or ""}

    def logprobs_body(self, ids: list[int], values: list[float], offsets: list[int]) -> dict:
        return {"tokens": self.token_texts(ids), "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


class ChatServing(Serving):
    """``POST /v1/chat/completions``: messages (and tools) rendered with the tokenizer's chat
    template; with tools, the reply's tool calls read back (``rollout.chat``)."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    reports_cached_tokens = True

    def parse(self, body: dict) -> GenerationRequest:
        messages = chat_messages(body)
        tools, tool_calls = chat_tools(body)
        prompt_ids = self.render(messages, tools, chat_rendering(body))
        return chat_request(body, prompt_ids, self.backend.context_length, tool_calls=tool_calls)

    def render(self, messages: list[dict], tools: list[dict] | None, options: dict) -> list[int]:
        tokenizer = self.backend.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise invalid("messages", "the model directory's tokenizer has no chat template: use /v1/completions")
        try:
            text = render_chat(tokenizer, messages, tools=tools, **options)
        except ChatError as exc:  # the field, or the template's own error (what the messages lack)
            raise invalid(exc.field, str(exc)) from None
        return encode_text(tokenizer, text, "messages")

    def content(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def reply(self, req: GenerationRequest, text: str, call_ids: str) -> tuple[dict, bool]:
        if not req.tool_calls:
            return self.content(text), False
        turn = parse_tool_calls(text, id_prefix=call_ids)
        return {"message": reply_message(turn)}, bool(turn.tool_calls)

    def splitter(self, req: GenerationRequest, call_ids: str) -> ToolCallStream | None:
        return ToolCallStream(id_prefix=call_ids) if req.tool_calls else None

    def delta(self, row: int, piece: str | None, tool_calls: list[dict] | None = None) -> dict:
        if piece is None:
            return {"index": row, "delta": {}}
        delta = {"content": piece} if piece or not tool_calls else {}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"index": row, "delta": delta}

    def opening_choices(self, rows: int) -> list[dict]:
        return [
            {"index": row, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
            for row in range(rows)
        ]

    def logprobs_body(self, ids: list[int], values: list[float], offsets: list[int]) -> dict:
        token_bytes = self.token_bytes
        return {
            "content": [
                {
                    "token": tok,
                    "logprob": lp,
                    "bytes": list(token_bytes(t)) if token_bytes else list(tok.encode()),
                    "top_logprobs": [],
                }
                for t, tok, lp in zip(ids, self.token_texts(ids), values)
            ]
        }


def _finish_reason(engine_reason: str | None, stopped_by_string: bool, called_tools: bool) -> str:
    """A choice's OpenAI finish reason: its tool calls, a stop string, or the engine's finish."""
    if called_tools:
        return "tool_calls"
    return "stop" if stopped_by_string else _FINISH_REASONS.get(engine_reason, "stop")


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def _cached_prompt_tokens(batch) -> int:
    """The prompt tokens the engine found in its prefix cache: per prompt, its first choice's
    (usage counts each prompt once, whatever ``n``; a prompt's samples share its prefill); 0 from
    a backend that does not say."""
    if batch.cached_tokens is None:
        return 0
    return int(batch.cached_tokens[:: batch.n].sum())


async def _unless_disconnected(request: Request, awaitable):
    """``awaitable``'s result, or None once the client has gone (then it is cancelled, which
    aborts its rows in the engine)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left (or this request's task is being cancelled)
            work.cancel()
    if not work.done():
        with contextlib.suppress(asyncio.CancelledError):
            await work
    if not work.cancelled():
        return work.result()
    logger.info("%s left before its response: generation abandoned", request.client)
    return None


async def _disconnected(request: Request) -> None:
    # The body was read: the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
