"""Generation routes: a serving base (checks, sampling, responses, server-sent events) and its
completions and chat flavours, which differ only in how a request is read and how text and
log-probs are laid out."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .errors import api_error
from .protocol import GenerationRequest, chat_messages, chat_request, completion_request, invalid
from .state import SharedState
from .text import IncrementalText, stop_index

logger = logging.getLogger(__name__)

WEIGHT_VERSION_HEADER = "X-Weight-Version"
_FINISH_REASONS = {"length": "length"}  # every other engine finish (eos, stop token) is "stop"


class Serving:
    """One generation route over the shared state; subclasses say how requests and choices look."""

    id_prefix: str
    object_name: str
    chunk_object_name: str

    def __init__(self, state: SharedState):
        self.state = state
        self.backend = state.backend

    # ---- what subclasses define ----------------------------------------------------------------

    def parse(self, body: dict) -> GenerationRequest:
        raise NotImplementedError

    def content(self, text: str) -> dict:
        """A whole choice's text."""
        raise NotImplementedError

    def delta(self, row: int, piece: str | None) -> dict:
        """A streamed choice's new text (None: no text, the last event of the choice)."""
        raise NotImplementedError

    def opening_choices(self, rows: int) -> list[dict]:
        """Choices sent before any text (one event each)."""
        return []

    def logprobs_body(self, tokens: list[str], values: list[float]) -> dict:
        raise NotImplementedError

    # ---- the route -----------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        self.state.check_api_key(request)
        body = await self.state.read_json(request)
        self.state.check_model(body)
        return await self.respond(request, self.parse(body))

    async def respond(self, request: Request, req: GenerationRequest) -> Response:
        request.state.prompt_field = req.prompt_field
        self.state.check_available()
        prompts = self.prompt_ids(req)
        sampling = self.sampling(req, prompts)
        base = {"id": f"{self.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.state.model_name}
        if req.stream:
            chunks = self.backend.stream(prompts, **sampling)
            first = await anext(chunks)
            base["weight_version"] = first.weight_version
            events = self.events(request, req, prompts, base, first, chunks)
            headers = {WEIGHT_VERSION_HEADER: str(first.weight_version), "Cache-Control": "no-cache"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)

        batch = await self.backend.generate(prompts, **sampling)
        request.state.tokens = (sum(map(len, batch.prompts)), int(batch.completion_lengths.sum()))
        choices = []
        for row, ids in enumerate(batch.completions):
            text = batch.completion_texts[row] if batch.completion_texts is not None else ""
            finish = _FINISH_REASONS.get(batch.finish_reasons[row], "stop")
            cut = stop_index(text, req.stop)
            if cut >= 0:
                text, finish = text[:cut], "stop"
            logprobs = None
            if req.logprobs:
                start = batch.prompt_width
                values = batch.logprobs[row, start : start + len(ids)].tolist()
                logprobs = self.logprobs_body(self.token_texts(ids), values)
            choices.append({"index": row, **self.content(text), "finish_reason": finish, "logprobs": logprobs, "token_ids": ids})
        body = {
            **base,
            "weight_version": batch.weight_version,
            "object": self.object_name,
            "choices": choices,
            "usage": _usage(sum(map(len, batch.prompts)), int(batch.completion_lengths.sum())),
        }
        return JSONResponse(body, headers={WEIGHT_VERSION_HEADER: str(batch.weight_version)})

    # ---- request to sampling -------------------------------------------------------------------

    def prompt_ids(self, req: GenerationRequest) -> list[list[int]]:
        """Token ids of every prompt (strings encoded as the worker would), for exact usage."""
        tokenizer = self.backend.tokenizer
        ids = []
        for i, prompt in enumerate(req.prompts):
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise invalid(req.prompt_field, f"{req.prompt_field}[{i}] is a string but the model has no tokenizer: send token ids")
                prompt = tokenizer.encode(prompt, add_special_tokens=False)
                if not prompt:
                    raise invalid(req.prompt_field, f"{req.prompt_field}[{i}] encodes to no tokens")
            ids.append(list(prompt))
        return ids

    def sampling(self, req: GenerationRequest, prompts: list[list[int]]) -> dict:
        max_tokens = req.max_tokens
        if max_tokens is None:  # chat without a limit: the rest of the context
            max_tokens = self.backend.context_length - len(prompts[0])
            if max_tokens < 1:
                raise invalid("messages", f"the rendered messages have {len(prompts[0])} tokens, the whole context length {self.backend.context_length}")
        return dict(
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            max_new_tokens=max_tokens,
            stop_token_ids=self.single_token_stops(req.stop),
            seed=req.seed,
            return_logprobs=req.logprobs,
            ignore_eos=req.ignore_eos,
        )

    def single_token_stops(self, stop: list[str]) -> list[int] | None:
        """Stop strings that are one token stop the engine itself; the others cut the text."""
        tokenizer = self.backend.tokenizer
        if tokenizer is None or not stop:
            return None
        ids = [tokenizer.encode(s, add_special_tokens=False) for s in stop]
        return [t[0] for t in ids if len(t) == 1] or None

    def token_texts(self, ids: list[int]) -> list[str]:
        tokenizer = self.backend.tokenizer
        return [tokenizer.decode([t]) if tokenizer is not None else str(t) for t in ids]

    # ---- streaming -----------------------------------------------------------------------------

    async def events(self, request, req, prompts, base, first, chunks) -> AsyncIterator[str]:
        """Server-sent events as the engine's tokens arrive: per choice, text increments, then
        a last event with its finish reason and token ids; optionally usage; then [DONE]."""

        def event(choices: list[dict], **extra) -> str:
            return "data: " + json.dumps({**base, "object": self.chunk_object_name, "choices": choices, **extra}) + "\n\n"

        def choice(row: int, piece: str | None, finish: str | None = None, **extra) -> dict:
            return {**self.delta(row, piece), "finish_reason": finish, "logprobs": None, **extra}

        rows = len(prompts) * req.n
        texts = [IncrementalText(self.backend.tokenizer, req.stop) for _ in range(rows)]
        done = [False] * rows
        generated = 0
        try:
            for opening in self.opening_choices(rows):
                yield event([opening])
            chunk = first
            while chunk is not None:
                generated += len(chunk.token_ids)
                text = texts[chunk.row]
                if not done[chunk.row]:
                    piece = text.add(chunk.token_ids)
                    finished = chunk.finish_reason is not None or text.stopped
                    if finished:
                        piece += text.finish()
                    if piece or (req.logprobs and chunk.token_ids):
                        logprobs = None
                        if req.logprobs:
                            logprobs = self.logprobs_body(self.token_texts(chunk.token_ids), chunk.logprobs)
                        yield event([choice(chunk.row, piece, logprobs=logprobs)])
                    if finished:
                        done[chunk.row] = True
                        reason = "stop" if text.stopped else _FINISH_REASONS.get(chunk.finish_reason, "stop")
                        yield event([choice(chunk.row, None, reason, token_ids=text.token_ids)])
                chunk = await anext(chunks, None)
        except Exception as exc:  # the status line is sent: the error goes into the stream
            error = api_error(exc, prompt_field=req.prompt_field, where=f"stream {base['id']}")
            yield "data: " + json.dumps(error.body()) + "\n\n"
            return
        finally:
            request.state.tokens = (sum(map(len, prompts)), generated)
            await chunks.aclose()
        if req.include_usage:
            yield event([], usage=_usage(sum(map(len, prompts)), generated))
        yield "data: [DONE]\n\n"


class CompletionServing(Serving):
    """``POST /v1/completions``."""

    id_prefix = "cmpl"
    object_name = chunk_object_name = "text_completion"

    def parse(self, body: dict) -> GenerationRequest:
        return completion_request(body, self.backend.context_length)

    def content(self, text: str) -> dict:
        return {"text": text}

    def delta(self, row: int, piece: str | None) -> dict:
        return {"index": row, "text": piece or ""}

    def logprobs_body(self, tokens: list[str], values: list[float]) -> dict:
        offsets = [0]
        for tok in tokens[:-1]:
            offsets.append(offsets[-1] + len(tok))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


class ChatServing(Serving):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def parse(self, body: dict) -> GenerationRequest:
        return chat_request(body, self.render(chat_messages(body)), self.backend.context_length)

    def render(self, messages: list[dict]) -> list[int]:
        tokenizer = self.backend.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise invalid("messages", "the model directory's tokenizer has no chat template: use /v1/completions")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a Jinja template error names what the messages lack
            raise invalid("messages", f"cannot render messages with the chat template: {exc}") from None
        return tokenizer.encode(text, add_special_tokens=False)

    def content(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def delta(self, row: int, piece: str | None) -> dict:
        return {"index": row, "delta": {} if piece is None else {"content": piece}}

    def opening_choices(self, rows: int) -> list[dict]:
        return [{"index": row, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None} for row in range(rows)]

    def logprobs_body(self, tokens: list[str], values: list[float]) -> dict:
        return {
            "content": [
                {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                for tok, lp in zip(tokens, values)
            ]
        }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
