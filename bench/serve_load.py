"""HTTP server under load: concurrent completion requests while the weights reload, with
drain swaps and in-flight swaps side by side.

    JAX_PLATFORMS=cpu python -m bench.serve_load [--requests 200] [--reloads 5] [--max-tokens 8]

Serves a tiny Qwen2 on a loopback port and sends ``requests`` completion requests, started
evenly over ``window_s`` seconds, from one asyncio client, while ``reloads`` admin reloads of
the model's own safetensors run one after another: drain reloads (``"in_flight": false``: wait
for running requests, 503 meanwhile), in-flight reloads keeping the running requests' KV, and
in-flight reloads recomputing it. Prints per mode the status counts (every request must end as
a 200 carrying a weight version or a 503 with Retry-After), latency percentiles, the reload
calls' latency, and per swap the stall the running requests saw (from the engine's last forward
before the swap to its first after) and how long the swap waited for its forward boundary; and
as the baseline the same load with no reloads, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import logging
import tempfile
import time

import httpx
import numpy as np

from models import TinyModelSpec, write_tiny_model
from rollout import RolloutWorker, WorkerConfig

ADMIN_TOKEN = "bench-admin"


@dataclasses.dataclass(frozen=True)
class Outcome:
    status: int | str  # HTTP status, or "timeout" / the transport error's name
    seconds: float
    weight_version: str | None  # the X-Weight-Version header
    body_version: int | None  # the response's weight_version field
    retry_after: str | None


@dataclasses.dataclass(frozen=True)
class LoadResult:
    outcomes: list[Outcome]
    reload_statuses: list[int]
    seconds: float
    reload_seconds: list[float] = dataclasses.field(default_factory=list)

    def counts(self) -> dict:
        return dict(collections.Counter(o.status for o in self.outcomes))

    def percentile(self, q: float, status: int = 200) -> float:
        times = [o.seconds for o in self.outcomes if o.status == status]
        return float(np.percentile(times, q)) if times else float("nan")


async def run_load(
    url: str,
    *,
    model: str,
    requests: int,
    reloads: int,
    reload_body: dict,
    window_s: float = 5.0,
    max_tokens: int = 8,
    timeout_s: float = 120.0,
    headers: dict | None = None,
) -> LoadResult:
    """``requests`` completions started evenly over ``window_s`` while ``reloads`` reloads run
    (``headers``: e.g. the API key's Authorization)."""
    limits = httpx.Limits(max_connections=requests + 1, max_keepalive_connections=requests + 1)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits, headers=headers) as client:

        async def one(i: int) -> Outcome:
            await asyncio.sleep(window_s * i / requests)
            body = {"model": model, "prompt": [5 + i % 200, 17, 42, 8], "max_tokens": max_tokens, "temperature": 0.0}
            start = time.perf_counter()
            try:
                response = await client.post("/v1/completions", json=body)
            except httpx.TimeoutException:
                return Outcome("timeout", time.perf_counter() - start, None, None, None)
            except httpx.HTTPError as exc:
                return Outcome(type(exc).__name__, time.perf_counter() - start, None, None, None)
            seconds = time.perf_counter() - start
            version = response.json().get("weight_version") if response.status_code == 200 else None
            return Outcome(
                response.status_code,
                seconds,
                response.headers.get("x-weight-version"),
                version,
                response.headers.get("retry-after"),
            )

        reload_seconds = []

        async def reloader() -> list[int]:
            statuses = []
            for k in range(reloads):
                await asyncio.sleep(window_s / (reloads + 1) if k == 0 else 0.2)
                begin = time.perf_counter()
                response = await client.post(
                    "/admin/reload_weights", json=reload_body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
                )
                reload_seconds.append(time.perf_counter() - begin)
                statuses.append(response.status_code)
            return statuses

        start = time.perf_counter()
        *outcomes, reload_statuses = await asyncio.gather(*(one(i) for i in range(requests)), reloader())
        return LoadResult(outcomes, reload_statuses, time.perf_counter() - start, reload_seconds)


def describe(name: str, result: LoadResult) -> str:
    ok = sum(o.status == 200 for o in result.outcomes)
    return (
        f"{name}: {len(result.outcomes)} requests, {len(result.reload_statuses)} reloads {result.reload_statuses}, "
        f"statuses {result.counts()}, "
        f"200s p50 {result.percentile(50) * 1e3:.0f} ms p99 {result.percentile(99) * 1e3:.0f} ms, "
        f"503s p50 {result.percentile(50, 503) * 1e3:.0f} ms p99 {result.percentile(99, 503) * 1e3:.0f} ms, "
        f"{ok / result.seconds:.1f} completed req/s over {result.seconds:.1f} s"
    )


def swap_stalls(engine, since: float) -> tuple[list[tuple[float, float, int]], float]:
    """Per swap of ``engine`` since ``since`` (perf_counter): (stall of the running requests:
    from the end of the engine's last forward before the swap to the end of its first forward
    after it, i.e. between two tokens of a running request, or 0 with none running; seconds it
    waited for its boundary; requests running). And the median forward-to-forward interval
    over the same time without swaps (one decode step, for scale)."""
    busy = [(start, end) for start, end in engine.busy_intervals() if start >= since]
    records = [r for r in engine.testing.swap_records() if r.start >= since]
    stalls = []
    for record in records:
        before = [end for _, end in busy if end <= record.start]
        after = [end for start, end in busy if start >= record.end]
        stall = after[0] - before[-1] if record.running and before and after else 0.0
        stalls.append((stall, record.start - record.queued, record.running))
    steps = [b[1] - a[1] for a, b in zip(busy, busy[1:]) if not any(a[1] <= r.start <= b[1] for r in records)]
    return stalls, float(np.median(steps)) if steps else float("nan")


def describe_swaps(stalls: list[tuple[float, float, int]], step: float, result: LoadResult) -> str:
    if not stalls:
        return "  no swaps"
    stall = np.array([s for s, _, _ in stalls]) * 1e3
    wait = np.array([w for _, w, _ in stalls]) * 1e3
    running = [n for _, _, n in stalls]
    calls = np.array(result.reload_seconds) * 1e3
    return (
        f"  reload calls p50 {np.median(calls):.0f} ms max {calls.max():.0f} ms; per swap: running requests {running}, "
        f"their stall (token to token across the swap) p50 {np.median(stall):.1f} ms max {stall.max():.1f} ms "
        f"vs a step without swap p50 {step * 1e3:.1f} ms; swap's wait for its boundary p50 {np.median(wait):.1f} ms "
        f"max {wait.max():.1f} ms"
    )


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(tmp, TinyModelSpec())
        config = WorkerConfig(
            model_path=str(model_dir),
            dtype="float32",
            max_total_tokens=4096,
            context_length=256,
            max_running_requests=64,
            max_prefill_tokens=1024,
            chunked_prefill_size=1024,
        )
        with RolloutWorker(config) as worker, worker.serve(admin_token=ADMIN_TOKEN) as server:
            load = {
                "model": server.backend.model_name,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "window_s": args.window_s,
            }
            modes = {
                "drain": {"in_flight": False},
                "in-flight": {"in_flight": True},
                "in-flight recompute_kv": {"in_flight": True, "recompute_kv": True},
            }
            bodies = {name: {"path": str(model_dir), "format": "hf", **mode} for name, mode in modes.items()}
            # Compiles the forward for the batch sizes this load reaches, and the reload's copies.
            for body in bodies.values():
                asyncio.run(run_load(server.url, reloads=1, reload_body=body, **load))
            baseline = asyncio.run(run_load(server.url, reloads=0, reload_body=bodies["drain"], **load))
            results = {}
            for name, body in bodies.items():
                since = time.perf_counter()
                result = asyncio.run(run_load(server.url, reloads=args.reloads, reload_body=body, **load))
                results[name] = (result, *swap_stalls(worker.engine, since))
    print(describe("no reloads (baseline)", baseline))
    for name, (result, stalls, step) in results.items():
        print(describe(f"{args.reloads} {name} reloads", result))
        print(describe_swaps(stalls, step, result))
        print(f"  p50 ratio / baseline: {result.percentile(50) / baseline.percentile(50):.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--reloads", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--window-s", type=float, default=5.0)
    logging.basicConfig(level=logging.WARNING)
    main(parser.parse_args())
