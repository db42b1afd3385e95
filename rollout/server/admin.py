"""Admin routes: weights checksum and perturbation, reloads, KV cache, memory."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

from .protocol import check_bearer, invalid

if TYPE_CHECKING:
    from .app import ServerState

logger = logging.getLogger(__name__)


def mount_admin(app: FastAPI, state: ServerState) -> None:
    """The /admin routes; every one requires the admin token."""
    backend, token = state.backend, state.config.admin_token

    def authorize(request: Request) -> None:
        check_bearer(request, token, "admin token")

    async def run(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(state.admin_executor, fn, *args)

    @app.get("/admin/weights_checksum")
    async def weights_checksum(request: Request):
        authorize(request)
        return await run(backend.weights_checksum)

    def swap_mode(body: dict) -> tuple[bool, bool]:
        # Reloads swap in flight by default: requests keep running and none is refused.
        in_flight, recompute_kv = body.get("in_flight", True), body.get("recompute_kv", False)
        for name, value in (("in_flight", in_flight), ("recompute_kv", recompute_kv)):
            if not isinstance(value, bool):
                raise invalid(name, f"'{name}' must be a boolean, got {value!r}")
        if recompute_kv and not in_flight:
            raise invalid("recompute_kv", "'recompute_kv' needs 'in_flight': true")
        return in_flight, recompute_kv

    @app.post("/admin/perturb_weights")
    async def perturb_weights(request: Request):
        authorize(request)
        body = await state.read_json(request)
        in_flight, recompute_kv = swap_mode(body)
        if recompute_kv:
            raise invalid("recompute_kv", "'recompute_kv' is for reloads: a perturbation keeps the running requests' KV")
        seed, scale, num_leaves = body.get("seed", 0), body.get("scale", 1e-3), body.get("num_leaves", 1)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise invalid("seed", f"'seed' must be an int >= 0, got {seed!r}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise invalid("scale", f"'scale' must be a number, got {scale!r}")
        async with state.admin_lock:
            before = await run(backend.weights_checksum)
            report = await run(backend.perturb_weights, seed, float(scale), num_leaves, in_flight)
            after = await run(backend.weights_checksum)
        return {**report, "checksum_before": before["checksum"], "checksum_after": after["checksum"]}

    @app.post("/admin/reload_weights")
    async def reload_weights(request: Request):
        authorize(request)
        body = await state.read_json(request)
        path, fmt, step = body.get("path"), body.get("format", "orbax"), body.get("step")
        if not isinstance(path, str) or not path:
            raise invalid("path", "'path' must be a non-empty string")
        if fmt not in ("orbax", "hf"):
            raise invalid("format", f"'format' must be 'orbax' or 'hf', got {fmt!r}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or fmt != "orbax"):
            raise invalid("step", "'step' must be an int, and only with format 'orbax'")
        in_flight, recompute_kv = swap_mode(body)
        async with state.admin_lock:
            report = await run(backend.reload_weights, path, fmt, step, in_flight, recompute_kv)
        logger.info("reloaded weights from %s (%s): version %d", path, fmt, report["version"])
        return report

    @app.post("/admin/drop_kv")
    async def drop_kv(request: Request):
        authorize(request)
        async with state.admin_lock:
            report = await run(backend.drop_kv)
            state.kv_held = True
            return report

    @app.post("/admin/rebuild_kv")
    async def rebuild_kv(request: Request):
        authorize(request)
        async with state.admin_lock:
            report = await run(backend.rebuild_kv)
            state.kv_held = False
            return report

    @app.get("/admin/memory")
    async def memory(request: Request):
        authorize(request)
        return await run(backend.memory)
