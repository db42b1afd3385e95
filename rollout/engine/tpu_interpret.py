"""The engine's TPU path on any device, in JAX's TPU interpret mode: a deliberate switch for CI.

:func:`tpu_interpret_mode` runs engines started inside it with the "fa" attention backend's
Pallas kernels (ragged paged attention, which also writes the new tokens' K and V) interpreted
by JAX (``jax.experimental.pallas.tpu``'s interpret mode) instead of compiled by Mosaic, so a
CPU runs the TPU path's kernels and the engine's use of them. It is never on by accident: it is
process-wide while it lasts (every Pallas TPU kernel of the process is interpreted, the trainer's
too), and slow (each DMA of the kernel is a Python callback). Inside it:

- 0.0.2 falls back from "fa" to "native" on a CPU; an engine started inside keeps "fa";
- the kernel's block sizes come from a table of TPU generations, which a CPU has none of:
  TPU v4's fixed ones are taken (``get_tuned_block_sizes``);
- JAX's TPU interpreter keeps each buffer as a numpy array and reads and writes it through the
  ref's transforms, which it takes to be indexers only (``_to_range``); the kernel DMAs pages
  through a reshape of the KV cache's HBM ref and loads its VMEM blocks through bitcasts and
  reshapes, where the interpreter fails (``RefReshaper`` has no ``indices`` at jax 0.8,
  ``ReshapeTransform`` at 0.12). Its ``get``, ``store`` and ``swap`` are wrapped: where a ref's
  transforms hold more than indexers, the buffer's array is replaced, for that one access, by
  the numpy view the transforms make of it (each must give a view: a reshape that would copy,
  or a bitcast between widths as bfloat16 packing makes, is refused), and the access goes on
  with no transforms. What the kernel computes is the interpreter's, unchanged. These are
  private JAX internals, which moved three times between 0.8.0 and 0.10.1: each is looked for
  where the installed release keeps it (``_interpreter``, ``_set_buffer``), and a release that
  moves one again fails loudly here.

What it proves and does not: docs/platforms.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading

import jax
import numpy as np
from jax._src.state import indexing
from jax._src.state import types as state_types

_INTERPRETER = "jax._src.pallas.mosaic.interpret"


def _interpreter(import_module=importlib.import_module):
    """(the module with get/store/swap, the shared memory's getter, the interpreter's own
    indexer-to-numpy-index function), each found where the installed release has it: jax 0.8.0
    keeps the accesses in ``shared_memory`` (``_to_range`` beside them), 0.8.1 moved them to
    ``interpret_pallas_call`` (``_to_range`` there too), 0.8.2 moved ``to_range`` to ``utils``."""
    calls = import_module(f"{_INTERPRETER}.interpret_pallas_call")
    if not hasattr(calls, "_get_shared_memory"):
        memory = import_module(f"{_INTERPRETER}.shared_memory")
        return memory, memory.get_shared_memory, memory._to_range
    to_range = getattr(calls, "_to_range", None)
    if to_range is None:
        to_range = import_module(f"{_INTERPRETER}.utils").to_range
    return calls, calls._get_shared_memory, to_range


def _set_buffer(buffer, array):
    """Make ``array`` the interpreter's buffer for one access; returns the undo. Up to jax 0.10.0
    a buffer holds its array in a field, ``content``; from 0.10.1 in ``_content`` (``content``
    a read-only property), its shape in ``_logical_shape``."""
    if not hasattr(buffer, "_logical_shape"):
        previous = buffer.content
        buffer.content = array
        return lambda: setattr(buffer, "content", previous)
    previous = (buffer._content, buffer._logical_shape)
    buffer._content, buffer._logical_shape = array, tuple(array.shape)

    def restore():
        buffer._content, buffer._logical_shape = previous

    return restore


_RESHAPES = tuple(
    getattr(state_types, name) for name in ("RefReshaper", "ReshapeTransform") if hasattr(state_types, name)
)
_BITCASTS = tuple(
    getattr(state_types, name) for name in ("RefBitcaster", "BitcastTransform") if hasattr(state_types, name)
)


def _view(array: np.ndarray, transforms, to_range) -> np.ndarray:
    view = array
    for transform in transforms:
        if isinstance(transform, indexing.NDIndexer):
            view = view[to_range((transform,))]
        elif isinstance(transform, _RESHAPES):
            view = view.reshape(transform.shape)
        elif isinstance(transform, _BITCASTS):
            if np.dtype(transform.dtype).itemsize != view.dtype.itemsize:
                raise NotImplementedError(f"a bitcast from {view.dtype} to {transform.dtype} (packing)")
            view = view.view(transform.dtype)
        else:
            raise NotImplementedError(f"ref transform {type(transform).__name__}")
        if not np.shares_memory(view, array):
            raise NotImplementedError(f"ref transform {transform} would copy the buffer")
    return view


_VIEWS_LOCK = threading.RLock()


def _through_views(access, module, shared_memory, to_range):
    signature = inspect.signature(access)

    @functools.wraps(access)
    def through_views(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        transforms = jax.tree.map(int, bound.arguments["transforms"])
        if all(isinstance(t, indexing.NDIndexer) for t in transforms):
            return access(*args, **kwargs)
        space = module.TPU_MEMORY_SPACE_NAMES[int(bound.arguments["memory_space"])]
        core = module._local_core_id_or_zero_if_hbm(int(bound.arguments["local_core_id"]), space)
        key = (space, int(bound.arguments["buffer_id"]), int(bound.arguments["device_id"]), core)
        bound.arguments["transforms"] = ()
        # The devices of a sharded kernel interpret it on threads of their own: a buffer's array
        # is another access's view only while that access holds this lock.
        with _VIEWS_LOCK:
            buffer = shared_memory().mem[key]
            restore = _set_buffer(buffer, _view(buffer.content, transforms, to_range))
            try:
                return access(*bound.args, **bound.kwargs)
            finally:
                restore()

    # jax 0.12's DMAs call the function its error handler wraps (``get.__wrapped__``).
    inner = getattr(access, "__wrapped__", None)
    if inner is not None:
        through_views.__wrapped__ = _through_views(inner, module, shared_memory, to_range)
    return through_views


@contextlib.contextmanager
def interpreting_reshaped_refs():
    """The interpreter's buffer accesses through views of reshaped and bitcast refs while this
    lasts (process-wide)."""
    module, shared_memory, to_range = _interpreter()
    originals = {name: getattr(module, name) for name in ("get", "store", "swap")}
    for name, access in originals.items():
        setattr(module, name, _through_views(access, module, shared_memory, to_range))
    try:
        yield
    finally:
        try:
            # A kernel dispatched inside may still run: its accesses must find the views (a
            # call read after the block had run on the interpreter's own, which fail on them).
            jax.effects_barrier()
        finally:
            for name, access in originals.items():
                setattr(module, name, access)


def interpret_params():
    """The interpreter's settings here: each DMA runs when it is started. Its default runs a DMA
    at the first wait on its semaphores, from a queue of pending DMAs keyed by semaphore id
    alone, which the devices' kernels share (a TODO in JAX's source); with two devices a thread
    then spun forever on an empty queue (1 of 4 tp 2 engine runs at jax 0.8, none of 14 with
    DMAs run at start). A kernel that read a DMA's target before waiting for it would go
    unnoticed here."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(dma_execution_mode="eager")


def _tpu_v4_block_sizes(q_dtype, kv_dtype, q_heads, kv_heads, head_dim, page_size, max_num_tokens, pages_per_seq):
    """0.0.2's ``get_tuned_block_sizes`` for a TPU v4, whatever the device."""
    return min(pages_per_seq, 512 // page_size), min(max_num_tokens, 32)


# tpu_interpret_mode blocks open: engines started meanwhile keep "fa" on any device.
_open = 0


def keeps_fa() -> bool:
    """Whether engines started now keep the "fa" attention backend on a CPU (inside
    :func:`tpu_interpret_mode`)."""
    return _open > 0


@contextlib.contextmanager
def tpu_interpret_mode():
    """Engines started inside run the "fa" attention backend's Pallas kernels in JAX's TPU
    interpret mode, on any device (see the module's docstring). Process-wide while it lasts;
    start and close the engines inside it."""
    from jax._src import config as jax_config
    from jax.experimental.pallas import tpu as pltpu
    from sgl_jax.srt.layers.attention.flash_attn_kernel import flash_attention
    from sgl_jax.srt.model_executor import model_runner

    choose_backend = model_runner.ModelRunner._get_attention_backend

    def keeping_fa(self):
        device = self.server_args.device
        self.server_args.device = None  # its test for "cpu", the one that falls back to native
        try:
            return choose_backend(self)
        finally:
            self.server_args.device = device

    previous_mode = jax_config.pallas_tpu_interpret_mode_context_manager.get_global()
    block_sizes = flash_attention.get_tuned_block_sizes
    pltpu.set_tpu_interpret_mode(interpret_params())
    model_runner.ModelRunner._get_attention_backend = keeping_fa
    flash_attention.get_tuned_block_sizes = _tpu_v4_block_sizes
    global _open
    _open += 1
    try:
        with interpreting_reshaped_refs():
            yield
    finally:
        _open -= 1
        flash_attention.get_tuned_block_sizes = block_sizes
        model_runner.ModelRunner._get_attention_backend = choose_backend
        jax_config.pallas_tpu_interpret_mode_context_manager.set_global(previous_mode)
