"""The engine's model state: its weight leaves (as the compiled forward reads them), its KV
pool and prefix cache.

Methods that change them must run on the scheduler thread between forwards: the handle runs
them there with :meth:`EngineHandle.call`. Reading leaves, specs and buffers is safe anywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trainer_bridge.sync import EngineLeaf

from . import inflight, sessions
from .buffers import device_nbytes
from .lora import TOKEN_SLOTS
from .patches import variables_sharded_lazily
from .programs import forward_cells
from .types import EngineError, ForwardMemory
from .workarounds import workaround_enabled

# Stands in for a released weight leaf (see ModelState.release_weight_leaves).
_RELEASED = np.zeros((), np.float32)


class ModelState:
    """Weights and KV pool of one engine (a part of :class:`EngineHandle`)."""

    def __init__(self, scheduler, engine, seed: int):
        self.scheduler = scheduler
        self._engine = engine
        self._seed = seed
        # The KV buffer allocator, compiled on the first drop.
        self._kv_allocator = None

    def close(self) -> None:
        """Free the KV pool and drop the references to the engine objects (and so to the rest of
        its device memory). The pool is deleted, not only let go: the engine's objects reach each
        other (its prefix cache reaches the pool), and a handle the caller keeps would keep them."""
        try:
            if self.scheduler is not None:
                self.delete_kv_buffers()
        finally:
            self.scheduler = self._engine = self._kv_allocator = None

    def tokenizer_manager(self):
        """The engine's tokenizer manager (its request loop's side of each request)."""
        return self._engine.tokenizer_manager

    @property
    def runner(self):
        """The engine's model runner."""
        return self.scheduler.tp_worker.worker.model_runner

    # ---- weights ---------------------------------------------------------------------------

    def weight_leaves(self) -> list[jax.Array]:
        """The arrays the next forward pass will read, in the engine's leaf order."""
        return list(forward_cells(self.runner)["model_state_leaves"].cell_contents)

    def leaf_specs(self) -> list[EngineLeaf]:
        """Weight leaves by path (``transformer.layers.0.self_attn.q_proj.weight``), in order."""
        from flax import nnx

        _, state = nnx.split(self.runner.model)
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        leaves = self.weight_leaves()
        if len(flat) != len(leaves):
            raise EngineError(f"model state has {len(flat)} leaves but the forward reads {len(leaves)}")
        specs = []
        for index, ((path, _), leaf) in enumerate(zip(flat, leaves)):
            name = ".".join(_key_name(k) for k in path).removesuffix(".value")
            engine_state = name.startswith("rng.") or name == TOKEN_SLOTS
            specs.append(EngineLeaf(index, name, tuple(leaf.shape), leaf.dtype, leaf.sharding, engine_state))
        return specs

    def replace_weight_leaves(self, new_leaves: list[jax.Array]) -> None:
        # The forward reads its leaves from a closure cell on every call, so replacing the
        # cell's list takes effect at the next forward with no recompilation. The nnx module is
        # updated too so that it agrees with what the forward reads.
        from flax import nnx

        cells = forward_cells(self.runner)
        state = jax.tree_util.tree_unflatten(cells["model_state_def"].cell_contents, new_leaves)
        cells["model_state_leaves"].cell_contents = new_leaves
        nnx.update(self.runner.model, state)

    def release_weight_leaves(self, indices: tuple[int, ...]) -> None:
        # A scalar placeholder in both the forward's leaf list and the nnx module.
        leaves = self.weight_leaves()
        for index in indices:
            leaves[index] = _RELEASED
        self.replace_weight_leaves(leaves)

    def copy_weight_leaves(self, indices: tuple[int, ...]) -> None:
        leaves = self.weight_leaves()
        for index in indices:
            leaves[index] = jax.device_put(leaves[index], leaves[index].sharding, may_alias=False)
        self.replace_weight_leaves(leaves)

    def reload_weights_from_model_dir(self) -> None:
        from flax import nnx

        runner = self.runner
        with variables_sharded_lazily():
            runner.model.load_weights(runner.model_config, jax.random.key(self._seed))
        _, state = nnx.split(runner.model)
        leaves, _ = jax.tree_util.tree_flatten(state)
        forward_cells(self.runner)["model_state_leaves"].cell_contents = leaves

    # ---- KV cache and prefix cache ---------------------------------------------------------

    def flush_prefix_cache(self) -> None:
        if not workaround_enabled("flush-cache"):
            pins = sessions.pins_of(self.scheduler)
            if pins is not None:  # unlocked whether or not the engine's flush succeeds
                pins.release_all()
            self._engine.flush_cache()
            return
        inflight.reset_kv_state(self.scheduler)

    @property
    def _kv_pool(self):
        return self.runner.token_to_kv_pool

    def kv_buffers(self) -> list[jax.Array]:
        return list(self._kv_pool.kv_buffer)

    def kv_buffer_spec(self) -> tuple[tuple[int, ...], np.dtype, int]:
        """(shape of one layer's buffer, dtype, number of layers) of the KV pool."""
        pool = self._kv_pool
        shape = (pool.size + pool.page_size, pool.head_num * 2, pool.head_dim)
        return shape, np.dtype(pool.dtype), int(pool.layer_num)

    def drop_kv_buffers(self) -> tuple[int, int]:
        self.flush_prefix_cache()
        # Compiled here, not on the rebuild: the rebuild runs inside the next generate call,
        # which must compile nothing.
        self._ensure_kv_allocator()
        return self.delete_kv_buffers()

    def delete_kv_buffers(self) -> tuple[int, int]:
        pool = self._kv_pool
        buffers = list(pool.kv_buffer)
        pool.kv_buffer = []
        device_bytes = sum(device_nbytes(buf) for buf in buffers)
        for buf in buffers:
            if not buf.is_deleted():
                buf.delete()
        return len(buffers), device_bytes

    def rebuild_kv_buffers(self) -> bool:
        """Whether it rebuilt them: an engine whose drop failed kept its buffers (and the
        prefix cache over them), which stay."""
        # The pool's own _create_buffers jits a fresh lambda per layer, compiling on every
        # rebuild; one allocator compiled once per engine (on its first drop) is reused instead.
        pool = self._kv_pool
        if pool.kv_buffer:
            return False
        self._ensure_kv_allocator()
        pool.kv_buffer = [self._kv_allocator() for _ in range(pool.layer_num)]
        return True

    def _ensure_kv_allocator(self) -> None:
        if self._kv_allocator is None:
            shape, dtype, _ = self.kv_buffer_spec()
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self._kv_pool.kv_sharding)
            self._kv_allocator = zeros.lower().compile()

    # ---- compiled forward ------------------------------------------------------------------

    def forward_memory(self, num_tokens: int, decode: bool) -> ForwardMemory:
        from sgl_jax.srt.layers.logits_processor import LogitsMetadata
        from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        worker, runner = self.scheduler.tp_worker, self.runner
        if decode:
            rows, mode = num_tokens, ForwardMode.DECODE
            page = worker.page_size
            slots = -(-num_tokens * worker.max_req_len // page) * page
        else:
            rows, mode = worker.get_max_padded_size()[0], ForwardMode.EXTEND
            slots = worker.precompile_cache_loc_paddings[-1]
        batch = worker.generate_model_worker_batch(rows, num_tokens, mode, slots)
        cells = forward_cells(self.runner)
        with jax.set_mesh(runner.mesh):
            compiled = (
                cells["jitted_run_model"]
                .cell_contents.lower(
                    cells["model_def"].cell_contents,
                    cells["model_state_def"].cell_contents,
                    cells["model_state_leaves"].cell_contents,
                    ForwardBatch.init_new(batch, runner),
                    runner.token_to_kv_pool,
                    LogitsMetadata.from_model_worker_batch(batch, runner.mesh),
                )
                .compile()
            )
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
