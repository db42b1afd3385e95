"""The OpenAI-compatible and health routers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .serving import ChatServing, CompletionServing
from .state import SharedState


def health_router(state: SharedState) -> APIRouter:
    router = APIRouter()

    # HEAD too: load balancers' and uptime checkers' probes often send it.
    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok"}

    @router.api_route("/ready", methods=["GET", "HEAD"])
    async def ready():
        reason = state.backend.unavailable_reason
        if reason is None and not state.backend.kv_present:
            reason = "the KV cache is dropped"
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return {"status": "ready", "weight_version": state.backend.weight_version}

    return router


def openai_router(state: SharedState) -> APIRouter:
    router = APIRouter(prefix="/v1")
    completions, chat = CompletionServing(state), ChatServing(state)

    @router.get("/models")
    async def models(request: Request):
        state.check_api_key(request)
        cards = [state.model_card()] + [state.model_card(name) for name in state.backend.adapter_names()]
        return {"object": "list", "data": cards}

    @router.get("/models/{model:path}")
    async def model(request: Request, model: str):
        state.check_api_key(request)
        return state.model_card(state.check_model_name(model))

    @router.post("/completions")
    async def create_completion(request: Request):
        return await completions.handle(request)

    @router.post("/chat/completions")
    async def create_chat_completion(request: Request):
        return await chat.handle(request)

    return router
