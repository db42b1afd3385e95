"""Abandoned work: what a request whose client left still costs the engine.

    JAX_PLATFORMS=cpu python -m bench.abort_bench [--max-tokens 960] [--repeats 3]

Serves a tiny Qwen2 and, per case, starts a request of ``max_tokens`` tokens (ignore_eos),
waits until the engine runs it, abandons it, and measures the forwards the engine still runs
for it (until it holds no request), the seconds until then, and the latency of a
``sync_params`` issued right after the disconnect (it waits for running calls). Cases: a
streamed HTTP request whose client disconnects, a non-streamed one whose client disconnects,
and ``agenerate`` cancelled (what ``asyncio.wait_for`` does on timeout). The baseline is the
latency of the same sync on the idle worker, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import statistics
import tempfile
import threading
import time

import httpx
import jax

from models import TinyModelSpec, write_tiny_model
from rollout import RolloutWorker, WorkerConfig
from trainer_bridge import load_hf_params

PROMPT = [5, 17, 42, 8]


def _wait(condition, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not reach the expected state")
        time.sleep(0.002)


def _stream_left(url: str, body: dict) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))


def _request_left(url: str, body: dict, engine) -> None:
    payload = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    client = socket.create_connection((host, int(port)))
    client.sendall(head.encode() + payload)
    _wait(lambda: engine.requests_in_flight > 0)
    client.close()


def _agenerate_cancelled(worker, max_tokens: int) -> None:
    async def run():
        call = asyncio.ensure_future(worker.agenerate([PROMPT], max_new_tokens=max_tokens, ignore_eos=True))
        while worker.engine.requests_in_flight == 0:
            await asyncio.sleep(0.002)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)

    asyncio.run(run())


def measure(worker, params, abandon) -> dict:
    """Run ``abandon`` (returns once the client has left) and what follows."""
    engine = worker.engine
    result = {}

    def sync_right_after():
        start = time.perf_counter()
        worker.sync_params(params)
        result["sync_s"] = time.perf_counter() - start

    forwards_before = engine.forward_count
    abandon()
    left_at, start_forwards = time.perf_counter(), engine.forward_count
    syncer = threading.Thread(target=sync_right_after)
    syncer.start()
    _wait(lambda: engine.requests_in_flight == 0 and worker.active_calls == 0)
    result["idle_after_s"] = time.perf_counter() - left_at
    syncer.join()
    result["forwards_after_leaving"] = engine.forward_count - start_forwards
    result["forwards_while_running"] = start_forwards - forwards_before
    return result


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(tmp, TinyModelSpec(max_position_embeddings=2048))
        config = WorkerConfig(
            model_path=str(model_dir),
            dtype="float32",
            max_total_tokens=4096,
            context_length=1024,
            max_running_requests=8,
            max_prefill_tokens=1024,
            chunked_prefill_size=1024,
            devices=tuple(jax.devices()[:1]),
        )
        with RolloutWorker(config) as worker, worker.serve() as server:
            params = jax.tree_util.tree_map(jax.device_put, load_hf_params(model_dir))
            worker.sync_params(params)
            body = {"model": model_dir.name, "prompt": PROMPT, "max_tokens": args.max_tokens, "ignore_eos": True}
            # Compile every shape first.
            httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 8}, timeout=600)
            idle = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                worker.sync_params(params)
                idle.append(time.perf_counter() - start)
            idle_s = statistics.median(idle)
            print(f"sync_params on the idle worker (baseline): {idle_s * 1e3:.1f} ms (median of {args.repeats})")
            cases = {
                "stream, client disconnects": lambda: _stream_left(server.url, body),
                "non-stream, client disconnects": lambda: _request_left(server.url, body, worker.engine),
                "agenerate cancelled": lambda: _agenerate_cancelled(worker, args.max_tokens),
            }
            for name, abandon in cases.items():
                runs = [measure(worker, params, abandon) for _ in range(args.repeats)]
                forwards = max(r["forwards_after_leaving"] for r in runs)
                sync_s = statistics.median(r["sync_s"] for r in runs)
                idle_after = statistics.median(r["idle_after_s"] for r in runs)
                print(
                    f"{name}: forwards after leaving (max of {args.repeats}) {forwards} of {args.max_tokens}; "
                    f"engine idle after {idle_after * 1e3:.1f} ms; sync right after {sync_s * 1e3:.1f} ms "
                    f"({sync_s / idle_s:.1f}x idle)"
                )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=960)
    parser.add_argument("--repeats", type=int, default=3)
    main(parser.parse_args())
