"""Several decode steps per dispatch: the scheduler's Python off the path between forwards.

With ``EngineOptions.decode_steps = K > 1``, the first decode step of a running batch runs K
steps at once on the device: one compiled loop of forward + sampler (the same model, attention
and sampler the engine's own step runs, with per-request seeds keyed by position), each step's
sampled ids fed to the next. The KV slots of steps 1..K-1 are allocated before the loop, as
0.0.2's ``prepare_for_decode`` would have, step after step. The scheduler then goes on exactly
as it does without chunks, one step per loop iteration (finish checks, stop strings, aborts,
streaming, weight versions, log-prob sinks, boundary calls), except that a step the chunk
already computed takes its ids from the chunk (its KV slots are the chunk's, its forward is
skipped). So everything the scheduler decides between steps still lands between steps:

- a request that finished or was aborted leaves the batch as before; the chunk's slots it did
  not reach are freed;
- a request joining the batch, a boundary call (an in-flight swap, a session release) or a
  weight swap ends the chunk: its unused slots are freed and the next step dispatches a new one
  under the current weights;
- the price is device work: steps computed for rows that finished early, or for a chunk ended
  early, are thrown away (never more than K-1 steps per row and chunk).

Attention across the chunk: the forward's ``cache_loc`` is laid out for each row's length at
the chunk's last step, and a step sees only the slots its position has reached (later ones are
given as slot 0, the pool's padding slot, which attention never reads). Each query's keys are
then those of a one-step forward, in the same chunks of the online softmax.

Eligible batches: decode, no penalties (frequency/presence penalties accumulate between
steps on the host), not the engine's own log-probs (``return_logprob``; the worker's sinks are
served). Engines: the paged native attention (this project's, ``attention.py``), no MoE routing
recording and one LoRA slot; ``handle`` refuses other combinations at start-up.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

# Scheduler attribute holding its DecodeChunks.
_STATE = "_rollout_decode_chunks"


@dataclasses.dataclass
class DecodeChunk:
    """The steps one dispatch computed for a batch's rows, served one scheduler step at a time."""

    reqs: list  # the batch's requests at dispatch, in row order
    version: int  # the weight version of the forwards
    tokens: np.ndarray  # [steps, rows] sampled ids
    logprobs: np.ndarray  # [steps, rows]
    kept: np.ndarray  # [steps, rows]
    slots: np.ndarray  # [steps, rows] KV slot of each step's input token
    bid: int
    next_step: int = 1  # step 0 is served by the dispatch itself
    row_of: dict = dataclasses.field(default_factory=dict)  # id(req) -> row

    def __post_init__(self):
        self.row_of = {id(req): row for row, req in enumerate(self.reqs)}

    @property
    def steps(self) -> int:
        return self.tokens.shape[0]

    def rows_for(self, reqs: list) -> np.ndarray | None:
        """The chunk's rows of ``reqs`` if it computed the next step for every one of them."""
        if self.next_step >= self.steps or not reqs:
            return None
        rows = [self.row_of.get(id(req)) for req in reqs]
        if any(row is None for row in rows):
            return None
        return np.asarray(rows)


@dataclasses.dataclass(frozen=True)
class DecodeChunkStats:
    """What an engine's decode chunks did since it started."""

    dispatched: int  # chunks run (one dispatch each)
    steps_served: int  # scheduler steps that took their ids from a chunk, dispatches excluded
    row_steps_discarded: int  # row-steps computed that no scheduler step took


class DecodeChunks:
    """One engine's chunk in progress (scheduler thread only)."""

    def __init__(self, scheduler, control, steps: int):
        self.scheduler = scheduler
        self.control = control
        self.steps = steps
        self.chunk: DecodeChunk | None = None
        # Set when the scheduler's batch was prepared for the chunk's next step.
        self.prepared = False
        self.dispatched = 0  # chunks run
        self.steps_served = 0  # steps taken from chunks (beyond each chunk's first)
        self.steps_discarded = 0  # row-steps computed and thrown away

    def stats(self) -> DecodeChunkStats:
        return DecodeChunkStats(self.dispatched, self.steps_served, self.steps_discarded)

    # ---- the scheduler's step ----------------------------------------------------------------

    def covering(self, batch) -> np.ndarray | None:
        """The rows of ``batch``'s next step if the chunk computed it; otherwise the chunk ends."""
        chunk = self.chunk
        if chunk is None:
            return None
        rows = chunk.rows_for(batch.reqs) if chunk.version == self.control.weight_version else None
        if rows is None:
            self.release()
        return rows

    def prepare_from_chunk(self, batch, rows: np.ndarray) -> None:
        """``batch.prepare_for_decode()`` with the chunk's KV slots for its next step."""
        chunk = self.chunk
        self._free_left_rows(rows)
        step_slots = chunk.slots[chunk.next_step, rows]
        page_size = self.scheduler.token_to_kv_pool_allocator.page_size
        name = "alloc_token_slots" if page_size == 1 else "alloc_paged_token_slots_decode"
        setattr(batch, name, lambda *args, **kwargs: step_slots.copy())
        try:
            batch.prepare_for_decode()
        finally:
            delattr(batch, name)
        self.prepared = True

    def serve(self, batch):
        """The next step of the chunk as the scheduler's ``run_batch`` result (``batch`` was
        prepared by :meth:`prepare_from_chunk`)."""
        chunk = self.chunk
        rows = chunk.rows_for(batch.reqs)
        step = chunk.next_step
        chunk.next_step += 1
        self.steps_served += 1
        return self._result(batch, chunk, step, rows, cache_miss_count=0)

    def release(self) -> None:
        """End the chunk: free the KV slots of the steps it computed that no step took."""
        chunk, self.chunk = self.chunk, None
        self.prepared = False
        if chunk is None or chunk.next_step >= chunk.steps:
            return
        rows = np.asarray(sorted(chunk.row_of.values()), dtype=np.int64)
        self._free(chunk.slots[chunk.next_step :, rows])

    def _free_left_rows(self, rows: np.ndarray) -> None:
        chunk = self.chunk
        left = np.setdiff1d(np.asarray(sorted(chunk.row_of.values()), dtype=np.int64), rows)
        if len(left):
            self._free(chunk.slots[chunk.next_step :, left])
            # Never freed twice: those rows are no longer the chunk's.
            for row in left:
                chunk.row_of.pop(id(chunk.reqs[row]), None)

    def _free(self, slots: np.ndarray) -> None:
        """Free KV slots the chunk allocated and no step took."""
        slots = slots.ravel()
        self.steps_discarded += slots.size
        page_size = self.scheduler.token_to_kv_pool_allocator.page_size
        # A page belongs to the chunk if its first slot does (later slots of a page the engine
        # already held go with it).
        slots = slots[slots % page_size == 0]
        if slots.size:
            self.scheduler.token_to_kv_pool_allocator.free(slots)

    def _result(self, batch, chunk: DecodeChunk, step: int, rows: np.ndarray, cache_miss_count: int):
        from sgl_jax.srt.managers.scheduler import GenerationBatchResult

        from .patches import deliver_token_logprobs

        ids = chunk.tokens[step, rows]
        batch.output_ids = ids
        deliver_token_logprobs(self.scheduler, chunk.logprobs[step, rows], chunk.kept[step, rows])
        return GenerationBatchResult(
            logits_output=None,
            next_token_ids=ids.tolist(),
            extend_input_len_per_req=None,
            extend_logprob_start_len_per_req=None,
            bid=chunk.bid,
            cache_miss_count=cache_miss_count,
        )

    # ---- dispatch ----------------------------------------------------------------------------

    def eligible(self, batch) -> bool:
        return (
            batch.forward_mode.is_decode()
            and not batch.return_logprob
            and not batch.sampling_info.penalizer_orchestrator.is_required
        )

    def dispatch(self, batch):
        """Run up to ``steps`` decode steps of ``batch`` (prepared for its first) in one call;
        returns the first step's result, or None where a chunk would be one step."""
        steps = self._steps_for(batch)
        if steps <= 1:
            return None
        slots = self._allocate(batch, steps)
        if slots.shape[0] <= 1:
            return None
        scheduler = self.scheduler
        worker = scheduler.tp_worker
        paddings = worker.get_precompile_paddings()
        mwb = batch.get_model_worker_batch(*paddings, scheduler.page_size)
        plan = _plan(mwb, batch, slots, scheduler.req_to_token_pool.req_to_token, scheduler.page_size)
        if plan is None:
            self._free(slots[1:])
            return None
        tokens, logprobs, kept, misses = run_chunk(worker, mwb, plan, self.steps)
        n = slots.shape[0]
        chunk = DecodeChunk(
            reqs=list(batch.reqs),
            version=self.control.weight_version,
            tokens=tokens[:n, : len(batch.reqs)],
            logprobs=logprobs[:n, : len(batch.reqs)],
            kept=kept[:n, : len(batch.reqs)],
            slots=slots,
            bid=mwb.bid,
        )
        self.chunk = chunk
        self.dispatched += 1
        return self._result(batch, chunk, 0, np.arange(len(batch.reqs)), misses)

    def _steps_for(self, batch) -> int:
        # No step past the longest request's remaining tokens or past any row's context.
        remaining = max(req.sampling_params.max_new_tokens - len(req.output_ids) for req in batch.reqs)
        width = self.scheduler.req_to_token_pool.req_to_token.shape[1]
        room = width - int(np.max(batch.seq_lens)) + 1
        return max(1, min(self.steps, remaining, room))

    def _allocate(self, batch, steps: int) -> np.ndarray:
        """[steps, rows] KV slots: step 0's from prepare_for_decode, then the engine's own
        allocation for each later step, as far as the pool allows."""
        allocator = self.scheduler.token_to_kv_pool_allocator
        page_size = allocator.page_size
        seq_lens = np.asarray(batch.seq_lens)
        slots = [np.asarray(batch.out_cache_loc)]
        for step in range(1, steps):
            if page_size == 1:
                batch._evict_tree_cache_if_needed(len(seq_lens))
                locs = allocator.alloc(len(seq_lens))
            else:
                batch._evict_tree_cache_if_needed(len(seq_lens) * page_size)
                locs = allocator.alloc_decode((seq_lens + step).tolist(), slots[-1].tolist())
            if locs is None:
                break
            slots.append(np.asarray(locs))
        slots = np.stack(slots).astype(np.int32)
        if slots.shape[0] > 1:
            rows = np.asarray(batch.req_pool_indices)
            positions = seq_lens[None, :] - 1 + np.arange(slots.shape[0])[:, None]
            req_to_token = self.scheduler.req_to_token_pool.req_to_token
            req_to_token[np.broadcast_to(rows, positions.shape), positions] = slots
        return slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChunkPlan:
    """The device arrays that vary across a chunk's steps."""

    steps: jax.Array  # () steps to run
    out_cache_loc: jax.Array  # [max_steps, padded rows] KV slot written at each step (-1: none)
    cache_loc: jax.Array  # [L] each row's slots at the chunk's last step
    visible_from: jax.Array  # [L] the step from which each cache_loc entry is visible
    seq_lens: jax.Array  # [padded rows] each row's length at the last step (0: padding)


def _plan(mwb, batch, slots: np.ndarray, req_to_token: np.ndarray, page_size: int):
    steps, rows = slots.shape
    padded_rows = len(mwb.seq_lens)
    first = np.asarray(batch.seq_lens, np.int64)  # lengths at step 0
    last = first + steps - 1
    spans = (last + page_size - 1) // page_size * page_size
    size = len(mwb.cache_loc)
    if spans.sum() > size:
        return None
    starts = np.cumsum(spans) - spans
    owner = np.repeat(np.arange(rows), spans)
    col = np.arange(spans.sum()) - starts[owner]
    used = col < last[owner]
    cache_loc = np.zeros(size, np.int32)
    visible_from = np.full(size, np.iinfo(np.int32).max, np.int32)
    table_rows = np.asarray(batch.req_pool_indices)[owner]
    cache_loc[: spans.sum()] = np.where(used, req_to_token[table_rows, np.minimum(col, req_to_token.shape[1] - 1)], 0)
    visible_from[: spans.sum()] = np.where(used, np.maximum(col - first[owner] + 1, 0), visible_from[: spans.sum()])
    out_cache_loc = np.full((steps, padded_rows), -1, np.int32)
    out_cache_loc[:, :rows] = slots
    seq_lens = np.zeros(padded_rows, np.int32)
    seq_lens[:rows] = last
    return steps, out_cache_loc, cache_loc, visible_from, seq_lens


def run_chunk(worker, mwb, plan, max_steps: int):
    """Run ``plan``'s steps of ``mwb``'s decode batch on the device: the sampled ids, log-probs
    and kept counts [max_steps, padded rows] on the host, and the compiles it caused."""
    import jax._src.test_util as jtu
    from sgl_jax.srt.layers.logits_processor import LogitsMetadata
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch
    from sgl_jax.srt.sampling.sampling_batch_info import SamplingMetadata

    runner = worker.model_runner
    steps, out_cache_loc, cache_loc, visible_from, seq_lens = plan
    padded_out = np.full((max_steps, out_cache_loc.shape[1]), -1, np.int32)
    padded_out[: out_cache_loc.shape[0]] = out_cache_loc
    replicated = jax.sharding.NamedSharding(runner.mesh, jax.sharding.PartitionSpec())
    chunk_plan = ChunkPlan(
        *jax.device_put(
            (np.int32(steps), padded_out, cache_loc, visible_from, seq_lens),
            replicated if jax.process_count() == 1 else None,
        )
    )
    forward_batch = ForwardBatch.init_new(mwb, runner)
    logits_metadata = LogitsMetadata.from_model_worker_batch(mwb, runner.mesh)
    sampling_metadata = SamplingMetadata.from_model_worker_batch(mwb, len(mwb.seq_lens) - mwb.real_bs, runner.mesh)
    cells = dict(zip(runner.jitted_run_model.__code__.co_freevars, runner.jitted_run_model.__closure__))
    sampler_def, sampler_state_def, sampler_leaves = runner.jitted_sampler.args
    with jtu.count_pjit_cpp_cache_miss() as count, jax.set_mesh(runner.mesh):
        kv, tokens, logprobs, kept = _decode_chunk(
            cells["model_def"].cell_contents,
            cells["model_state_def"].cell_contents,
            cells["model_state_leaves"].cell_contents,
            sampler_def,
            sampler_state_def,
            sampler_leaves,
            forward_batch,
            runner.token_to_kv_pool,
            logits_metadata,
            sampling_metadata,
            chunk_plan,
            max_steps=max_steps,
        )
        misses = count()
    runner._set_kv_cache_after_forward(kv, forward_batch)
    tokens, logprobs, kept = jax.device_get((tokens, logprobs, kept))
    return np.asarray(tokens), np.asarray(logprobs), np.asarray(kept), misses


@functools.partial(
    jax.jit,
    static_argnames=("model_state_def", "sampler_state_def", "max_steps"),
    donate_argnames=("kv_pool",),
)
def _decode_chunk(
    model_def,
    model_state_def,
    model_leaves,
    sampler_def,
    sampler_state_def,
    sampler_leaves,
    forward_batch,
    kv_pool,
    logits_metadata,
    sampling_metadata,
    plan: ChunkPlan,
    *,
    max_steps: int,
):
    from flax import nnx

    rows = forward_batch.input_ids.shape[0]
    real = forward_batch.seq_lens > 0
    first_positions = forward_batch.positions
    kv_leaves, kv_def = jax.tree_util.tree_flatten(kv_pool)
    outputs = (jnp.zeros((max_steps, rows), jnp.int32), jnp.zeros((max_steps, rows), jnp.float32))
    outputs += (jnp.zeros((max_steps, rows), jnp.int32),)

    def step(i, carry):
        kv, ids, (tokens, logprobs, kept) = carry
        positions = jnp.where(real, first_positions + i, 0)
        # A copy, not dataclasses.replace: the batch jit unflattened has no bid.
        batch = copy.copy(forward_batch)
        batch.input_ids, batch.positions, batch.seq_lens = ids, positions, plan.seq_lens
        batch.out_cache_loc = plan.out_cache_loc[i]
        batch.cache_loc = jnp.where(plan.visible_from <= i, plan.cache_loc, 0)
        model = nnx.merge(model_def, jax.tree_util.tree_unflatten(model_state_def, model_leaves))
        logits_output, layers_kv, _ = model(batch, jax.tree_util.tree_unflatten(kv_def, kv), logits_metadata)
        sampler = nnx.merge(sampler_def, jax.tree_util.tree_unflatten(sampler_state_def, sampler_leaves))
        new_ids, new_logprobs, new_kept = sampler(logits_output, sampling_metadata, positions)
        new_ids = new_ids.astype(jnp.int32)
        kv = [jax.lax.with_sharding_constraint(layer, kv_pool.kv_sharding) for layer in layers_kv]
        outputs = (tokens.at[i].set(new_ids), logprobs.at[i].set(new_logprobs), kept.at[i].set(new_kept))
        return kv, jnp.where(real, new_ids, 0), outputs

    kv, _, (tokens, logprobs, kept) = jax.lax.fori_loop(
        0, plan.steps, step, (kv_leaves, forward_batch.input_ids, outputs)
    )
    return kv, tokens, logprobs, kept


def install(scheduler, control, steps: int) -> DecodeChunks:
    """Serve ``scheduler``'s decode batches ``steps`` steps per dispatch (scheduler thread or
    before its first batch)."""
    chunks = DecodeChunks(scheduler, control, steps)
    setattr(scheduler, _STATE, chunks)
    control.decode_chunks = chunks
    return chunks


def precompile(scheduler, steps: int) -> None:
    """Compile the chunk's loop for each of the engine's decode batch sizes (running none of
    its steps), as the engine precompiles its one-step forward."""
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

    worker = scheduler.tp_worker.worker
    for bs, cache_loc_size in zip(worker.precompile_bs_paddings, worker.precompile_cache_loc_paddings):
        mwb = worker.generate_model_worker_batch(bs, bs, ForwardMode.DECODE, cache_loc_size)
        plan = (
            0,
            np.full((steps, bs), -1, np.int32),
            np.zeros(cache_loc_size, np.int32),
            np.full(cache_loc_size, np.iinfo(np.int32).max, np.int32),
            np.zeros(bs, np.int32),
        )
        run_chunk(worker, mwb, plan, steps)


def patch_scheduler() -> None:
    """Scheduler methods that take a step from the chunk where it has one (engines without
    ``decode_steps`` run as before)."""
    from sgl_jax.srt.managers.scheduler import Scheduler

    if getattr(Scheduler, "_rollout_decode_chunks", False):
        return
    update_running_batch, run_batch = Scheduler.update_running_batch, Scheduler.run_batch

    def chunked_update_running_batch(self, batch):
        chunks = self.__dict__.get(_STATE)
        if chunks is None or chunks.chunk is None:
            return update_running_batch(self, batch)
        initial_bs = batch.batch_size()
        batch.filter_batch()
        rows = chunks.covering(batch)
        if rows is None:
            return update_running_batch(self, batch)
        # The original's path when the pool has room: the step's slots are the chunk's.
        self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        chunks.prepare_from_chunk(batch, rows)
        return batch

    def chunked_run_batch(self, batch):
        chunks = self.__dict__.get(_STATE)
        if chunks is None:
            return run_batch(self, batch)
        if chunks.prepared:
            chunks.prepared = False
            self.forward_ct += 1
            return chunks.serve(batch)
        chunks.release()
        if chunks.eligible(batch):
            result = chunks.dispatch(batch)
            if result is not None:
                self.forward_ct += 1
                return result
        return run_batch(self, batch)

    Scheduler.update_running_batch = chunked_update_running_batch
    Scheduler.run_batch = chunked_run_batch
    Scheduler._rollout_decode_chunks = True
