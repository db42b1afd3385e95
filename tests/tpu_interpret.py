"""Reshaped and bitcast refs for JAX's TPU interpreter, in tests only.

The interpreter (``force_tpu_interpret_mode``) keeps each TPU buffer as a numpy array and reads
and writes it through the ref's transforms, which it takes to be indexers only
(``_to_range``). sglang-jax's ragged paged attention kernel DMAs pages through a reshape of
the KV cache's HBM ref (pages x page size merged into one axis) and loads its VMEM blocks
through bitcasts and reshapes, so the interpreter fails there (``RefReshaper`` has no
``indices`` at jax 0.8, ``ReshapeTransform`` at 0.12). :func:`interpreting_reshaped_refs`
wraps the interpreter's ``get``, ``store`` and ``swap``: where a ref's transforms hold more
than indexers, the buffer's array is replaced, for that one access, by the numpy view the
transforms make of it (each transform must give a view: a reshape that would copy, or a bitcast
between widths, is refused), and the access goes on with no transforms. What the kernel
computes is then the interpreter's, unchanged. Private JAX internals, at each end of the range
this project supports; a JAX release that moves them fails loudly here, not silently.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect

import jax
import numpy as np
from jax._src.state import indexing
from jax._src.state import types as state_types


def _interpreter():
    """(the module with get/store/swap, the shared memory's getter, how a buffer's array is set,
    the interpreter's own indexer-to-numpy-index function): jax 0.12's interpreter or 0.8's."""
    module = importlib.import_module("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
    if hasattr(module, "_get_shared_memory"):  # jax 0.12: the accesses live in interpret_pallas_call
        utils = importlib.import_module("jax._src.pallas.mosaic.interpret.utils")
        return module, module._get_shared_memory, _set_buffer_0_12, utils.to_range
    memory = importlib.import_module("jax._src.pallas.mosaic.interpret.shared_memory")
    return memory, memory.get_shared_memory, _set_buffer_0_8, memory._to_range


def _set_buffer_0_8(buffer, array):
    previous = buffer.content
    buffer.content = array
    return lambda: setattr(buffer, "content", previous)


def _set_buffer_0_12(buffer, array):
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


def _through_views(access, module, shared_memory, set_buffer, to_range):
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
        buffer = shared_memory().mem[key]
        restore = set_buffer(buffer, _view(buffer.content, transforms, to_range))
        bound.arguments["transforms"] = ()
        try:
            return access(*bound.args, **bound.kwargs)
        finally:
            restore()

    # jax 0.12's DMAs call the function its error handler wraps (``get.__wrapped__``).
    inner = getattr(access, "__wrapped__", None)
    if inner is not None:
        through_views.__wrapped__ = _through_views(inner, module, shared_memory, set_buffer, to_range)
    return through_views


@contextlib.contextmanager
def interpreting_reshaped_refs():
    """The interpreter's buffer accesses through views of reshaped and bitcast refs, for
    kernels traced inside this context."""
    module, shared_memory, set_buffer, to_range = _interpreter()
    originals = {name: getattr(module, name) for name in ("get", "store", "swap")}
    for name, access in originals.items():
        setattr(module, name, _through_views(access, module, shared_memory, set_buffer, to_range))
    try:
        yield
    finally:
        for name, access in originals.items():
            setattr(module, name, access)
