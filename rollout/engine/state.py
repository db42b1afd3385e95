"""The engine's model state: its weight leaves (as the compiled forward reads them), its KV
pool and prefix cache.

Everything that changes them must run on the scheduler thread between forwards: those are the
private ``_...`` methods, and each public method runs its private one through
:meth:`EngineHandle.call` (callable from any thread). Reading leaves and specs is safe anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import inflight
from .patches import variables_sharded_lazily
from .types import EngineError, ForwardMemory, LeafSpec, device_nbytes
from .workarounds import workaround_enabled

# Stands in for a released weight leaf (see ModelState.release_weight_leaves).
_RELEASED = np.zeros((), np.float32)


class ModelState:
    """Weights and KV pool of an :class:`EngineHandle` (a part of it: it reads the handle's
    ``_scheduler``, ``_engine`` and ``options`` and runs work with its ``call``)."""

    _kv_allocator = None

    @property
    def _model_runner(self):
        return self._scheduler.tp_worker.worker.model_runner

    def _closure_cells(self) -> dict[str, Any]:
        run_model = self._model_runner.jitted_run_model
        return dict(zip(run_model.__code__.co_freevars, run_model.__closure__))

    # ---- weights ---------------------------------------------------------------------------

    def weight_leaves(self) -> list[jax.Array]:
        """The arrays the next forward pass will read, in the engine's leaf order."""
        return list(self._closure_cells()["model_state_leaves"].cell_contents)

    def leaf_specs(self) -> list[LeafSpec]:
        """Weight leaves by path (``transformer.layers.0.self_attn.q_proj.weight``), in order."""
        from flax import nnx

        _, state = nnx.split(self._model_runner.model)
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        leaves = self.weight_leaves()
        if len(flat) != len(leaves):
            raise EngineError(
                f"model state has {len(flat)} leaves but the forward reads {len(leaves)}"
            )
        specs = []
        for (path, _), leaf in zip(flat, leaves):
            name = ".".join(_key_name(k) for k in path).removesuffix(".value")
            rng_state = name.startswith("rng.")
            specs.append(LeafSpec(name, tuple(leaf.shape), leaf.dtype, leaf.sharding, int(leaf.nbytes), rng_state))
        return specs

    def replace_weight_leaves(
        self,
        new_leaves: Sequence[jax.Array],
        *,
        flush_prefix_cache: bool = True,
        free: Iterable[int] = (),
        version: int | None = None,
        in_flight: bool = False,
        recompute_kv: bool = False,
    ) -> inflight.SwapRecord:
        """Swap in a whole new leaf list between forwards, then (by default) forget the cached
        prefixes computed with the old weights, and delete the old arrays at the indices in
        ``free`` (those the engine owns) at once, so a swap's peak memory stays at the bytes
        it writes. Every leaf must keep its shape, dtype and sharding (the caller checks).
        Tokens sampled from then on are labelled ``version`` (``GenerateOutput.token_versions``).

        Drain (default): runs while the engine is idle. ``in_flight``: runs at the next forward
        boundary and the running requests go on (see :mod:`.inflight`), keeping their KV or,
        with ``recompute_kv``, prefilled again under the new weights first.
        """
        new_leaves, free = list(new_leaves), tuple(free)
        control, queued = self._control, time.perf_counter()

        def swap():
            old = self.weight_leaves()
            self._replace_weight_leaves(new_leaves)
            if version is not None:
                control.weight_version = version
            for index in free:
                if old[index] is not new_leaves[index]:
                    old[index].delete()

        def drained() -> inflight.SwapRecord:
            start = time.perf_counter()
            swap()
            if flush_prefix_cache:
                self._flush_prefix_cache()
            return inflight.SwapRecord(control.weight_version, queued, start, time.perf_counter(), False, 0, 0)

        def in_flight_swap() -> inflight.SwapRecord:
            label = control.weight_version if version is None else version
            return inflight.swap_at_boundary(self._scheduler, swap, version=label, recompute=recompute_kv, queued=queued)

        record = self.call_at_boundary(in_flight_swap) if in_flight else self.call(drained)
        control.swaps.append(record)
        return record

    @property
    def weight_version(self) -> int:
        """The version label of the weights the next forward samples with."""
        return self._control.weight_version

    def swap_records(self) -> list[inflight.SwapRecord]:
        """This engine's latest weight swaps (see ``busy_intervals`` for its forwards)."""
        return list(self._control.swaps)

    def _replace_weight_leaves(self, new_leaves: list[jax.Array]) -> None:
        # The forward reads its leaves from a closure cell on every call, so replacing the
        # cell's list takes effect at the next forward with no recompilation. The nnx module is
        # updated too so that it agrees with what the forward reads.
        from flax import nnx

        cells = self._closure_cells()
        state = jax.tree_util.tree_unflatten(cells["model_state_def"].cell_contents, new_leaves)
        cells["model_state_leaves"].cell_contents = new_leaves
        nnx.update(self._model_runner.model, state)

    def release_weight_leaves(self, indices: Iterable[int]) -> None:
        """Drop the engine's references to the leaves at ``indices``, so a trainer can donate
        the buffers. The forward must not run again until :meth:`replace_weight_leaves` puts
        real leaves back (the worker enforces this)."""
        indices = tuple(indices)
        self.call(lambda: self._release_weight_leaves(indices))

    def _release_weight_leaves(self, indices: tuple[int, ...]) -> None:
        # A scalar placeholder in both the forward's leaf list and the nnx module.
        leaves = self.weight_leaves()
        for index in indices:
            leaves[index] = _RELEASED
        self._replace_weight_leaves(leaves)

    def reload_weights_from_model_dir(self) -> None:
        """sglang-jax's own safetensors load into the running model.

        The engine's reload path, kept as the baseline the sync benchmark compares against.
        Needs an engine started with a safetensors load format (the loader adds rng leaves).
        """
        self.call(self._reload_weights_from_model_dir)

    def _reload_weights_from_model_dir(self) -> None:
        from flax import nnx

        runner = self._model_runner
        with variables_sharded_lazily():
            runner.model.load_weights(runner.model_config, jax.random.key(self.options.seed))
        _, state = nnx.split(runner.model)
        leaves, _ = jax.tree_util.tree_flatten(state)
        self._closure_cells()["model_state_leaves"].cell_contents = leaves

    def _align_lm_head_dtype(self) -> None:
        """Workaround "untied-head-dtype" (scheduler thread, before the first forward)."""
        from flax import nnx

        runner = self._model_runner
        head = getattr(runner.model, "lm_head", None)
        if head is None or jnp.dtype(head.dtype) == jnp.dtype(runner.dtype):
            return
        weight = head.embedding.value
        head.dtype = head.param_dtype = runner.dtype
        head.embedding.value = jax.device_put(weight.astype(runner.dtype), weight.sharding)
        graph_def, state = nnx.split(runner.model)
        leaves, state_def = jax.tree_util.tree_flatten(state)
        cells = self._closure_cells()
        cells["model_def"].cell_contents = graph_def
        cells["model_state_def"].cell_contents = state_def
        cells["model_state_leaves"].cell_contents = leaves

    # ---- KV cache and prefix cache ---------------------------------------------------------

    def flush_prefix_cache(self) -> None:
        """Forget every cached prefix so no KV computed with old weights is reused."""
        self.call(self._flush_prefix_cache)

    def _flush_prefix_cache(self) -> None:
        if not workaround_enabled("flush-cache"):
            self._engine.flush_cache()
            return
        inflight.reset_kv_state(self._scheduler)

    @property
    def _kv_pool(self):
        return self._model_runner.token_to_kv_pool

    def kv_tokens_held(self) -> int:
        """KV slots held by requests once the engine is idle (waits for that): what a request
        that ended or was aborted did not give back. Prefix-cache slots are free to evict and
        not counted."""
        return self.call(self._kv_tokens_held)

    def _kv_tokens_held(self) -> int:
        scheduler = self._scheduler
        free = scheduler.token_to_kv_pool_allocator.available_size() + scheduler.tree_cache.evictable_size()
        return int(scheduler.max_total_num_tokens) - int(free)

    def kv_buffers(self) -> list[jax.Array]:
        return list(self._kv_pool.kv_buffer)

    def kv_buffer_spec(self) -> tuple[tuple[int, ...], np.dtype, int]:
        """(shape of one layer's buffer, dtype, number of layers) of the KV pool."""
        pool = self._kv_pool
        shape = (pool.size + pool.page_size, pool.head_num * 2, pool.head_dim)
        return shape, np.dtype(pool.dtype), int(pool.layer_num)

    def drop_kv_buffers(self) -> tuple[int, int]:
        """Flush the prefix cache and delete the KV buffers.

        Returns (number of buffers, device bytes they held, summed over devices).
        """
        return self.call(self._drop_kv_buffers)

    def _drop_kv_buffers(self) -> tuple[int, int]:
        self._flush_prefix_cache()
        pool = self._kv_pool
        # Compiled here, not on the rebuild: the rebuild runs inside the next generate call,
        # which must compile nothing.
        self._ensure_kv_allocator()
        buffers = list(pool.kv_buffer)
        pool.kv_buffer = []
        device_bytes = sum(device_nbytes(buf) for buf in buffers)
        for buf in buffers:
            buf.delete()
        return len(buffers), device_bytes

    def rebuild_kv_buffers(self) -> None:
        """Recreate the KV buffers: same shapes, dtype and sharding."""
        self.call(self._rebuild_kv_buffers)

    def _rebuild_kv_buffers(self) -> None:
        # The pool's own _create_buffers jits a fresh lambda per layer, compiling on every
        # rebuild; one allocator compiled once per handle (on its first drop) is reused instead.
        pool = self._kv_pool
        self._ensure_kv_allocator()
        pool.kv_buffer = [self._kv_allocator() for _ in range(pool.layer_num)]

    def _ensure_kv_allocator(self) -> None:
        if self._kv_allocator is None:
            shape, dtype, _ = self.kv_buffer_spec()
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self._kv_pool.kv_sharding)
            self._kv_allocator = zeros.lower().compile()

    # ---- compiled forward ------------------------------------------------------------------

    def forward_memory(self, num_tokens: int, decode: bool = False) -> ForwardMemory:
        """XLA's memory analysis of the forward compiled for one batch, padded as the scheduler
        pads it: a prefill of ``num_tokens`` tokens (requests padded to the largest batch size,
        ``cache_loc`` to that many full contexts) or a decode step of ``num_tokens`` rows.

        Compiles (with this engine's weights, KV pool and attention) and runs nothing.
        """
        return self.call(lambda: self._forward_memory(num_tokens, decode))

    def _forward_memory(self, num_tokens: int, decode: bool) -> ForwardMemory:
        from sgl_jax.srt.layers.logits_processor import LogitsMetadata
        from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        worker, runner = self._scheduler.tp_worker, self._model_runner
        if decode:
            rows, mode = num_tokens, ForwardMode.DECODE
            page = worker.page_size
            slots = -(-num_tokens * worker.max_req_len // page) * page
        else:
            rows, mode = worker.get_max_padded_size()[0], ForwardMode.EXTEND
            slots = worker.precompile_cache_loc_paddings[-1]
        batch = worker.generate_model_worker_batch(rows, num_tokens, mode, slots)
        cells = self._closure_cells()
        with jax.set_mesh(runner.mesh):
            compiled = cells["jitted_run_model"].cell_contents.lower(
                cells["model_def"].cell_contents,
                cells["model_state_def"].cell_contents,
                cells["model_state_leaves"].cell_contents,
                ForwardBatch.init_new(batch, runner),
                runner.token_to_kv_pool,
                LogitsMetadata.from_model_worker_batch(batch, runner.mesh),
            ).compile()
        analysis = compiled.memory_analysis()
        return ForwardMemory(
            temp_bytes=int(analysis.temp_size_in_bytes),
            argument_bytes=int(analysis.argument_size_in_bytes),
            output_bytes=int(analysis.output_size_in_bytes),
        )


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)
