"""rollout/engine/multistep.py: a chunk's view of the KV at each of its steps is a one-step
forward's (no engine: the plan's arrays and the paged attention on them)."""

import concurrent.futures
import types

import numpy as np
import pytest

from rollout.engine.multistep import DecodeChunks, _plan
from rollout.engine.runtime import SchedulerControl
from tests.helpers import HEAD_DIM, HEADS, KV_HEADS, attend


@pytest.mark.parametrize("page_size", [1, 4])
def test_each_step_sees_exactly_the_keys_of_a_one_step_forward(page_size):
    rng = np.random.default_rng(0)
    first_lens = np.array([3, 9, 6])  # each row's length at the chunk's step 0
    steps, rows, padded_rows, loc_len, width = 5, 3, 4, 64, 20
    pool = rng.standard_normal((128, 2 * KV_HEADS, HEAD_DIM)).astype(np.float32)
    table = np.zeros((rows, width), np.int32)  # req_to_token: each row's slot of each position
    table[:, : first_lens.max() + steps] = rng.permutation(np.arange(1, 128))[
        : rows * (first_lens.max() + steps)
    ].reshape(rows, -1)
    reqs = [types.SimpleNamespace(req_pool_idx=row) for row in range(rows)]
    slots = np.stack([table[np.arange(rows), first_lens - 1 + i] for i in range(steps)])
    mwb = types.SimpleNamespace(seq_lens=np.zeros(padded_rows), cache_loc=np.zeros(loc_len))
    plan = _plan(mwb, reqs, np.arange(rows), first_lens, slots, table, page_size)
    assert plan.steps == steps and plan.out_cache_loc.shape == (steps, padded_rows)
    assert (plan.out_cache_loc[:, rows:] == -1).all()
    np.testing.assert_array_equal(plan.out_cache_loc[:, :rows], slots)
    np.testing.assert_array_equal(plan.kv_spans, np.append(-(-(first_lens + steps - 1) // page_size) * page_size, 0))
    q = rng.standard_normal((padded_rows, HEADS, HEAD_DIM)).astype(np.float32)
    for step in range(steps):
        lens = first_lens + step
        # The scheduler's own layout at this step: each row's slots, spans rounded to pages.
        one_step = np.zeros(loc_len, np.int32)
        offset = 0
        for row, length in enumerate(lens):
            one_step[offset : offset + length] = table[row, :length]
            offset += -(-length // page_size) * page_size
        expected = attend(q, pool, one_step, np.append(lens, 0), page_size=page_size, scale=0.3)
        chunked = np.where(plan.visible_from <= step, plan.cache_loc, 0)
        got = attend(q, pool, chunked, plan.seq_lens, page_size=page_size, scale=0.3)
        np.testing.assert_array_equal(got, expected)


def test_a_chunk_that_outgrows_the_forwards_cache_loc_is_not_planned():
    table = np.arange(1, 41, dtype=np.int32).reshape(2, 20)
    reqs = [types.SimpleNamespace(req_pool_idx=row) for row in range(2)]
    mwb = types.SimpleNamespace(seq_lens=np.zeros(2), cache_loc=np.zeros(16))
    slots = np.stack([table[:, 7 + i] for i in range(4)])  # rows of 8 tokens at step 0: 11 at the last
    assert _plan(mwb, reqs, np.arange(2), np.array([8, 8]), slots, table, 1) is None
    # Without the row that left the batch, the other fits.
    assert _plan(mwb, reqs, np.array([1]), np.array([8, 8]), slots, table, 1) is not None


def test_a_row_that_left_is_padding_in_a_chunk_computed_ahead():
    table = np.arange(1, 61, dtype=np.int32).reshape(3, 20)
    reqs = [types.SimpleNamespace(req_pool_idx=row) for row in range(3)]
    mwb = types.SimpleNamespace(seq_lens=np.zeros(4), cache_loc=np.zeros(64))
    slots = np.stack([table[:, 4 + i] for i in range(3)])
    slots[:, 1] = -1  # row 1 finished: the chunk allocated it nothing
    plan = _plan(mwb, reqs, np.array([0, 2]), np.array([5, 5, 5]), slots, table, 1)
    assert plan.seq_lens.tolist() == [7, 0, 7, 0] and (plan.out_cache_loc[:, 1] == -1).all()
    # Rows 0 and 2 back to back, row 1's slots nowhere.
    assert plan.kv_spans.tolist() == [7, 0, 7, 0]
    np.testing.assert_array_equal(plan.cache_loc[:14], np.concatenate([table[0, :7], table[2, :7]]))
    assert not np.isin(table[1], plan.cache_loc).any()
    # For the TPU kernel, row 1 spans one page of padding slots (page size 1: slot 0) between them.
    padded = _plan(mwb, reqs, np.array([0, 2]), np.array([5, 5, 5]), slots, table, 1, ended_rows_page=True)
    assert padded.kv_spans.tolist() == [7, 1, 7, 0]
    np.testing.assert_array_equal(padded.cache_loc[:15], np.concatenate([table[0, :7], [0], table[2, :7]]))
    assert padded.seq_lens.tolist() == plan.seq_lens.tolist()


def test_only_boundary_calls_that_may_change_weights_or_kv_end_the_chunks():
    control = SchedulerControl("test")
    released = []
    control.decode_chunks = types.SimpleNamespace(release=lambda: released.append(True))
    calls = [(lambda: "session released", True), (lambda: "weights swapped", False)]
    for fn, keeps in calls:
        future = concurrent.futures.Future()
        control.queue_at_boundary(fn, None, future, keeps_decode_chunks=keeps)
        control.run_boundary_calls()
        assert future.result() == fn()
        assert released == ([] if keeps else [True])


class _Pool:
    """A page-size-1 KV allocator of ``free`` slots (0.0.2's interface)."""

    page_size = 1

    def __init__(self, free: int):
        self.next_slot, self.free = 1, free

    def available_size(self):
        return self.free

    def alloc(self, n):
        if n > self.free:
            return None
        self.free -= n
        self.next_slot += n
        return np.arange(self.next_slot - n, self.next_slot)


def test_a_chunk_evicts_the_prefix_cache_once_for_all_its_steps():
    """Once the prefix cache fills the pool every allocation must evict, and each of 0.0.2's
    evictions walks the whole radix tree: a chunk makes room for all its steps at once."""
    rows, steps = 16, 8
    pool = _Pool(free=0)  # full of the prefix cache: every step's allocation must evict
    evictions = []

    def evict_if_needed(tokens):  # ScheduleBatch._evict_tree_cache_if_needed, over a large cache
        if pool.available_size() < tokens:
            evictions.append(tokens)
            pool.free += tokens

    scheduler = types.SimpleNamespace(
        token_to_kv_pool_allocator=pool,
        req_to_token_pool=types.SimpleNamespace(req_to_token=np.zeros((rows, 64), np.int32)),
    )
    chunks = DecodeChunks(scheduler, SchedulerControl("test"), steps, static=False)
    reqs = [types.SimpleNamespace(req_pool_idx=row) for row in range(rows)]
    batch = types.SimpleNamespace(_evict_tree_cache_if_needed=evict_if_needed)
    step0 = np.arange(1000, 1000 + rows)  # prepare_for_decode's
    slots = chunks._allocate(batch, reqs, np.arange(rows), np.full(rows, 5), step0, None, steps)
    assert slots.shape == (steps, rows) and len(np.unique(slots)) == steps * rows
    assert evictions == [rows * (steps - 1)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("live", [[0, 1, 2], [0, 1], [0, 2]], ids=["all-rows", "last-row-ended", "middle-row-ended"])
def test_each_step_gives_the_tpu_kernel_the_pages_and_lengths_of_a_one_step_forward(page_size, live):
    """The "fa" backend's metadata a chunk builds on the device for each step: the lengths,
    query offsets and rows run that 0.0.2's host code builds for the same step's one-step
    forward, and each row's first pages the same pages (the layout differs: a chunk's rows are
    laid out for their lengths at its last step). A row that ended before a live one (a chunk
    computed ahead) is run too, as the kernel runs every row up to the last one served: on one
    key of page 0, the padding page (on none, the kernel never finished)."""
    import jax
    import jax.numpy as jnp
    from sgl_jax.srt.layers.attention.flashattention_backend import FlashAttention
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

    from rollout.engine.multistep import _step_attention_backend

    rng = np.random.default_rng(page_size)
    first_lens = np.array([3, 9, 6])
    steps, rows, padded_rows, loc_len, width = 5, 3, 4, 96, 24
    pages = rng.permutation(np.arange(1, 128))[: rows * width].reshape(rows, width)  # page 0: padding
    positions = np.arange(width)
    table = (pages[:, positions // page_size] * page_size + positions % page_size).astype(np.int32)
    reqs = [types.SimpleNamespace(req_pool_idx=row) for row in range(rows)]
    slots = np.stack([table[np.arange(rows), first_lens - 1 + i] for i in range(steps)])
    mwb = types.SimpleNamespace(seq_lens=np.zeros(padded_rows), cache_loc=np.zeros(loc_len))
    plan = jax.tree.map(
        jnp.asarray, _plan(mwb, reqs, np.asarray(live), first_lens, slots, table, page_size, ended_rows_page=True)
    )
    ended = [row for row in range(max(live)) if row not in live]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tensor",))
    backend = FlashAttention(2, 1, 8, page_size=page_size, mesh=mesh)
    for step in range(steps):
        got = jax.tree.map(np.asarray, _step_attention_backend(backend, plan, step).forward_metadata)
        lens = np.zeros(padded_rows, np.int32)
        lens[live] = first_lens[live] + step
        aligned = -(-lens // page_size) * page_size
        one_step = types.SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            seq_lens=lens,
            cache_loc=np.concatenate([table[row, : aligned[row]] for row in range(rows)] + [np.zeros(8, np.int32)]),
        )
        want = jax.tree.map(np.asarray, backend.get_forward_metadata(one_step))
        np.testing.assert_array_equal(got.cu_q_lens, want.cu_q_lens)
        run = max(live) + 1
        assert got.num_seqs.tolist() == [run] and got.distribution.tolist() == [0, 0, run], f"step {step}"
        if not ended:
            for name in ("num_seqs", "seq_lens", "distribution"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=f"{name}, step {step}")
        np.testing.assert_array_equal(got.seq_lens[live], lens[live])
        for row in ended:
            start = got.cu_kv_lens[row] // page_size
            assert got.seq_lens[row] == 1 and got.cu_kv_lens[row + 1] - got.cu_kv_lens[row] == page_size
            assert got.page_indices[start] == 0, f"row {row} at step {step}"
        for row in live:
            count = -(-lens[row] // page_size)

            def row_pages(metadata, row=row, count=count):
                start = metadata.cu_kv_lens[row] // page_size
                return metadata.page_indices[start : start + count]

            np.testing.assert_array_equal(row_pages(got), row_pages(want), err_msg=f"row {row} at step {step}")
