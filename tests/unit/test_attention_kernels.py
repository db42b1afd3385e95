"""rollout/engine/attention.py without an engine: the paged attention against attention computed
straight from its definition, and the probe that picks its layout."""

import jax
import numpy as np
import pytest

from rollout.engine import attention
from rollout.engine.attention import DEFAULT_KV_CHUNK, DEFAULT_Q_BLOCK
from tests.helpers import HEAD_DIM, HEADS, KV_HEADS, attend, ragged_batch


def dense_reference(q, kv, cache_loc, seq_lens, prefix_lens, extend_lens, scale, page_size=1, causal=True):
    """Attention one token at a time, straight from the definition (numpy, float64)."""
    out = np.zeros((q.shape[0], HEADS * HEAD_DIM))
    group = HEADS // KV_HEADS
    token, key_start = 0, 0
    for seq_len, prefix, extend in zip(seq_lens, prefix_lens, extend_lens):
        slots = cache_loc[key_start : key_start + seq_len]
        keys, values = kv[slots, 0::2].astype(np.float64), kv[slots, 1::2].astype(np.float64)
        for i in range(extend):
            visible = prefix + i + 1 if causal else seq_len
            for h in range(HEADS):
                logits = keys[:visible, h // group] @ q[token, h] * scale
                weights = np.exp(logits - logits.max())
                weights /= weights.sum()
                out[token, h * HEAD_DIM : (h + 1) * HEAD_DIM] = weights @ values[:visible, h // group]
            token += 1
        key_start += -(-seq_len // page_size) * page_size
    return out


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "slot-rows"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "q_block, kv_chunk", [(4, 3), (DEFAULT_Q_BLOCK, DEFAULT_KV_CHUNK)], ids=["small-blocks", "defaults"]
)
def test_extend_matches_dense_reference(page_size, causal, q_block, kv_chunk, head_major):
    rng = np.random.default_rng(0)
    # Fresh prompts, cached prefixes, a one-token extend, and two padded requests.
    batch = ragged_batch(rng, [0, 5, 3, 0, 11, 0, 0], [7, 4, 9, 1, 2, 0, 0], page_size)
    q, kv, cache_loc, seq_lens, prefix_lens, extend_lens = batch
    got = attend(
        *batch, scale=0.3, causal=causal, page_size=page_size, q_block=q_block, kv_chunk=kv_chunk, head_major=head_major
    )
    want = dense_reference(*batch, scale=0.3, page_size=page_size, causal=causal)
    real = int(extend_lens.sum())
    np.testing.assert_allclose(got[:real], want[:real], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[real:], 0.0)


@pytest.mark.parametrize("static_walk", [False, True], ids=["", "static-walk"])
@pytest.mark.parametrize("integer_view", [False, True], ids=["", "integer-view"])
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "slot-rows"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_matches_dense_reference(page_size, head_major, integer_view, static_walk):
    rng = np.random.default_rng(1)
    _, kv, cache_loc, seq_lens, _, _ = ragged_batch(rng, [6, 1, 13, 0, 0], [1, 1, 1, 0, 0], page_size)
    q = rng.standard_normal((len(seq_lens), HEADS, HEAD_DIM)).astype(np.float32)
    got = attend(
        q,
        kv,
        cache_loc,
        seq_lens,
        scale=0.5,
        page_size=page_size,
        decode_kv_chunk=4,
        head_major=head_major,
        integer_view=integer_view,
        kv_walk=attention.decode_kv_walk(int(seq_lens.max()), 64, kv_chunk=4) if static_walk else None,
    )
    # A decode token is an extend of one token after seq_len - 1 cached ones.
    ones = (seq_lens > 0).astype(np.int32)
    want = dense_reference(q, kv, cache_loc, seq_lens, seq_lens - ones, ones, 0.5, page_size)
    real = seq_lens > 0
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[~real], 0.0)


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "slot-rows"])
def test_a_static_decode_walk_is_a_loop_of_known_trip_count_with_the_same_output(head_major):
    """``kv_walk``: the loop over KV chunks has the trip count XLA knows (a GPU then runs it
    without reading its predicate back every iteration); walking exactly the chunks the
    longest row needs, or more, gives the output of the walk computed on the device, bit for
    bit (chunks past a row's keys see none)."""
    rng = np.random.default_rng(2)
    _, kv, cache_loc, seq_lens, _, _ = ragged_batch(rng, [6, 1, 13, 0, 0], [1, 1, 1, 0, 0], 1)
    q = rng.standard_normal((len(seq_lens), HEADS, HEAD_DIM)).astype(np.float32)
    args = [jax.numpy.asarray(x) for x in (q, kv, cache_loc, seq_lens)]
    settings = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, scale=0.5, decode_kv_chunk=4, head_major=head_major)

    def compiled(kv_walk):
        fn = jax.jit(lambda *a: attention.paged_attention(*a, **settings, kv_walk=kv_walk))
        return fn.lower(*args).compile()

    dynamic = compiled(None)
    assert "known_trip_count" not in dynamic.as_text()
    longest = attention.decode_kv_walk(int(seq_lens.max()), 64, kv_chunk=4)
    assert longest == 4  # 14 keys: 4 chunks of 4
    for kv_walk in (longest, 7):
        walked = compiled(kv_walk)
        assert f'"known_trip_count":{{"n":"{kv_walk}"}}' in walked.as_text()
        np.testing.assert_array_equal(np.asarray(walked(*args)), np.asarray(dynamic(*args)))
    extend_lens = jax.numpy.asarray(seq_lens)
    with pytest.raises(ValueError, match="kv_walk is a decode batch's"):
        attention.paged_attention(*args, extend_lens, extend_lens, **settings, kv_walk=4)


def test_decode_walks_double_up_to_what_the_widest_row_needs():
    walks = [attention.decode_kv_walk(keys, 2048) for keys in (0, 1, 128, 129, 256, 257, 1024, 1025, 2048)]
    assert walks == [1, 1, 1, 2, 2, 4, 8, 16, 16]
    assert attention.decode_kv_walks(2048) == [1, 2, 4, 8, 16]
    # A width that is no power of two of chunks: its last walk is what it needs.
    assert attention.decode_kv_walk(270, 270) == 3 and attention.decode_kv_walks(270) == [1, 2, 3]
    assert attention.decode_kv_walks(100) == [1]


def test_only_an_unimplemented_error_makes_the_probe_say_no(monkeypatch):
    """A backend that cannot run the dots says no; any other failure (out of memory, a bug) is
    raised, not cached as a permanent slow path."""
    failure = {}

    def failing(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(failure["message"])

    monkeypatch.setattr(attention, "paged_attention", failing)
    try:
        for message, says_no in (("UNIMPLEMENTED: no such dot", True), ("RESOURCE_EXHAUSTED: out of memory", False)):
            failure["message"] = message
            attention.runs_head_major_dots.cache_clear()
            if says_no:
                assert attention.runs_head_major_dots(jax.default_backend(), "float32") is False
            else:
                with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
                    attention.runs_head_major_dots(jax.default_backend(), "float32")
    finally:
        attention.runs_head_major_dots.cache_clear()


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "slot-rows"])
def test_another_requests_non_finite_kv_stays_its_own(head_major):
    """A decode row's last KV chunk, and a prefill block's, reach into other requests' slots
    (masked): their values once entered the weighted sum times 0, and a NaN or inf there (one
    request's overflow, a bad embedding) made the rows batched with it NaN."""
    rng = np.random.default_rng(2)
    q, kv, cache_loc, seq_lens, prefix_lens, extend_lens = ragged_batch(rng, [6, 2, 13, 0], [1, 1, 1, 0])
    poisoned = kv.copy()
    last = int(seq_lens.sum())
    poisoned[cache_loc[seq_lens[0] + seq_lens[1] : last]] = np.nan  # request 2's keys and values
    poisoned[cache_loc[seq_lens[0] : seq_lens[0] + 1]] = np.inf  # request 1's first
    decode_q = rng.standard_normal((len(seq_lens), HEADS, HEAD_DIM)).astype(np.float32)
    kwargs = dict(scale=0.5, decode_kv_chunk=8, head_major=head_major)
    got = attend(decode_q, poisoned, cache_loc, seq_lens, **kwargs)
    want = attend(decode_q, kv, cache_loc, seq_lens, **kwargs)
    np.testing.assert_array_equal(got[0], want[0])
    assert np.isnan(got[2]).all()  # its own NaN is its own
    # Prefill: a block of one token, and blocks of the engine's default size, which hold several
    # requests' tokens and so read several requests' keys.
    for q_block in (1, DEFAULT_Q_BLOCK):
        kwargs = dict(scale=0.5, q_block=q_block, kv_chunk=8, head_major=head_major)
        got = attend(q, poisoned, cache_loc, seq_lens, prefix_lens, extend_lens, **kwargs)
        want = attend(q, kv, cache_loc, seq_lens, prefix_lens, extend_lens, **kwargs)
        np.testing.assert_array_equal(got[0], want[0])
        assert np.isnan(got[2]).all()
