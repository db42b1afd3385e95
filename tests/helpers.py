"""Shared test helpers."""

import jax

from rollout import WorkerConfig


def tiny_worker_config(model_dir, **overrides) -> WorkerConfig:
    """Small engine limits that start fast on a 2-core CPU, on the first dp_size x tp_size
    of the 4 fake devices unless ``devices`` is given."""
    settings = dict(
        model_path=str(model_dir),
        dtype="float32",
        max_total_tokens=2048,
        context_length=256,
        max_running_requests=16,
        max_prefill_tokens=512,
        chunked_prefill_size=512,
    )
    settings.update(overrides)
    if "devices" not in settings:
        settings["devices"] = tuple(jax.devices()[: settings.get("dp_size", 1) * settings.get("tp_size", 1)])
    return WorkerConfig(**settings)
