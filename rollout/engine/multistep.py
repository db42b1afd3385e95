"""Several decode steps per dispatch: the scheduler's Python off the path between forwards.

With ``EngineOptions.decode_steps = K > 1``, the first decode step of a running batch runs K
steps at once on the device: one compiled loop of forward + sampler (the same model, attention
and sampler the engine's own step runs, with per-request seeds keyed by position), each step's
sampled ids fed to the next. The KV slots of steps 1..K-1 are allocated before the loop, as
0.0.2's ``prepare_for_decode`` would have, step after step. The scheduler then goes on exactly
as it does without chunks, one step per loop iteration (finish checks, stop strings, aborts,
streaming, weight versions, log-prob sinks, boundary calls), except that a step the chunk
already computed takes its ids from the chunk (its KV slots are the chunk's, its forward is
skipped). A chunk is dispatched with the one that continues it, from its last tokens on the
device, before they are fetched; when the scheduler has taken its steps the next one takes
over and the one after that is dispatched at once, from the next one's last tokens: the
device runs each chunk right after the one before it while the scheduler takes that one's
steps, so the host's work overlaps the device's and the device never waits for the host to
fetch one chunk and dispatch the next. Everything the scheduler decides between steps still
lands between steps:

- a request that finished or was aborted leaves the batch as before; the chunk's slots it did
  not reach are freed;
- a boundary call that may change the weights or the running rows' KV (an in-flight swap; a
  session's release keeps them) or a weight swap ends the chunks (the one served and the one
  ahead): their unused slots are freed and the next step dispatches a new one under the
  current weights;
- a request that arrives while the chunks compute the next step of every running row waits
  for them to run out (no chunk is dispatched ahead while it could join, only while the batch
  is full), then joins in one prefill with everything else that arrived: ending the chunks
  would throw away their steps while its prefill still ran after them on the device (the KV
  pool is threaded through every forward), and multi-turn episodes, whose turns arrive while
  other rows decode, lost most of their chunks that way (64 episodes x 4 turns of 64 tokens ran
  x1.7 slower with chunks of 16 than one step at a time);
- the price is device work: steps computed for rows that finished early, or for a chunk ended
  early, are thrown away.

Attention across the chunk: the forward's ``cache_loc`` is laid out for each row's length at
the chunk's last step, and a step sees only the slots its position has reached (later ones are
given as slot 0, the pool's padding slot, which attention masks). Each query's keys are
then those of a one-step forward, in the same chunks of the online softmax. The TPU kernel
("fa") reads the same layout through the metadata each step builds on the device
(:func:`_step_attention_backend`).

Static chunks (``EngineOptions.static_decode_chunks``, by default on GPU): XLA's GPU backend
drives a loop of unknown trip count, and a conditional, from the host, with a copy of its
predicate and a wait at every iteration. There each layer's attention walks a number of KV
chunks fixed at dispatch (``attention.decode_kv_walk`` of the rows' last lengths: one program
per doubling of the context) and the draw is chosen on the host (``patches.draw_kind``), so the
chunk's steps are its only loop of unknown trip count (a filtering draw keeps the filters'
conditionals). Elsewhere one program per batch size walks what the rows need and chooses the
draw on the device.

Eligible batches: decode, not the engine's own log-probs (``return_logprob``; the worker's
sinks are served). No sampler applies 0.0.2's penalties (``patches._sample``). Engines: the
paged native attention (this project's, ``attention.py``) or the TPU kernel, no MoE routing
recording and one LoRA slot; ``handle`` refuses other combinations at start-up.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from .attention import decode_kv_walk, decode_kv_walks
from .programs import engine_compiler_options, forward_cells, jit_with_options, mesh_platform

# A scheduler's attribute holding its DecodeChunks, and the Scheduler class's once it is patched.
_STATE = "_rollout_decode_chunks"
_PATCHED = "_rollout_decode_chunks_patched"
# The KV walk of the decode chunk being traced on this thread (traced_kv_walk).
_trace = threading.local()


@dataclasses.dataclass
class DecodeChunk:
    """The steps one dispatch computes for a batch's rows, served one scheduler step at a time."""

    reqs: list  # the batch's requests at dispatch, in row order
    version: int  # the weight version of the forwards
    slots: np.ndarray  # [steps, rows] KV slot of each step's input token
    first_lens: np.ndarray  # [rows] each row's length at step 0 (its input token included)
    mwb: object  # the ModelWorkerBatch of step 0
    metadata: tuple  # chunk_metadata of its batch
    next_step: int = 0
    # The device's outputs until fetched, then [steps, rows] host arrays.
    pending: tuple | None = None
    tokens: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    kept: np.ndarray | None = None
    misses: int = 0  # compiles its dispatch caused
    # The KV buffers its loop consumed (donated), held until it is fetched: see DecodeChunks._launch.
    consumed: list = dataclasses.field(default_factory=list)
    row_of: dict = dataclasses.field(default_factory=dict)  # id(req) -> row, rows still served

    def __post_init__(self):
        self.row_of = {id(req): row for row, req in enumerate(self.reqs)}

    @property
    def steps(self) -> int:
        return self.slots.shape[0]

    def fetch(self) -> None:
        """Wait for the device and bring the sampled ids, log-probs and counts to the host."""
        if self.pending is not None:
            rows = len(self.reqs)
            fetched = jax.device_get(self.pending)
            self.tokens, self.logprobs, self.kept = (np.asarray(x)[: self.steps, :rows] for x in fetched)
            self.pending = None
            self.consumed = []  # the loop is done: dropping them no longer waits

    def last_ids(self) -> jax.Array:
        """The ids its last step samples, [padded rows] (0 past its rows), on the device (before
        :meth:`fetch`): the chunk continuing from them is dispatched without waiting for this one."""
        return _last_ids(self.pending[0], np.int32(self.steps - 1), np.int32(len(self.reqs)))

    def rows_for(self, reqs: list) -> np.ndarray | None:
        """The chunk's rows of ``reqs`` if it computes the next step for every one of them."""
        if self.next_step >= self.steps or not reqs:
            return None
        rows = list(map(self.row_of.get, map(id, reqs)))  # runs every scheduler step: map keeps the loop in C
        if None in rows:
            return None
        return np.asarray(rows)

    def live_rows(self) -> np.ndarray:
        return np.asarray(sorted(self.row_of.values()), dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class DecodeChunkStats:
    """What an engine's decode chunks did since it started."""

    dispatched: int  # chunks run (one dispatch each)
    steps_served: int  # scheduler steps that took their ids from a chunk
    row_steps_discarded: int  # row-steps computed that no scheduler step took


class DecodeChunks:
    """One engine's chunk being served and the next one, dispatched before the scheduler serves
    the first (scheduler thread only). The next chunk continues from the first one's last
    tokens, so the device computes it while the scheduler takes the first one's steps: the
    host's work overlaps the device's."""

    def __init__(self, scheduler, control, steps: int, static: bool, ended_rows_page: bool = False):
        self.scheduler = scheduler
        self.control = control
        self.steps = steps
        self.static = static  # EngineOptions.static_decode_chunks as resolved for the platform
        # Whether a chunk computed ahead gives each row that ended before a row still served a
        # page of its own (_plan): the paged native attention gives such a row no keys, but the
        # TPU kernel runs every row up to the last one served, and on a row of no keys it never
        # finished (in interpret mode: its copies of zero keys wait for ever).
        self.ended_rows_page = ended_rows_page
        self.chunk: DecodeChunk | None = None
        self.ahead: DecodeChunk | None = None
        # The rows of the chunk's next step once the scheduler's batch was prepared for it.
        self.prepared_rows: np.ndarray | None = None
        self.dispatched = 0
        self.steps_served = 0
        self.steps_discarded = 0
        # Compiles of chunks ended before any step reported them: the next result reports them.
        self.unreported_misses = 0

    def stats(self) -> DecodeChunkStats:
        return DecodeChunkStats(self.dispatched, self.steps_served, self.steps_discarded)

    # ---- the scheduler's step ----------------------------------------------------------------

    def _next_step_chunk(self, reqs: list) -> tuple[DecodeChunk, np.ndarray] | None:
        """The chunk that computes the next step of every one of ``reqs`` under the current
        weights (the one served or, once its steps are served, the one ahead), and their rows."""
        chunk = self.chunk
        if chunk is None or chunk.version != self.control.weight_version:
            return None
        rows = chunk.rows_for(reqs)
        if rows is None and chunk.next_step >= chunk.steps and self.ahead is not None:
            chunk, rows = self.ahead, self.ahead.rows_for(reqs)
        return None if rows is None else (chunk, rows)

    def covering(self, batch) -> np.ndarray | None:
        """The rows of ``batch``'s next step if a chunk computes it; otherwise the chunks end."""
        if self.chunk is None:
            return None
        found = self._next_step_chunk(batch.reqs)
        if found is None:
            self.release()
            return None
        chunk, rows = found
        if chunk is self.ahead:  # the next chunk takes over, and the one after it starts
            self.chunk, self.ahead = self.ahead, None
            self._free_left_rows(self.chunk, rows)
            # Queued behind the chunk before waiting for it: the device never idles between them.
            self._dispatch_ahead(batch)
            self.chunk.fetch()
        return rows

    def holds_admission(self, batch) -> bool:
        """Whether a waiting request should wait for the chunks to run out rather than join
        ``batch`` at its next step: they compute that step for every request of it still
        running, under the current weights. Its admission would end them, throwing away what
        the device computed, and its prefill would still run after them (the pool is threaded
        through every forward): it joins at most the chunks' unserved steps later, with
        everything that arrived meanwhile, in one prefill."""
        return self._next_step_chunk([req for req in batch.reqs if not req.finished()]) is not None

    def prepare_from_chunk(self, batch, rows: np.ndarray) -> None:
        """``batch.prepare_for_decode()`` with the chunk's KV slots for its next step."""
        chunk = self.chunk
        for each in (chunk, self.ahead):
            if each is not None:
                self._free_left_rows(each, rows)
        step_slots = chunk.slots[chunk.next_step, rows]
        page_size = self.scheduler.token_to_kv_pool_allocator.page_size
        name = "alloc_token_slots" if page_size == 1 else "alloc_paged_token_slots_decode"
        setattr(batch, name, lambda *args, **kwargs: step_slots.copy())
        try:
            batch.prepare_for_decode()
        finally:
            delattr(batch, name)
        self.prepared_rows = rows

    def serve(self, batch):
        """The next step of the chunk as the scheduler's ``run_batch`` result (``batch`` was
        prepared by :meth:`prepare_from_chunk`)."""
        rows, self.prepared_rows = self.prepared_rows, None
        chunk = self.chunk
        step, chunk.next_step = chunk.next_step, chunk.next_step + 1
        return self._result(batch, chunk, step, rows)

    def release(self) -> None:
        """End both chunks: free the KV slots of the steps they compute that no step took. (A
        chunk still running on the device writes those slots before any later forward runs:
        the later forward reads the KV buffers it outputs.)"""
        chunks = (self.chunk, self.ahead)
        self.chunk = self.ahead = None
        self.prepared_rows = None
        for chunk in chunks:
            if chunk is None:
                continue
            self.unreported_misses += chunk.misses
            if chunk.next_step < chunk.steps:
                self._free(chunk.slots[chunk.next_step :, chunk.live_rows()])

    def _free_left_rows(self, chunk: DecodeChunk, rows: np.ndarray) -> None:
        """Free the chunk's slots of its live rows not in ``rows`` (a subset of them)."""
        if len(rows) == len(chunk.row_of):  # every step but those where rows leave: none left
            return
        left = np.setdiff1d(chunk.live_rows(), rows)
        if len(left):
            self._free(chunk.slots[chunk.next_step :, left])
            # Never freed twice: those rows are no longer the chunk's.
            for row in left:
                chunk.row_of.pop(id(chunk.reqs[row]), None)

    def _free(self, slots: np.ndarray) -> None:
        """Free KV slots a chunk allocated and no step took (-1: a row it computes for nobody)."""
        slots = slots.ravel()
        slots = slots[slots >= 0]
        self.steps_discarded += slots.size
        page_size = self.scheduler.token_to_kv_pool_allocator.page_size
        # A page belongs to the chunk if its first slot does (later slots of a page the engine
        # already held go with it).
        slots = slots[slots % page_size == 0]
        if slots.size:
            self.scheduler.token_to_kv_pool_allocator.free(slots)

    def _result(self, batch, chunk: DecodeChunk, step: int, rows: np.ndarray):
        from sgl_jax.srt.managers.scheduler import GenerationBatchResult

        from .patches import deliver_token_logprobs

        self.steps_served += 1
        ids = chunk.tokens[step, rows]
        batch.output_ids = ids
        deliver_token_logprobs(self.scheduler, chunk.logprobs[step, rows], chunk.kept[step, rows])
        # Reported once, by the step that waited for it.
        misses, chunk.misses, self.unreported_misses = chunk.misses + self.unreported_misses, 0, 0
        return GenerationBatchResult(
            logits_output=None,
            next_token_ids=ids.tolist(),
            extend_input_len_per_req=None,
            extend_logprob_start_len_per_req=None,
            bid=chunk.mwb.bid,
            cache_miss_count=misses,
        )

    # ---- dispatch ----------------------------------------------------------------------------

    def eligible(self, batch) -> bool:
        return batch.forward_mode.is_decode() and not batch.return_logprob

    def dispatch(self, batch):
        """Run up to ``steps`` decode steps of ``batch`` (prepared for its first) in one call and
        start the next chunk; returns the first step's result, or None where a chunk would be
        one step."""
        first_lens = np.asarray(batch.seq_lens, np.int64)
        steps = self._steps_for(batch.reqs, first_lens, 0)
        if steps <= 1:
            return None
        scheduler = self.scheduler
        mwb = batch.get_model_worker_batch(*scheduler.tp_worker.get_precompile_paddings(), scheduler.page_size)
        rows = np.arange(len(batch.reqs))
        chunk = self._launch(batch, mwb, list(batch.reqs), rows, first_lens, batch.out_cache_loc, None, steps)
        if chunk is None:
            return None
        self.chunk = chunk
        self._dispatch_ahead(batch)
        chunk.fetch()
        chunk.next_step = 1
        return self._result(batch, chunk, 0, rows)

    def _dispatch_ahead(self, batch) -> None:
        """Start the chunk that continues the current one from its last tokens, on the device
        (call it before fetching the current one), for the rows it still serves (the others are
        computed as padding, with no KV slot)."""
        chunk = self.chunk
        live, done = chunk.live_rows(), chunk.steps
        if not len(live) or self._admission_possible(batch):
            return
        first_lens = chunk.first_lens + done
        steps = self._steps_for([chunk.reqs[row] for row in live], first_lens[live], done - chunk.next_step)
        if steps < 1:
            return
        rows, padded = len(chunk.reqs), len(chunk.mwb.seq_lens)
        positions = np.zeros(padded, chunk.mwb.positions.dtype)
        positions[:rows] = chunk.mwb.positions[:rows] + done
        mwb = dataclasses.replace(chunk.mwb, positions=positions)
        ahead = self._launch(
            batch, mwb, chunk.reqs, live, first_lens, None, chunk.slots[-1], steps, chunk.metadata, chunk.last_ids()
        )
        if ahead is not None:
            ahead.row_of = {id(chunk.reqs[row]): row for row in live}
        self.ahead = ahead

    def _admission_possible(self, batch) -> bool:
        """Whether a waiting request may join the batch once the chunks run out: then no chunk
        is dispatched ahead, which would hold it K steps more (:meth:`holds_admission`). (Not
        while the batch is full, by rows or by the pool: requests wait for its rows to finish.)"""
        scheduler = self.scheduler
        return bool(scheduler.waiting_queue) and not (
            batch.batch_is_full or len(batch.reqs) >= scheduler.max_running_requests
        )

    def _launch(
        self, batch, mwb, reqs, live, first_lens, step0_slots, last_slots, steps, metadata=None, first_ids=None
    ):
        """Allocate the chunk's KV slots and start its loop on the device (not waiting), from
        ``first_ids`` (device ids; None: ``mwb``'s)."""
        slots = self._allocate(batch, reqs, live, first_lens, step0_slots, last_slots, steps)
        if slots is None:
            return None
        scheduler = self.scheduler
        table = scheduler.req_to_token_pool.req_to_token
        plan = _plan(mwb, reqs, live, first_lens, slots, table, scheduler.page_size, self.ended_rows_page)
        if plan is None:
            self._free(slots if step0_slots is None else slots[1:])
            return None
        worker = scheduler.tp_worker.worker
        metadata = chunk_metadata(worker, mwb, self.static) if metadata is None else metadata
        kv_walk = None
        if self.static:
            kv_walk = decode_kv_walk(int(plan.seq_lens.max()), _widest_row(scheduler))
        # The pool's buffers before the loop, which it consumes: at jax 0.8 the thread that drops
        # the last reference to an array donated to a computation still running waits for that
        # computation (and the one producing the array) to finish. Dropped here, as the pool takes
        # the loop's outputs, the chunk dispatched ahead waited for the chunk being served and
        # then for itself: the host's work between chunks no longer overlapped the device's
        # (step_cost_bench at jax 0.8: 1.67 ms a step, of which 0.33 the host's).
        consumed = list(worker.model_runner.token_to_kv_pool.kv_buffer)
        pending, misses = run_chunk(worker, mwb, metadata, plan, self.steps, kv_walk, first_ids)
        self.dispatched += 1
        return DecodeChunk(
            reqs,
            self.control.weight_version,
            slots,
            first_lens,
            mwb,
            metadata,
            pending=pending,
            misses=misses,
            consumed=consumed,
        )

    def _steps_for(self, reqs, first_lens: np.ndarray, served_ahead: int) -> int:
        """No step past the longest request's remaining tokens (less the ``served_ahead`` a
        chunk not yet served will give it) or past any row's context."""
        remaining = max(req.sampling_params.max_new_tokens - len(req.output_ids) for req in reqs) - served_ahead
        width = self.scheduler.req_to_token_pool.req_to_token.shape[1]
        room = width - int(np.max(first_lens)) + 1
        return min(self.steps, remaining, room)

    def _allocate(self, batch, reqs, live, first_lens, step0_slots, last_slots, steps) -> np.ndarray | None:
        """[steps, rows] KV slots of the ``live`` rows (-1 for the others), each step's allocated
        as the engine's own decode allocates it, as far as the pool allows: step 0's given
        (prepare_for_decode's), or continuing from ``last_slots``. Written to the rows' token
        tables. None where that leaves no step to compute (no step past a given step 0)."""
        allocator = self.scheduler.token_to_kv_pool_allocator
        page_size = allocator.page_size
        slots = [] if step0_slots is None else [np.asarray(step0_slots, np.int32)]
        last = slots[0] if last_slots is None else last_slots
        # Room for every step at once: once the prefix cache fills the pool, each eviction
        # walks the whole radix tree (0.0.2's evict collects every leaf), and one per step was
        # a ninth of the scheduler's time in a chunked decode. A row's steps take at most
        # their count rounded up to pages; 0.0.2 evicts what is asked whatever is free, so a
        # chunk may evict up to that much early. Each step still checks.
        batch._evict_tree_cache_if_needed(len(live) * (steps - len(slots) + page_size - 1))
        for step in range(len(slots), steps):
            batch._evict_tree_cache_if_needed(len(live) * page_size)
            if page_size == 1:
                locs = allocator.alloc(len(live))
            else:
                locs = allocator.alloc_decode((first_lens[live] + step).tolist(), last[live].tolist())
            if locs is None:
                break
            row = np.full(len(reqs), -1, np.int32)
            row[live] = locs
            slots.append(row)
            last = row
        if len(slots) <= (step0_slots is not None):
            return None
        slots = np.stack(slots)
        table_rows = np.asarray([reqs[row].req_pool_idx for row in live])
        positions = first_lens[live][None, :] - 1 + np.arange(slots.shape[0])[:, None]
        req_to_token = self.scheduler.req_to_token_pool.req_to_token
        req_to_token[np.broadcast_to(table_rows, positions.shape), positions] = slots[:, live]
        return slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChunkPlan:
    """The arrays that vary across a chunk's steps (``_plan``'s on the host, then the device's)."""

    steps: jax.Array  # () steps to run
    out_cache_loc: jax.Array  # [max_steps, padded rows] KV slot written at each step (-1: none)
    cache_loc: jax.Array  # [L] each row's slots at the chunk's last step
    visible_from: jax.Array  # [L] the step from which each cache_loc entry is visible
    seq_lens: jax.Array  # [padded rows] each row's length at the last step (0: padding)
    kv_spans: jax.Array  # [padded rows] the entries of cache_loc each row spans, in order


def _plan(
    mwb, reqs, live, first_lens, slots: np.ndarray, req_to_token: np.ndarray, page_size: int, ended_rows_page=False
):
    """The chunk's :class:`ChunkPlan` in host arrays, or None where its rows' last lengths do
    not fit the forward's ``cache_loc``. Each row spans its last length rounded up to pages.
    Rows not ``live`` (left the batch before a chunk computed ahead) are padding: no keys, no KV
    slot; with ``ended_rows_page`` those before the last live row span one page of padding slots
    (the allocator never hands out page 0), which the TPU kernel reads as one key
    (:func:`_step_attention_backend`)."""
    steps, rows = slots.shape
    padded_rows = len(mwb.seq_lens)
    last = np.zeros(rows, np.int64)
    last[live] = first_lens[live] + steps - 1
    spans = (last + page_size - 1) // page_size * page_size
    if ended_rows_page and len(live):
        spans[: live[-1]] = np.maximum(spans[: live[-1]], page_size)
    size = len(mwb.cache_loc)
    used_size = int(spans.sum())
    if used_size > size:
        return None
    starts = np.cumsum(spans) - spans
    owner = np.repeat(np.arange(rows), spans)
    col = np.arange(used_size) - starts[owner]
    used = col < last[owner]
    table_rows = np.asarray([req.req_pool_idx for req in reqs])[owner]
    cache_loc = np.zeros(size, np.int32)
    cache_loc[:used_size] = np.where(used, req_to_token[table_rows, np.minimum(col, req_to_token.shape[1] - 1)], 0)
    # Entry ``col`` of a row is its token at position col, reached at step col - (first - 1).
    visible_from = np.full(size, np.iinfo(np.int32).max, np.int32)
    visible_from[:used_size] = np.where(used, np.maximum(col - first_lens[owner] + 1, 0), visible_from[:used_size])
    out_cache_loc = np.full((steps, padded_rows), -1, np.int32)
    out_cache_loc[:, :rows] = slots
    seq_lens = np.zeros(padded_rows, np.int32)
    seq_lens[:rows] = last
    kv_spans = np.zeros(padded_rows, np.int32)
    kv_spans[:rows] = spans
    return ChunkPlan(np.int32(steps), out_cache_loc, cache_loc, visible_from, seq_lens, kv_spans)


def chunk_metadata(worker, mwb, static: bool) -> tuple:
    """The logits and sampling metadata of a decode batch's chunks, on the device, and for
    ``static`` chunks the draw its sampling parameters need (``patches.draw_kind``, a static
    argument of the chunk's program as of the engine's one-step sampler; None: chosen on the
    device, two conditionals a step): built once for a batch (its sampling info is filtered in
    place as rows leave; the metadata is not)."""
    from sgl_jax.srt.layers.logits_processor import LogitsMetadata
    from sgl_jax.srt.sampling.sampling_batch_info import SamplingMetadata

    from .patches import draw_kind

    runner = worker.model_runner
    sampling = SamplingMetadata.from_model_worker_batch(mwb, len(mwb.seq_lens) - mwb.real_bs, runner.mesh)
    return (
        LogitsMetadata.from_model_worker_batch(mwb, runner.mesh),
        sampling,
        draw_kind(sampling, runner.model_config.vocab_size) if static else None,
    )


def run_chunk(worker, mwb, metadata: tuple, plan, max_steps: int, kv_walk: int | None, first_ids=None):
    """Start ``plan``'s steps of ``mwb``'s decode batch on the device, from ``first_ids`` (the
    input ids, on the device or not; None: ``mwb``'s), each layer's attention
    walking ``kv_walk`` KV chunks (enough for the plan's ``seq_lens``; None: what the rows
    need, counted on the device): (the sampled ids,
    log-probs and kept counts [max_steps, padded rows] as device arrays, the compiles it
    caused). The engine's KV buffers become the loop's outputs at once."""
    import jax._src.test_util as jtu
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch

    runner = worker.model_runner
    padded_out = np.full((max_steps, plan.out_cache_loc.shape[1]), -1, np.int32)
    padded_out[: plan.out_cache_loc.shape[0]] = plan.out_cache_loc
    replicated = jax.sharding.NamedSharding(runner.mesh, jax.sharding.PartitionSpec())
    chunk_plan = jax.device_put(
        dataclasses.replace(plan, out_cache_loc=padded_out), replicated if jax.process_count() == 1 else None
    )
    forward_batch = ForwardBatch.init_new(mwb, runner)
    if _is_the_tpu_kernel(runner.attn_backend):
        from sgl_jax.srt.layers.attention.flashattention_backend import FlashAttentionMetadata

        # Each step builds its own: the metadata of the engine's last forward would be an input
        # of the program, whose shapes (another batch's) would compile it again.
        forward_batch.attn_backend = _with_metadata(forward_batch.attn_backend, FlashAttentionMetadata())
    if first_ids is not None:
        forward_batch.input_ids = jax.device_put(first_ids, forward_batch.input_ids.sharding)
    logits_metadata, sampling_metadata, draw = metadata
    cells = forward_cells(runner)
    sampler_def, sampler_state_def, sampler_leaves = runner.jitted_sampler.args
    with jtu.count_pjit_cpp_cache_miss() as count, jax.set_mesh(runner.mesh):
        kv, tokens, logprobs, kept = chunk_program(mesh_platform(runner.mesh))(
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
            kv_walk=kv_walk,
            draw=draw,
        )
        misses = count()
    runner._set_kv_cache_after_forward(kv, forward_batch)
    return (tokens, logprobs, kept), misses


@jax.jit
def _last_ids(tokens: jax.Array, step: jax.Array, rows: jax.Array) -> jax.Array:
    """``tokens[step]``, 0 past ``rows`` (traced: one program per padded width)."""
    return jnp.where(jnp.arange(tokens.shape[1]) < rows, tokens[step], 0)


def chunk_program(platform: str):
    """The jitted decode chunk under the engine's XLA compile options on ``platform``
    (programs.engine_compiler_options)."""
    return _chunk_program(tuple(sorted(engine_compiler_options(platform).items())))


@functools.cache
def _chunk_program(options: tuple):  # the options as a hashable tuple: one program per set
    return jit_with_options(
        _decode_chunk,
        dict(options),
        static_argnames=("model_state_def", "sampler_state_def", "max_steps", "kv_walk", "draw"),
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
    kv_walk: int | None,
    draw: str | None,
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
        batch.attn_backend = _step_attention_backend(forward_batch.attn_backend, plan, i)
        model = nnx.merge(model_def, jax.tree_util.tree_unflatten(model_state_def, model_leaves))
        with _tracing_kv_walk(kv_walk):
            logits_output, layers_kv, _ = model(batch, jax.tree_util.tree_unflatten(kv_def, kv), logits_metadata)
        sampler = nnx.merge(sampler_def, jax.tree_util.tree_unflatten(sampler_state_def, sampler_leaves))
        new_ids, new_logprobs, new_kept = sampler(logits_output, sampling_metadata, positions, draw)
        new_ids = new_ids.astype(jnp.int32)
        kv = [jax.lax.with_sharding_constraint(layer, kv_pool.kv_sharding) for layer in layers_kv]
        outputs = (tokens.at[i].set(new_ids), logprobs.at[i].set(new_logprobs), kept.at[i].set(new_kept))
        return kv, jnp.where(real, new_ids, 0), outputs

    kv, _, (tokens, logprobs, kept) = jax.lax.fori_loop(
        0, plan.steps, step, (kv_leaves, forward_batch.input_ids, outputs)
    )
    return kv, tokens, logprobs, kept


def _step_attention_backend(backend, plan: ChunkPlan, step):
    """The attention backend of a chunk's ``step``: the paged native attention reads the step's
    batch (its ``cache_loc`` and lengths); the TPU kernel ("fa") reads metadata that 0.0.2 builds
    on the host for each forward (``FlashAttention.get_forward_metadata``), built here on the
    device as that would for the step. Each row's pages are laid out for its length at the
    chunk's last step (the plan's ``cache_loc``), and the kernel reads the first ``kv_lens[b]``
    keys of row b's pages and writes the step's K and V at position ``kv_lens[b] - 1`` there,
    so only the lengths move from step to step. The kernel runs every row up to the last one
    served, so a row no longer served (length 0) before it reads one key, on the page of padding
    slots the plan gives it (``_plan``'s ``ended_rows_page``: its span), and writes its K and V
    there."""
    from sgl_jax.srt.layers.attention.flashattention_backend import FlashAttentionMetadata

    if not _is_the_tpu_kernel(backend):
        return backend
    page_size = backend.page_size
    rows = plan.seq_lens.shape[0]
    live, spanned = plan.seq_lens > 0, plan.kv_spans > 0
    # The kernel runs the first distribution[2] rows: up to the last one spanned, the last served.
    served = jnp.max(jnp.where(spanned, jnp.arange(1, rows + 1, dtype=jnp.int32), 0))
    lens = jnp.where(live, plan.seq_lens - (plan.steps - 1 - step), spanned.astype(jnp.int32)).astype(jnp.int32)
    start = jnp.zeros(1, jnp.int32)
    metadata = FlashAttentionMetadata(
        num_seqs=served.reshape(1),
        cu_q_lens=jnp.arange(rows + 1, dtype=jnp.int32),
        cu_kv_lens=jnp.concatenate([start, jnp.cumsum(plan.kv_spans).astype(jnp.int32)]),
        page_indices=(plan.cache_loc[::page_size] // page_size).astype(jnp.int32),
        seq_lens=lens,
        distribution=jnp.stack([jnp.int32(0), jnp.int32(0), served]),
    )
    return _with_metadata(backend, metadata)


def _with_metadata(backend, metadata):
    """A TPU-kernel backend carrying ``metadata`` (its own pytree unflatten, as jit builds one)."""
    _, aux = backend.tree_flatten()
    return type(backend).tree_unflatten(aux, (metadata,))


@contextlib.contextmanager
def _tracing_kv_walk(kv_walk: int | None):
    previous = getattr(_trace, "kv_walk", None)
    _trace.kv_walk = kv_walk
    try:
        yield
    finally:
        _trace.kv_walk = previous


def traced_kv_walk() -> int | None:
    """The static KV walk of the decode chunk whose forward this thread is tracing (the
    attention's ``kv_walk``), or None (outside one, or in a chunk that is not static)."""
    return getattr(_trace, "kv_walk", None)


def _is_the_tpu_kernel(backend) -> bool:
    from sgl_jax.srt.layers.attention.flashattention_backend import FlashAttention

    return isinstance(backend, FlashAttention)


def _widest_row(scheduler) -> int:
    """The most keys a row can have: its token table's width (the context length and a few), or
    the KV pool's slots if fewer."""
    return min(scheduler.req_to_token_pool.req_to_token.shape[1], scheduler.token_to_kv_pool_allocator.size)


def install(scheduler, control, steps: int, static: bool) -> DecodeChunks:
    """Serve ``scheduler``'s decode batches ``steps`` steps per dispatch, in static chunks if
    ``static`` (scheduler thread or before its first batch)."""
    chunks = DecodeChunks(
        scheduler,
        control,
        steps,
        static,
        ended_rows_page=_is_the_tpu_kernel(scheduler.tp_worker.worker.model_runner.attn_backend),
    )
    setattr(scheduler, _STATE, chunks)
    control.decode_chunks = chunks
    return chunks


def precompile(scheduler, steps: int, static: bool) -> None:
    """Compile the chunk's loop for each of the engine's decode batch sizes (static chunks: and
    each draw and KV walk), running none of its steps, as the engine precompiles its one-step
    forward, and the pick of a chunk's last ids that the chunk ahead starts from."""
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

    from .patches import DRAW_KINDS

    worker = scheduler.tp_worker.worker
    walks = decode_kv_walks(_widest_row(scheduler)) if static else [None]
    draws = DRAW_KINDS if static else [None]
    for bs, cache_loc_size in zip(worker.precompile_bs_paddings, worker.precompile_cache_loc_paddings):
        mwb = worker.generate_model_worker_batch(bs, bs, ForwardMode.DECODE, cache_loc_size)
        plan = ChunkPlan(
            np.int32(0),
            np.full((steps, bs), -1, np.int32),
            np.zeros(cache_loc_size, np.int32),
            np.full(cache_loc_size, np.iinfo(np.int32).max, np.int32),
            np.zeros(bs, np.int32),
            np.zeros(bs, np.int32),
        )
        logits_metadata, sampling_metadata, _ = chunk_metadata(worker, mwb, static)
        for draw in draws:
            for kv_walk in walks:
                metadata = (logits_metadata, sampling_metadata, draw)
                tokens = jax.block_until_ready(run_chunk(worker, mwb, metadata, plan, steps, kv_walk)[0])[0]
        jax.block_until_ready(_last_ids(tokens, np.int32(0), np.int32(bs)))  # a chunk ahead's input ids


def patch_scheduler() -> None:
    """Scheduler methods that take a step from the chunk where it has one (engines without
    ``decode_steps`` run as before)."""
    from sgl_jax.srt.managers.scheduler import Scheduler

    if getattr(Scheduler, _PATCHED, False):
        return
    update_running_batch, run_batch = Scheduler.update_running_batch, Scheduler.run_batch
    get_new_batch_prefill = Scheduler.get_new_batch_prefill

    def chunked_get_new_batch_prefill(self):
        chunks = self.__dict__.get(_STATE)
        # A chunked prefill in progress goes on: no chunk was dispatched since it began. (Asked
        # only with requests waiting: it runs every scheduler step.)
        if (
            chunks is not None
            and self.waiting_queue
            and self.chunked_req is None
            and chunks.holds_admission(self.running_batch)
        ):
            return None
        return get_new_batch_prefill(self)

    def chunked_update_running_batch(self, batch):
        chunks = self.__dict__.get(_STATE)
        if chunks is None or chunks.chunk is None:
            return update_running_batch(self, batch)
        initial_bs = batch.batch_size()
        batch.filter_batch()
        # As the original does for the rows it filters (it sees none left to filter here).
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        rows = chunks.covering(batch)
        if rows is None:
            return update_running_batch(self, batch)
        # The original's path when the pool has room: the step's slots are the chunk's.
        self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        chunks.prepare_from_chunk(batch, rows)
        return batch

    def chunked_run_batch(self, batch):
        chunks = self.__dict__.get(_STATE)
        if chunks is None:
            return run_batch(self, batch)
        if chunks.prepared_rows is not None:
            self.forward_ct += 1
            return chunks.serve(batch)
        chunks.release()
        if chunks.eligible(batch):
            result = chunks.dispatch(batch)
            if result is not None:
                self.forward_ct += 1
                return result
        return run_batch(self, batch)

    Scheduler.get_new_batch_prefill = chunked_get_new_batch_prefill
    Scheduler.update_running_batch = chunked_update_running_batch
    Scheduler.run_batch = chunked_run_batch
    setattr(Scheduler, _PATCHED, True)
