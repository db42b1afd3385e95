"""The paged attention that replaces 0.0.2's native one: equal results, memory that does not
follow max_running_requests x context_length."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout import RolloutWorker
from rollout.engine import attention, patches
from rollout.engine.attention import paged_attention
from tests.helpers import HEAD_DIM, HEADS, KV_HEADS, attend, ragged_batch, tiny_worker_config


def test_matches_engine_native_attention():
    """Against sglang-jax 0.0.2's own function on the same inputs (page_size 1, where it is right)."""
    patches.install_workarounds()
    from sgl_jax.srt.layers.attention.native_backend import forward_attention
    from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

    rng = np.random.default_rng(2)
    batch = ragged_batch(rng, [0, 5, 3, 0], [7, 4, 9, 1])
    q, kv, cache_loc, seq_lens, prefix_lens, extend_lens = batch
    k_cache, v_cache = jnp.asarray(kv[:, 0::2]), jnp.asarray(kv[:, 1::2])
    engine = forward_attention(
        jnp.asarray(q),
        k_cache,
        v_cache,
        jnp.asarray(seq_lens),
        jnp.asarray(cache_loc),
        jnp.asarray(prefix_lens),
        jnp.asarray(extend_lens),
        HEADS,
        KV_HEADS,
        0.3,
        True,
        ForwardMode.EXTEND,
    )
    real = int(extend_lens.sum())
    np.testing.assert_allclose(attend(*batch, scale=0.3)[:real], np.asarray(engine)[:real], rtol=1e-5, atol=1e-6)
    q_decode = q[: len(seq_lens)]
    engine = forward_attention(
        jnp.asarray(q_decode),
        k_cache,
        v_cache,
        jnp.asarray(seq_lens),
        jnp.asarray(cache_loc),
        None,
        None,
        HEADS,
        KV_HEADS,
        0.3,
        False,
        ForwardMode.DECODE,
    )
    got = attend(q_decode, kv, cache_loc, seq_lens, scale=0.3)
    np.testing.assert_allclose(got, np.asarray(engine), rtol=1e-5, atol=1e-6)


def test_the_head_major_probe_says_whether_a_bfloat16_pool_runs_head_major():
    """Where the probe says yes, a bfloat16 pool's decode and extend give the slot-row layout's
    results head-major, at these shapes and at the Qwen2.5-0.5B layer's (14 heads, 2 KV heads,
    head_dim 64); where it says no (XLA CPU in jax 0.8), the head-major call does fail, and the
    engine gathers slot rows."""
    platform = jax.default_backend()
    rng = np.random.default_rng(3)
    q, kv, cache_loc, seq_lens, prefix_lens, extend_lens = ragged_batch(rng, [0, 5, 3], [7, 4, 9])
    q, kv = (np.asarray(jnp.asarray(x, jnp.bfloat16)) for x in (q, kv))
    layer_q = jnp.ones((3, 14 * 64), jnp.bfloat16)
    layer_kv = jnp.asarray(rng.standard_normal((256, 4, 64)), jnp.bfloat16)

    def decode_and_extend(head_major):
        decode = attend(q[: len(seq_lens)], kv, cache_loc, seq_lens, scale=0.3, head_major=head_major)
        extend = attend(q, kv, cache_loc, seq_lens, prefix_lens, extend_lens, scale=0.3, head_major=head_major)
        layer = jax.jit(
            lambda *args: paged_attention(*args, num_heads=14, num_kv_heads=2, scale=0.125, head_major=head_major)
        )
        layer_decode = np.asarray(layer(layer_q, layer_kv, cache_loc, seq_lens)).reshape(-1, HEADS * HEAD_DIM)
        return np.concatenate([decode, extend, layer_decode]).astype(np.float32)

    if attention.runs_head_major_dots(platform, "bfloat16"):
        np.testing.assert_allclose(decode_and_extend(True), decode_and_extend(False), rtol=1e-2, atol=1e-2)
    else:
        with pytest.raises(jax.errors.JaxRuntimeError, match="DotThunk"):
            decode_and_extend(True)
        decode_and_extend(False)
    assert attention.runs_head_major_dots(platform, "float32")


def test_probes_answer_the_same_under_a_mesh_and_inside_a_trace():
    """The engine first asks while it traces its forward under its mesh (here: 2 devices
    without device 0); the probes must run, not raise or be staged into that trace."""
    platform = jax.default_backend()
    ask = lambda: (attention.runs_head_major_dots(platform, "bfloat16"), attention.converts_16bit_rows(platform))  # noqa: E731

    def clear():
        attention.runs_head_major_dots.cache_clear()
        attention.converts_16bit_rows.cache_clear()

    answers = ask()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[1:3]), ("tensor",))
    seen = []

    @jax.jit
    def traced(x):
        seen.append(ask())
        return x

    try:
        clear()
        with jax.set_mesh(mesh):
            seen.append(ask())
        clear()
        with jax.set_mesh(mesh):
            traced(jax.device_put(jnp.ones(2), jax.NamedSharding(mesh, jax.sharding.PartitionSpec())))
    finally:
        clear()
    assert seen == [answers, answers]


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "slot-rows"])
def test_tensor_parallel_attention_keeps_each_devices_kv_heads(head_major):
    """With the pool sharded over KV heads as the engine shards it (and q over heads), the
    compiled attention moves no KV between devices: no collective at all. Flattening the heads
    into the gathered rows made XLA all-gather the pool every layer."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tensor",))
    spec = jax.sharding.PartitionSpec
    heads_sharded, replicated = jax.NamedSharding(mesh, spec(None, "tensor")), jax.NamedSharding(mesh, spec())
    kv = jax.ShapeDtypeStruct((256, 2 * KV_HEADS, HEAD_DIM), jnp.float32, sharding=heads_sharded)
    cache_loc = jax.ShapeDtypeStruct((96,), jnp.int32, sharding=replicated)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=replicated)
    fn = jax.jit(
        lambda *args: paged_attention(*args, num_heads=HEADS, num_kv_heads=KV_HEADS, scale=1.0, head_major=head_major)
    )
    for tokens, extend in ((4, ()), (8, (lens, lens))):
        q = jax.ShapeDtypeStruct((tokens, HEADS, HEAD_DIM), jnp.float32, sharding=heads_sharded)
        hlo = fn.lower(q, kv, cache_loc, lens, *extend).compile().as_text()
        collectives = [op for op in ("all-gather", "all-to-all", "all-reduce", "collective-permute") if op in hlo]
        assert not collectives, ("extend" if extend else "decode", collectives)


def temp_bytes(num_tokens, max_requests, context_length, decode):
    """XLA's scratch bytes for one compiled paged attention call at the engine's padded shapes."""
    shapes = [
        jax.ShapeDtypeStruct((num_tokens, HEADS, HEAD_DIM), jnp.float32),
        jax.ShapeDtypeStruct((4096, 2 * KV_HEADS, HEAD_DIM), jnp.float32),
        jax.ShapeDtypeStruct((max_requests * context_length,), jnp.int32),
        jax.ShapeDtypeStruct((max_requests,), jnp.int32),
    ]
    if not decode:
        shapes += [jax.ShapeDtypeStruct((max_requests,), jnp.int32)] * 2
    fn = jax.jit(lambda *args: paged_attention(*args, num_heads=HEADS, num_kv_heads=KV_HEADS, scale=1.0))
    return fn.lower(*shapes).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
def test_working_memory_does_not_follow_padding_limits(decode):
    tokens = 16 if decode else 256
    small = temp_bytes(tokens, 16, 256, decode)
    # 4096 x 32768 slots of cache_loc: the engine's attention would need 16 x 4 x 2^27 x 4 bytes.
    large = temp_bytes(tokens, 16 if decode else 4096, 32768, decode)
    assert large <= small * 1.1 + 65536, (small, large)


def engine_forward_temp_bytes(model_dir, max_requests, context_length, paged=True):
    config = tiny_worker_config(
        model_dir, load_format="dummy", max_running_requests=max_requests, context_length=context_length
    )
    choice = contextlib.nullcontext() if paged else patches.engine_native_attention()
    with choice, RolloutWorker(config) as worker:
        prefill = worker.engine.forward_memory(256)
        decode = worker.engine.forward_memory(8, decode=True)
    return prefill.temp_bytes, decode.temp_bytes


def test_engine_forward_memory_does_not_follow_padding_limits(qwen2_dir):
    small = engine_forward_temp_bytes(qwen2_dir, 8, 256)
    large = engine_forward_temp_bytes(qwen2_dir, 64, 1024)
    for small_bytes, large_bytes in zip(small, large):
        assert large_bytes <= small_bytes * 1.05 + 65536, (small, large)
    # The engine's own attention at the large setting: logits against 64 x 1024 slots.
    native = engine_forward_temp_bytes(qwen2_dir, 64, 1024, paged=False)
    assert native[0] > 10 * large[0] and native[1] > 2 * large[1], (native, large)


# ---- in the engine ---------------------------------------------------------------------------

# One prompt longer than chunked_prefill_size (prefilled in 3 chunks) and short ones. Their
# lengths are far enough apart that a row's sequence length names its request and step.
ENGINE_PROMPTS = [list(range(3, 153)), [5, 17, 42], [100, 3] * 6, [250, 251, 7] * 7, [9] * 30]
NEW_TOKENS = 6


@contextlib.contextmanager
def captured_forwards(worker):
    """Logits of each real row by its sequence length, and the prefix lengths of each extend.

    Rows are keyed by content, not by forward: how requests are batched depends on when they
    reach the scheduler.
    """
    runner = worker.engine.testing.model_runner
    forward = runner.forward
    logits, prefixes = {}, []

    def capture(forward_batch, logits_metadata):
        seq_lens = np.asarray(forward_batch.seq_lens)
        real = seq_lens > 0
        if forward_batch.extend_prefix_lens is not None:
            prefixes.append(np.asarray(forward_batch.extend_prefix_lens)[real])
        output, misses = forward(forward_batch, logits_metadata)
        for seq_len, row in zip(seq_lens[real], np.asarray(output.next_token_logits)):
            assert int(seq_len) not in logits
            logits[int(seq_len)] = row
        return output, misses

    runner.forward = capture
    try:
        yield logits, prefixes
    finally:
        del runner.forward


def generate_twice(model_dir, tp_size, baseline):
    """Greedy completions, logits and extend prefixes of two identical generate calls."""
    config = tiny_worker_config(model_dir, tp_size=tp_size, chunked_prefill_size=64, max_prefill_tokens=64)
    calls = []
    with contextlib.ExitStack() as stack:
        if baseline:
            stack.enter_context(patches.engine_native_attention())
        worker = stack.enter_context(RolloutWorker(config))
        # The second call finds every prompt in the prefix cache.
        for _ in range(2):
            with captured_forwards(worker) as (logits, prefixes):
                batch = worker.generate(ENGINE_PROMPTS, temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            calls.append((batch.completions, logits, prefixes))
    return calls


@pytest.mark.parametrize(
    "model_fixture, tp_size",
    [("qwen2_dir", 2), ("qwen2_untied_dir", 1), ("qwen3_dir", 2)],
    ids=["qwen2-tied-bias-gqa-tp2", "qwen2-untied-tp1", "qwen3-qknorm-mha-tp2"],
)
def test_engine_greedy_tokens_and_logits_match_native_attention(request, monkeypatch, model_fixture, tp_size):
    model_dir = request.getfixturevalue(model_fixture)
    layouts = []

    def recording_layout(*args, head_major, **kwargs):
        layouts.append(head_major)
        return paged_attention(*args, head_major=head_major, **kwargs)

    monkeypatch.setattr(patches, "paged_attention", recording_layout)
    calls = generate_twice(model_dir, tp_size, baseline=False)
    # The engine gathers in the layout the probe chose for its float32 pool.
    assert layouts and set(layouts) == {attention.runs_head_major_dots(jax.default_backend(), "float32")}
    want_calls = generate_twice(model_dir, tp_size, baseline=True)
    for (completions, logits, _), (want_completions, want_logits, _) in zip(calls, want_calls):
        assert completions == want_completions
        assert logits.keys() == want_logits.keys()
        for seq_len, row in logits.items():
            np.testing.assert_allclose(row, want_logits[seq_len], rtol=1e-4, atol=1e-4, err_msg=f"seq_len {seq_len}")
    (first, _, first_prefixes), (second, _, second_prefixes) = calls
    assert first == second
    # Chunked prefill (later chunks of the long prompt) and prefix-cache hits really happened.
    assert any(p.max() >= 64 for p in first_prefixes)
    assert all(p.min() > 0 for p in second_prefixes)


def test_bf16_kv_pool_is_not_converted_per_forward(qwen2_dir):
    """A bf16 engine's forward writes and reads the KV pool without a float32 copy of it: its
    scratch grows with the pool (max_total_tokens) by at most one 16-bit copy per layer (the
    integer view XLA 0.8 copies; none where XLA scatters bf16 in place), not by f32 copies."""

    def decode_temp_bytes(max_total_tokens):
        config = tiny_worker_config(qwen2_dir, load_format="dummy", dtype="bfloat16", max_total_tokens=max_total_tokens)
        with RolloutWorker(config) as worker:
            return worker.engine.forward_memory(8, decode=True).temp_bytes

    small, large = decode_temp_bytes(2048), decode_temp_bytes(16384)
    layers, bf16_layer_growth = 2, (16384 - 2048) * 2 * 128 * 2  # slots x (K, V) x head_dim 128 x 2 bytes
    assert large - small <= 1.5 * layers * bf16_layer_growth, (small, large)
