"""Admin routes: weights checksum and perturbation, reloads, KV cache, memory."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os

from fastapi import APIRouter, Request

from ..weight_tools import check_swap_mode, perturb_seed
from .protocol import ApiError, check_bearer, finite_number, invalid
from .state import SharedState

logger = logging.getLogger(__name__)


class AdminState:
    """What the admin routes own: one admin change at a time, run off the event loop."""

    def __init__(self):
        self.lock = asyncio.Lock()
        # Admin work blocks (checkpoint reads, swaps that wait for running requests): it runs
        # on a thread of its own.
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-admin")

    async def run(self, fn, *args):
        """``fn(*args)`` on the admin thread. Cancelled (the server's drain timeout), the call
        still waits for it and answers what it did: the thread carries the work on, and its
        change lands (a reload waiting behind a request cut at the timeout goes ahead once that
        request's rows are aborted), where a 503 would have said it had not."""
        work = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        while True:
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                if work.cancelled():
                    raise
                asyncio.current_task().uncancel()

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def admin_router(state: SharedState, admin: AdminState) -> APIRouter:
    """The /admin routes; every one requires the admin token."""
    backend, token = state.backend, state.config.admin_token
    router = APIRouter(prefix="/admin")
    run = admin.run

    def authorize(request: Request) -> None:
        check_bearer(request, token, "admin token")

    @router.get("/weights_checksum")
    async def weights_checksum(request: Request):
        authorize(request)
        return await run(backend.weights_checksum)

    def swap_mode(body: dict) -> tuple[bool, bool]:
        # Reloads swap in flight by default: requests keep running and none is refused.
        in_flight, recompute_kv = body.get("in_flight", True), body.get("recompute_kv", False)
        for name, value in (("in_flight", in_flight), ("recompute_kv", recompute_kv)):
            if not isinstance(value, bool):
                raise invalid(name, f"'{name}' must be a boolean, got {value!r:.80}")
        check_swap_mode(in_flight, recompute_kv)  # before the admin lock is waited for
        return in_flight, recompute_kv

    @router.post("/perturb_weights")
    async def perturb_weights(request: Request):
        authorize(request)
        body = await state.read_json(request)
        in_flight, recompute_kv = swap_mode(body)
        if recompute_kv:
            raise invalid(
                "recompute_kv", "'recompute_kv' is for reloads: a perturbation keeps the running requests' KV"
            )
        seed, scale, num_leaves = body.get("seed", 0), body.get("scale", 1e-3), body.get("num_leaves", 1)
        seed = perturb_seed(seed)
        number = finite_number(scale)
        if number is None:
            raise invalid("scale", f"'scale' must be a number, got {scale!r:.80}")
        async with admin.lock:
            before = await run(backend.weights_checksum)
            report = await run(backend.perturb_weights, seed, number, num_leaves, in_flight)
            after = await run(backend.weights_checksum)
        return {**report, "checksum_before": before["checksum"], "checksum_after": after["checksum"]}

    @router.post("/reload_weights")
    async def reload_weights(request: Request):
        authorize(request)
        body = await state.read_json(request)
        path, fmt, step = body.get("path"), body.get("format", "orbax"), body.get("step")
        checked_path(path, "path")
        if fmt not in ("orbax", "hf"):
            raise invalid("format", f"'format' must be 'orbax' or 'hf', got {fmt!r:.80}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or fmt != "orbax"):
            raise invalid("step", "'step' must be an int, and only with format 'orbax'")
        in_flight, recompute_kv = swap_mode(body)
        async with admin.lock:
            report = await run(backend.reload_weights, path, fmt, step, in_flight, recompute_kv)
        logger.info("reloaded weights from %s (%s): version %d", path, fmt, report["version"])
        return report

    @router.post("/load_lora")
    async def load_lora(request: Request):
        # vLLM's load_lora_adapter body ({"lora_name", "lora_path"}); the name is echoed back, and
        # with several adapter slots (max_loras) requests select the adapters by it ("model").
        authorize(request)
        body = await state.read_json(request)
        path, name, step = body.get("lora_path"), body.get("lora_name"), body.get("step")
        checked_path(path, "lora_path")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise invalid("lora_name", f"'lora_name' must be a non-empty string, got {name!r:.80}")
        if name == state.model_name:
            raise invalid("lora_name", f"'lora_name' {name!r} is the served model's name: requests could not pick it")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise invalid("step", f"'step' must be an int, got {step!r:.80}")
        in_flight, recompute_kv = swap_mode(body)
        async with admin.lock:
            try:
                report = await run(backend.load_lora, path, step, name, in_flight, recompute_kv)
            except FileNotFoundError as exc:  # named by this route's field, not reload's "path"
                raise ApiError(404, str(exc), param="lora_path", code="not_found") from None
        logger.info("loaded LoRA adapters %s from %s: version %d", name, path, report["version"])
        return {**report, "lora_name": name}

    @router.post("/unload_lora")
    async def unload_lora(request: Request):
        # vLLM's unload_lora_adapter body ({"lora_name"}): requests naming it are refused from now on.
        authorize(request)
        name = (await state.read_json(request)).get("lora_name")
        if not isinstance(name, str) or not name.strip():
            raise invalid("lora_name", "'lora_name' must be a non-empty string")
        async with admin.lock:
            unloaded = await run(backend.unload_lora, name)
        if not unloaded:
            raise ApiError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name", code="lora_not_found")
        logger.info("unloaded LoRA adapters %s", name)
        return {"lora_name": name, "unloaded": True}

    def checked_path(path, param: str) -> None:
        if not isinstance(path, str) or not path:
            raise invalid(param, f"'{param}' must be a non-empty string")
        if "\x00" in path:  # no file system takes one (os functions raise ValueError)
            raise invalid(param, f"'{param}' must not contain a NUL character")
        root = state.config.reload_root
        if root is not None and not _is_under(path, root):
            raise ApiError(
                403,
                f"'{param}' is outside the reload root ({root}): refused",
                param=param,
                type="permission_error",
                code="outside_reload_root",
            )

    @router.post("/drop_kv")
    async def drop_kv(request: Request):
        authorize(request)
        async with admin.lock:
            return await run(backend.drop_kv)

    @router.post("/rebuild_kv")
    async def rebuild_kv(request: Request):
        authorize(request)
        async with admin.lock:
            return await run(backend.rebuild_kv)

    @router.get("/memory")
    async def memory(request: Request):
        authorize(request)
        return await run(backend.memory)

    return router


def _is_under(path: str, root: str) -> bool:
    """Whether ``path`` resolves (symlinks and ``..`` followed) inside ``root``; checked before
    anything is read, so an outside path's existence is not revealed either."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, real_root]) == real_root
