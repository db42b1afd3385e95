"""The FastAPI app: OpenAI-compatible generation routes, health, and admin routes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .admin import mount_admin
from .backend import Backend
from .config import ServerConfig
from .errors import KNOWN_ERRORS, api_error, retry_after
from .protocol import (
    ApiError,
    GenerationRequest,
    chat_messages,
    chat_request,
    check_bearer,
    completion_request,
    invalid,
)
from .text import IncrementalText, stop_index

logger = logging.getLogger(__name__)

WEIGHT_VERSION_HEADER = "X-Weight-Version"
_FINISH_REASONS = {"length": "length"}  # every other engine finish (eos, stop token) is "stop"


def build_app(backend: Backend, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="sglang-jax-rollout", docs_url=None, redoc_url=None, openapi_url=None)
    state = ServerState(backend, config)
    app.state.server = state


    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), type=kind).body(), status_code=exc.status_code)

    async def any_error(request: Request, exc: Exception):
        prompt_field = getattr(request.state, "prompt_field", "prompt")
        error = api_error(exc, prompt_field=prompt_field, where=f"{request.method} {request.url.path}")
        return JSONResponse(error.body(), status_code=error.status, headers=retry_after(error, config.retry_after_s))

    # Known types are answered by the app; Exception (the rest) by Starlette's outermost
    # middleware, which also re-raises it for the server's log.
    for kind in (*KNOWN_ERRORS, Exception):
        app.add_exception_handler(kind, any_error)

    app.add_middleware(_RequestLog)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        reason = state.unavailable_reason()
        if reason is None and not backend.kv_present:
            reason = "the KV cache is dropped"
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return {"status": "ready", "weight_version": backend.weight_version}

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_api_key(request)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created, "owned_by": "sglang-jax-rollout"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        state.check_api_key(request)
        body = await state.read_json(request)
        state.check_model(body)
        req = completion_request(body, backend.context_length)
        return await state.respond(request, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        state.check_api_key(request)
        body = await state.read_json(request)
        state.check_model(body)
        req = chat_request(body, state.render_chat(chat_messages(body)), backend.context_length)
        return await state.respond(request, req, chat=True)

    if config.admin_token is not None:
        mount_admin(app, state)
    return app


class ServerState:
    """What the routes share: the backend, the settings, admin state."""

    def __init__(self, backend: Backend, config: ServerConfig):
        self.backend, self.config = backend, config
        self.model_name = config.served_model_name or backend.model_name
        self.created = int(time.time())
        self.admin_lock = asyncio.Lock()  # one admin change at a time
        self.kv_held = False  # /admin/drop_kv ran and /admin/rebuild_kv did not yet
        # Admin work blocks (checkpoint reads, swaps that wait for running requests): it runs
        # on a thread of its own, off the event loop.
        self.admin_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-admin")

    def close(self) -> None:
        self.admin_executor.shutdown(wait=True)

    # ---- request checks ----------------------------------------------------------------------

    def check_api_key(self, request: Request) -> None:
        if self.config.api_key is not None:
            check_bearer(request, self.config.api_key, "API key")

    async def read_json(self, request: Request) -> dict:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            raise invalid("model", "'model' is required")
        if model != self.model_name:
            raise ApiError(404, f"model '{model}' does not exist; this server serves '{self.model_name}'", param="model", code="model_not_found")

    def render_chat(self, messages: list[dict]) -> list[int]:
        tokenizer = self.backend.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise invalid("messages", "the model directory's tokenizer has no chat template: use /v1/completions")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a Jinja template error names what the messages lack
            raise invalid("messages", f"cannot render messages with the chat template: {exc}") from None
        return tokenizer.encode(text, add_special_tokens=False)

    def unavailable_reason(self) -> str | None:
        """Why generation requests get 503 now (None: they run). A KV cache dropped through
        /admin/drop_kv stays dropped until rebuilt; one the worker dropped (a train step) is
        rebuilt by the first generate once the worker allows generating again."""
        reason = self.backend.unavailable_reason
        if reason is None and self.kv_held and not self.backend.kv_present:
            reason = "the KV cache was dropped through /admin/drop_kv"
        return reason

    def check_available(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise ApiError(503, f"generation is paused: {reason}; retry later", type="service_unavailable", code="weights_updating")

    # ---- generation --------------------------------------------------------------------------

    async def respond(self, request: Request, req: GenerationRequest, *, chat: bool) -> Response:
        request.state.prompt_field = req.prompt_field
        self.check_available()
        prompts = self.prompt_ids(req)
        sampling = self.sampling(req, prompts)
        kind = "chatcmpl" if chat else "cmpl"
        base = {"id": f"{kind}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            chunks = self.backend.stream(prompts, **sampling)
            first = await anext(chunks)
            base["weight_version"] = first.weight_version
            events = self.events(request, req, prompts, base, first, chunks, chat=chat)
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
            content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            logprobs = None
            if req.logprobs:
                start = batch.prompt_width
                values = batch.logprobs[row, start : start + len(ids)].tolist()
                logprobs = self.logprobs_body(ids, values, chat=chat)
            choice = {"index": row, **content, "finish_reason": finish, "logprobs": logprobs, "token_ids": ids}
            if batch.token_versions is not None:  # extension: the weight version that sampled each token
                start = batch.prompt_width
                choice["token_versions"] = batch.token_versions[row, start : start + len(ids)].tolist()
            choices.append(choice)
        body = {
            **base,
            "weight_version": batch.weight_version,
            "object": "chat.completion" if chat else "text_completion",
            "choices": choices,
            "usage": _usage(sum(map(len, batch.prompts)), int(batch.completion_lengths.sum())),
        }
        return JSONResponse(body, headers={WEIGHT_VERSION_HEADER: str(batch.weight_version)})

    def logprobs_body(self, ids: list[int], values: list[float], *, chat: bool) -> dict:
        """OpenAI's log-probs object for sampled tokens (no top alternatives)."""
        tokenizer = self.backend.tokenizer
        tokens = [tokenizer.decode([t]) if tokenizer is not None else str(t) for t in ids]
        if chat:
            return {
                "content": [
                    {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                    for tok, lp in zip(tokens, values)
                ]
            }
        offsets = [0]
        for tok in tokens[:-1]:
            offsets.append(offsets[-1] + len(tok))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}

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

    async def events(self, request, req, prompts, base, first, chunks, *, chat: bool) -> AsyncIterator[str]:
        """Server-sent events as the engine's tokens arrive: per choice, text increments, then
        a last event with its finish reason and token ids; optionally usage; then [DONE]."""
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict], **extra) -> str:
            return "data: " + json.dumps({**base, "object": kind, "choices": choices, **extra}) + "\n\n"

        def choice(row: int, piece: str | None, finish: str | None = None, **extra) -> dict:
            if chat:
                body = {"index": row, "delta": {} if piece is None else {"content": piece}}
            else:
                body = {"index": row, "text": piece or ""}
            return {**body, "finish_reason": finish, "logprobs": None, **extra}

        rows = len(prompts) * req.n
        texts = [IncrementalText(self.backend.tokenizer, req.stop) for _ in range(rows)]
        versions: list[list[int] | None] = [[] for _ in range(rows)]
        done = [False] * rows
        generated = 0
        try:
            if chat:
                for row in range(rows):
                    yield event([{"index": row, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}])
            chunk = first
            while chunk is not None:
                generated += len(chunk.token_ids)
                text = texts[chunk.row]
                if not done[chunk.row]:
                    if chunk.token_versions is None or versions[chunk.row] is None:
                        versions[chunk.row] = None
                    else:
                        versions[chunk.row] += chunk.token_versions
                    piece = text.add(chunk.token_ids)
                    finished = chunk.finish_reason is not None or text.stopped
                    if finished:
                        piece += text.finish()
                    if piece or (req.logprobs and chunk.token_ids):
                        logprobs = None
                        if req.logprobs:
                            logprobs = self.logprobs_body(chunk.token_ids, chunk.logprobs, chat=chat)
                        yield event([choice(chunk.row, piece, logprobs=logprobs)])
                    if finished:
                        done[chunk.row] = True
                        reason = "stop" if text.stopped else _FINISH_REASONS.get(chunk.finish_reason, "stop")
                        extra = {"token_ids": text.token_ids}
                        if versions[chunk.row] is not None:
                            extra["token_versions"] = versions[chunk.row][: len(text.token_ids)]
                        yield event([choice(chunk.row, None, reason, **extra)])
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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class _RequestLog:
    """One INFO line per request: method, path, status, tokens (prompt/completion), seconds."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]

        async def capture(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            prompt, completion = scope.get("state", {}).get("tokens", (0, 0))
            logger.info(
                "%s %s %d tokens=%d/%d %.3fs",
                scope["method"], scope["path"], status[0], prompt, completion, time.perf_counter() - start,
            )
