"""The engine's TPU kernels (Pallas: the "fa" attention backend's ragged paged attention, the
fused KV-cache write) at every supported JAX release.

Workaround "tpu-kernel-jax-names": 0.0.2's kernels use ``pltpu.ANY``, ``pltpu.TPUMemorySpace``
and ``jax._src.dtypes.bit_width``, which jax 0.12 no longer has (``pl.ANY``,
``pltpu.MemorySpace`` and ``dtypes.itemsize_bits`` remain): on a TPU at jax 0.12 the attention
and the KV write fail as they are traced. Each kernel module gets namespaces that add the old
names to the new modules; JAX itself is left as it is.
"""

from __future__ import annotations

import importlib


class _WithNames:
    """``module``'s attributes, plus ``names`` where the module lacks them."""

    def __init__(self, module, **names):
        self._module = module
        self._names = {name: value for name, value in names.items() if not hasattr(module, name)}

    def __getattr__(self, name):
        if name in self._names:
            return self._names[name]
        return getattr(self._module, name)


# The engine modules that use the removed names, and which of their globals hold them.
_KERNEL_MODULES = (
    ("sgl_jax.srt.layers.attention.flash_attn_kernel.flash_attention", ("pltpu",)),
    ("sgl_jax.srt.layers.attention.flash_attn_kernel.util", ("dtypes",)),
    ("sgl_jax.srt.mem_cache.memory_pool", ("pltpu", "dtypes")),
)


def patch_kernel_jax_names() -> None:
    """Give the engine's kernel modules the JAX names they were written against (a no-op where
    JAX still has them)."""
    from jax._src import dtypes
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    memory_space = getattr(pltpu, "TPUMemorySpace", None) or _WithNames(pltpu.MemorySpace, ANY=pl.ANY)
    compat = {
        "pltpu": _WithNames(pltpu, ANY=pl.ANY, TPUMemorySpace=memory_space),
        "dtypes": _WithNames(dtypes, bit_width=getattr(dtypes, "itemsize_bits", None)),
    }
    for module_name, globals_used in _KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for name in globals_used:
            setattr(module, name, compat[name])
