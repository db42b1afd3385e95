"""How the engine's jitted programs are built and reached: their XLA compile options per
platform, static decode chunks where XLA drives loops from the host, and the closure cells
through which the engine's forward reads its weights. No sgl_jax import."""

from __future__ import annotations

import jax

from .types import EngineOptions
from .workarounds import workaround_enabled

# jax device platforms of a GPU.
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def engine_compiler_options(platform: str) -> dict[str, int]:
    """XLA compile options of the engine's forward and decode chunks on devices of ``platform``
    (a jax device's ``platform``): on a GPU, with workaround ``gpu-dot-merger``, XLA leaves
    sibling dots (q/k/v, gate/up) apart; none elsewhere."""
    if platform in _GPU_PLATFORMS and workaround_enabled("gpu-dot-merger"):
        return {"xla_gpu_dot_merger_threshold_mb": 0}
    return {}


def static_decode_chunks(options: EngineOptions, platform: str) -> bool:
    """Whether an engine on ``platform`` runs static decode chunks (``options.static_decode_chunks``,
    None: where XLA drives loops and conditionals from the host, a GPU)."""
    if options.static_decode_chunks is not None:
        return options.static_decode_chunks
    return platform in _GPU_PLATFORMS


def mesh_platform(mesh) -> str:
    return mesh.devices.flat[0].platform


def jit_with_options(fn, options: dict, **jit_kwargs):
    """``jax.jit(fn, compiler_options=options, **jit_kwargs)``, which keeps ``options`` as its
    ``compiler_options`` attribute."""
    jitted = jax.jit(fn, compiler_options=options, **jit_kwargs)
    jitted.compiler_options = options
    return jitted


def forward_cells(runner) -> dict:
    """The closure cells of the engine's jitted forward (``model_def``, ``model_state_def``,
    ``model_state_leaves``, ...) by name: the forward reads its weights from them at every call."""
    run_model = runner.jitted_run_model
    return dict(zip(run_model.__code__.co_freevars, run_model.__closure__))
