"""Serve a model over HTTP: OpenAI-compatible routes plus admin routes.

    python -m rollout.serve --model-path DIR [--load-format dummy|auto] [--dtype float32]
        [--host 127.0.0.1] [--port 8000] [--admin-token TOKEN] [--api-key KEY]
        [--served-model-name NAME] [--max-total-tokens N --tp-size N ...]
        [--unmerged-lora RANK,ALPHA[,MODULE,...]]

Every ``ServerConfig`` and ``WorkerConfig`` field is a flag (engine settings; ``--devices 0,1`` are indices into
``jax.local_devices()``, lists are comma-separated). The admin token and the API key may come
from the ``ROLLOUT_ADMIN_TOKEN`` and ``ROLLOUT_API_KEY`` environment variables instead (kept out
of the process list). SIGINT or
SIGTERM drain running requests, stop the server and the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing

import jax

from trainer_bridge import DEFAULT_TARGET_MODULES, LoraConfig

from .config import WorkerConfig
from .server import ServerConfig, start_server
from .worker import RolloutWorker

ADMIN_TOKEN_ENV = "ROLLOUT_ADMIN_TOKEN"
API_KEY_ENV = "ROLLOUT_API_KEY"


def _flag_type(hint):
    """argparse type for a field's type hint (``int``, ``float | None``, ``tuple[int, ...] | None``);
    None for a boolean switch."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = typing.get_origin(args[0]) or args[0]
    if base is tuple:
        return lambda text: tuple(int(v) for v in text.split(","))
    return {bool: None, int: int, float: float, LoraConfig: _lora_config}.get(base, str)


def _lora_config(text: str) -> LoraConfig:
    """``--unmerged-lora RANK,ALPHA[,MODULE,...]``: ``16,32`` (every projection) or
    ``16,32,q_proj,v_proj``."""
    parts = text.split(",")
    try:
        if len(parts) < 2 or not all(parts):
            raise ValueError("a rank, an alpha and module names, none empty")
        return LoraConfig(int(parts[0]), float(parts[1]), tuple(parts[2:]) or DEFAULT_TARGET_MODULES)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"RANK,ALPHA[,MODULE,...] expected, got {text!r} ({exc})") from None


def parse_args(argv=None) -> tuple[WorkerConfig, ServerConfig, str]:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="INFO")
    groups = (
        (parser.add_argument_group("server"), ServerConfig),
        (parser.add_argument_group("engine (WorkerConfig)"), WorkerConfig),
    )
    for group, cls in groups:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            flag = "--" + field.name.replace("_", "-")
            kind = _flag_type(hints[field.name])
            if kind is None:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
            else:
                group.add_argument(flag, type=kind, default=None, required=field.name == "model_path")
    args = parser.parse_args(argv)

    def values(cls):
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name) is not None}

    server = values(ServerConfig)
    server.setdefault("admin_token", os.environ.get(ADMIN_TOKEN_ENV) or None)
    server.setdefault("api_key", os.environ.get(API_KEY_ENV) or None)
    worker = values(WorkerConfig)
    if "devices" in worker:  # given as indices into jax.local_devices()
        local = jax.local_devices()
        bad = [i for i in worker["devices"] if not 0 <= i < len(local)]
        if bad:
            parser.error(f"--devices: no local device {bad[0]} (there are {len(local)})")
        worker["devices"] = tuple(local[i] for i in worker["devices"])
    try:
        return WorkerConfig(**worker), ServerConfig(**server), args.log_level
    except ValueError as exc:  # a flag's value the config refuses: usage and the reason, no traceback
        parser.error(str(exc))


def main(argv=None) -> None:
    worker_config, server_config, log_level = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rollout").setLevel(log_level.upper())
    with RolloutWorker(worker_config) as worker:
        # The worker closes inside wait(): a SIGTERM repeated while it shuts down lets it finish.
        start_server(worker, server_config).wait(then=worker.close)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C again while draining: stopped at once, as asked, not a traceback
        print("rollout.serve: interrupted while draining; stopped", file=sys.stderr)
        raise SystemExit(130) from None
