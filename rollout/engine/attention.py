"""Attention over a paged KV pool whose working memory follows the tokens actually present.

sglang-jax 0.0.2's native backend gathers every slot of ``cache_loc`` (padded to
``max_running_requests x context_length``) and builds logits of shape
[heads, tokens, max_running_requests x context_length]. Here each block of query tokens walks
only the span of ``cache_loc`` that its own requests occupy, ``kv_chunk`` slots at a time, with an
online (flash-attention style) softmax. The trip count is the longest span present in the batch,
a traced value (or, in decode, a static ``kv_walk`` that covers it), so shapes stay static and
nothing recompiles per request; the working memory is
about ``tokens x heads x kv_chunk`` whatever the engine's padding limits.

Pure JAX (no sglang-jax import); ``patches`` installs it into the engine's native backend.

KV rows are read and written with :func:`take_rows` and :func:`set_rows`. Where XLA computes
16-bit float gathers and scatters in float32 (its CPU backend in jax 0.8), converting the
whole pool around each of them every forward, they go through a same-width unsigned-integer
view instead (bit-identical); where it does not (jax 0.12, TPU, GPU) the view would only add a
copy, so it is not used. Which holds is probed once per platform (:func:`converts_16bit_rows`).

With ``head_major`` each KV head's rows are gathered apart (in decode its K and V apart too), so
both einsums find their operands in the layout of a batched dot, with no transposed copy of the
gathered K per chunk (in decode no copy of K or V at all). The
engine uses it where the backend runs those batched dots on the pool's dtype (XLA's CPU backend
in jax 0.8 cannot on 16-bit floats), probed once per platform and dtype
(:func:`runs_head_major_dots`); otherwise, and by default, rows of whole slots are gathered.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging

import jax
import jax.numpy as jnp

from .reductions import reduce_last

logger = logging.getLogger(__name__)

# Query tokens per block in prefill/extend: a block gathers one KV chunk for all its tokens.
DEFAULT_Q_BLOCK = 64
# KV slots gathered per step of the online softmax. 128 rather than 256: a block whose
# requests see fewer keys wastes less (Qwen2.5-0.5B shape, a 2048-token chunk, per layer, jax
# 0.12 CPU: 32 prompts x 64 tokens 58 vs 86 ms, 4 x 512 56 vs 104 ms).
DEFAULT_KV_CHUNK = 128
# In decode each token walks its own request's slots: a smaller chunk wastes less on short
# contexts and costs nothing on long ones (Qwen2.5-0.5B shape, 64 rows, jax 0.12 CPU, per
# layer: 2.1 vs 5.7 ms at 96 tokens of context, 17.5 vs 17.0 ms at 1024).
DEFAULT_DECODE_KV_CHUNK = 128


def decode_kv_walk(longest: int, widest: int, kv_chunk: int = DEFAULT_DECODE_KV_CHUNK) -> int:
    """A static count of the KV chunks a decode batch's attention walks (``kv_walk`` of
    :func:`paged_attention`) when its longest row has ``longest`` keys and no row can have more
    than ``widest``: the chunks the longest needs, rounded up to a power of two (so a generation
    compiles one program per doubling of its context), at most what ``widest`` needs."""
    needed = max(1, -(-longest // kv_chunk))
    return min(1 << (needed - 1).bit_length(), max(1, -(-widest // kv_chunk)))


def decode_kv_walks(widest: int, kv_chunk: int = DEFAULT_DECODE_KV_CHUNK) -> list[int]:
    """Every count :func:`decode_kv_walk` gives for rows of at most ``widest`` keys."""
    return sorted({decode_kv_walk(longest, widest, kv_chunk) for longest in range(1, widest + 1, kv_chunk)})


# Masked logits: finite, so a row with nothing visible yet gives exp(0) corrections, not NaN.
_MASKED = -1e30


def _probe(fn, *args):
    """``fn(*args)`` on a thread of its own: the engine asks while it traces its forward, under
    its mesh, and both are per-thread state that would stage the probe into that trace and
    reject its one-device arguments."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


@functools.cache
def converts_16bit_rows(platform: str) -> bool:
    """Whether XLA on ``platform`` computes a bfloat16 row scatter in float32 (a convert of the
    whole table), read from the optimized HLO of a small one."""
    return _probe(_scatter_converts, jax.local_devices(backend=platform)[0])


def _scatter_converts(device) -> bool:
    table = jax.device_put(jnp.zeros((64, 8), jnp.bfloat16), device)
    rows = jax.device_put(jnp.ones((2, 8), jnp.bfloat16), device)
    index = jax.device_put(jnp.array([3, 5]), device)
    compiled = jax.jit(lambda t, i, r: t.at[i].set(r)).lower(table, index, rows).compile()
    return "f32[64,8]" in compiled.as_text()


@functools.cache
def runs_head_major_dots(platform: str, dtype: str) -> bool:
    """Whether ``platform`` runs the head-major attention on a ``dtype`` KV pool. XLA's CPU
    backend in jax 0.8 compiles its batched dots on bfloat16 operands (float32 output) and then
    fails at run time (``UNIMPLEMENTED: Unsupported element type for DotThunk::Execute: BF16 x
    BF16 = F32``) where a batch has more than one KV head (seen at 2 KV heads, head_dim 8 and
    64), so the probe runs a decode and an extend of two KV heads. An UNIMPLEMENTED error
    means no; any other error is raised."""
    runs = _probe(_head_major_call_runs, jax.local_devices(backend=platform)[0], dtype)
    if not runs:
        logger.info(
            "%s cannot run the head-major attention's dots on %s: KV rows are gathered per slot", platform, dtype
        )
    return runs


def _head_major_call_runs(device, dtype: str) -> bool:
    heads, kv_heads, head_dim = 4, 2, 8
    pool, q, cache_loc, seq_lens, lens = jax.device_put(
        (
            jnp.ones((8, 2 * kv_heads, head_dim), dtype),
            jnp.ones((2, heads * head_dim), dtype),
            jnp.arange(1, 5, dtype=jnp.int32),
            jnp.full((2,), 2, jnp.int32),
            jnp.ones((2,), jnp.int32),
        ),
        device,
    )
    attend = functools.partial(paged_attention, num_heads=heads, num_kv_heads=kv_heads, scale=1.0, head_major=True)

    def decode_and_extend(q, pool, cache_loc, seq_lens, lens):
        return attend(q, pool, cache_loc, seq_lens), attend(q, pool, cache_loc, seq_lens, lens, lens)

    try:
        jax.block_until_ready(jax.jit(decode_and_extend)(q, pool, cache_loc, seq_lens, lens))
    except jax.errors.JaxRuntimeError as error:
        if "UNIMPLEMENTED" not in str(error):
            raise
        return False
    return True


def _view(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))


def take_rows(table: jax.Array, index: jax.Array, integer_view: bool = False) -> jax.Array:
    """``table[index]`` along axis 0; through an integer view of ``table`` if ``integer_view``."""
    if not integer_view:
        return table[index]
    return jax.lax.bitcast_convert_type(_view(table)[index], table.dtype)


def set_rows(table: jax.Array, index: jax.Array, rows: jax.Array, integer_view: bool = False) -> jax.Array:
    """``table.at[index].set(rows, mode="drop")`` (out-of-range rows dropped); through integer
    views if ``integer_view``."""
    rows = rows.astype(table.dtype)
    if not integer_view:
        return table.at[index].set(rows, mode="drop")
    return jax.lax.bitcast_convert_type(_view(table).at[index].set(_view(rows), mode="drop"), table.dtype)


def _split_kv(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K and V of gathered rows [..., 2 * head_dim] (a head's K, then its V)."""
    head_dim = rows.shape[-1] // 2
    return rows[..., :head_dim], rows[..., head_dim:]


def paged_attention(
    q: jax.Array,
    kv_fused: jax.Array,
    cache_loc: jax.Array,
    seq_lens: jax.Array,
    extend_prefix_lens: jax.Array | None = None,
    extend_seq_lens: jax.Array | None = None,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    causal: bool = True,
    page_size: int = 1,
    q_block: int = DEFAULT_Q_BLOCK,
    kv_chunk: int = DEFAULT_KV_CHUNK,
    decode_kv_chunk: int = DEFAULT_DECODE_KV_CHUNK,
    integer_view: bool = False,
    head_major: bool = False,
    kv_walk: int | None = None,
) -> jax.Array:
    """Attention of each query token to its own request's cached keys and values.

    The engine's batch layout (``ForwardBatch``):

    - ``q``: [tokens, heads, head_dim] or [tokens, heads * head_dim], tokens padded at the end.
    - ``kv_fused``: one layer of the KV pool, [slots, 2 * kv_heads, head_dim], K and V of each
      head interleaved (k0, v0, k1, v1, ...); slot 0 is the padding slot and never attended.
    - ``cache_loc``: the pool slots of request 0's tokens, then request 1's, ..., each request's
      span rounded up to ``page_size``; zeros after the last.
    - ``seq_lens``: tokens per request (prefix included), 0 for padded requests.
    - Extend (prefill): ``extend_seq_lens`` new tokens per request, laid out request after
      request in ``q``, after ``extend_prefix_lens`` cached ones; token ``i`` of request ``b``
      sees keys ``0 .. prefix_b + i`` (all ``seq_lens[b]`` keys if not ``causal``).
    - Decode (``extend_seq_lens`` None): token ``b`` is request ``b``'s next token and sees all
      its ``seq_lens[b]`` keys.

    ``integer_view``: read KV rows through an integer view (see :func:`converts_16bit_rows`).
    ``head_major``: gather each KV head's rows apart (see :func:`runs_head_major_dots`).
    ``kv_walk`` (decode only): walk this many chunks of ``decode_kv_chunk`` slots, a static count
    that must cover the longest row (:func:`decode_kv_walk`; chunks past a row's keys see none).
    The loop then has a trip count known to the compiler: XLA's GPU backend runs a loop of
    unknown trip count from the host, copying its predicate back and waiting at every iteration
    (on an H200, two such copies a layer-step were most of a decode chunk's idle time). None:
    the count is the longest row's, computed on the device.

    Returns [tokens, heads * head_dim] in ``q``'s dtype; padded tokens get zeros.
    """
    if kv_walk is not None and extend_seq_lens is not None:
        raise ValueError("kv_walk is a decode batch's: an extend's blocks walk what each needs")
    num_tokens = q.shape[0]
    head_dim = kv_fused.shape[-1]
    group = num_heads // num_kv_heads
    q = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if head_major:
        # The rows of each KV head come out [blocks, kv_heads, kv_chunk, ...], the batched
        # dots' layout (XLA CPU, jax 0.12, one bf16 layer in 16-step loops: decode 1.1-1.6x
        # faster at 96-1000 keys, even in prefill). A vmap over the KV-head axis keeps it
        # an axis of its own, which tensor parallelism shards; flattening the heads into the
        # rows instead (row slot * kv_heads + head) made XLA all-gather the pool every layer.
        gather_heads = jax.vmap(functools.partial(take_rows, integer_view=integer_view), in_axes=(1, None), out_axes=1)
        if extend_seq_lens is None:
            # In decode K and V are gathered apart, each straight into its dot's operand: from
            # rows of both XLA copied K and V out every chunk (XLA CPU, jax 0.12, 64 rows, slots
            # as decode allocates them: 15-29% less attention time in fp32 and bf16; spread at
            # random over a pool larger than the caches, 2% more at 500-1000 keys). In prefill,
            # where the scores outweigh K and V, gathering them apart was slower (bf16: 10-35%).
            kv_parts = kv_fused.reshape(kv_fused.shape[0], num_kv_heads, 2, head_dim)

            def gather_kv(slots):
                # Sliced here, in the loop's body, where XLA fuses each slice into its gather;
                # hoisted out of the loop, the slices were copies of the layer's whole pool.
                return gather_heads(kv_parts[:, :, 0], slots), gather_heads(kv_parts[:, :, 1], slots)

        else:
            kv_rows = kv_fused.reshape(kv_fused.shape[0], num_kv_heads, 2 * head_dim)

            def gather_kv(slots):
                return _split_kv(gather_heads(kv_rows, slots))

    else:
        # One row per slot: a row gather is far cheaper than a gather of [heads, head_dim] blocks.
        kv_rows = kv_fused.reshape(kv_fused.shape[0], 2 * num_kv_heads * head_dim)

        def gather_kv(slots):
            return _split_kv(take_rows(kv_rows, slots, integer_view).reshape(*slots.shape, num_kv_heads, 2 * head_dim))

    kv_dims = "bhcd" if head_major else "bchd"

    seq_lens = seq_lens.astype(jnp.int32)
    num_reqs = seq_lens.shape[0]
    spans = (seq_lens + page_size - 1) // page_size * page_size
    key_starts = jnp.cumsum(spans) - spans

    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    decode = extend_seq_lens is None
    if decode:
        req = tokens
        q_block = 1  # decode tokens belong to different requests: each walks its own span
        kv_chunk = decode_kv_chunk
    else:
        extend_seq_lens = extend_seq_lens.astype(jnp.int32)
        q_ends = jnp.cumsum(extend_seq_lens)
        # Token t's request is the number of requests ending at or before t: a histogram of the
        # ends, summed (a bisection is a loop of its own, slow on GPU: see the key mask below).
        req = jnp.cumsum(jnp.zeros(num_tokens, jnp.int32).at[q_ends].add(1, mode="drop"))
    safe = jnp.minimum(req, num_reqs - 1)
    q_end = seq_lens[safe]
    if extend_seq_lens is not None and causal:
        offset = tokens - (q_ends - extend_seq_lens)[safe]
        # Capped at the request's own keys: the mask below only bounds a token by q_end.
        q_end = jnp.minimum(extend_prefix_lens.astype(jnp.int32)[safe] + offset + 1, q_end)
    valid = req < num_reqs
    q_end = jnp.where(valid, q_end, 0)
    q_start = jnp.where(valid, key_starts[safe], 0)

    q_block = max(1, min(q_block, num_tokens))
    num_blocks = -(-num_tokens // q_block)
    pad = num_blocks * q_block - num_tokens

    def blocks(x):  # padded tokens get zeros: q_end 0 sees no key
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_blocks, q_block, *x.shape[1:])

    q_b, end_b = blocks(q), blocks(q_end)
    # Heads before query tokens ([blocks, kv_heads, q_block, group, head_dim]): both einsums
    # then take their operands and give their results in the layout of XLA's batched dot
    # (batch dims major, the contracted one minor), with no transposed copy of the score-sized
    # tensors per chunk (1.5-2.5x faster prefill attention on XLA CPU, same results).
    q_b = jnp.transpose(q_b, (0, 2, 1, 3, 4))
    q_rows = q_b.reshape(num_blocks, num_kv_heads, q_block * group, head_dim)
    mask_shape = (num_blocks, num_kv_heads, q_block, group, kv_chunk)
    weights_shape = (num_blocks, num_kv_heads, q_block * group, kv_chunk)
    start_b = blocks(q_start)
    # Each block reads the contiguous run of cache_loc from its first request's start to the
    # furthest key any of its tokens sees.
    seen = end_b > 0
    hi = jnp.max(jnp.where(seen, start_b + end_b, 0), axis=1)
    lo = jnp.minimum(jnp.min(jnp.where(seen, start_b, jnp.iinfo(jnp.int32).max), axis=1), hi)
    if kv_walk is None:
        num_chunks = (jnp.max(hi - lo) + kv_chunk - 1) // kv_chunk
    else:
        num_chunks = kv_walk

    last_loc = cache_loc.shape[0] - 1
    chunk = jnp.arange(kv_chunk, dtype=jnp.int32)

    def step(c, carry):
        m, denom, acc = carry
        k = lo[:, None] + c * kv_chunk + chunk  # [blocks, kv_chunk] positions in cache_loc
        loc = cache_loc[jnp.minimum(k, last_loc)]
        # A token sees the first q_end keys of its own request's span, which starts at q_start:
        # a range test, where a lookup of each key's request by bisection would be a loop
        # nested in this one (4.6x slower attention on an H200, see the README).
        key = k[:, None, :]
        mask = ((key >= start_b[:, :, None]) & (key < (start_b + end_b)[:, :, None]) & (loc > 0)[:, None, :])[
            :, None, :, None, :
        ]  # [blocks, 1, q_block, 1, kv_chunk]
        # Keys past the block's run (the next requests' slots) are read as the padding slot:
        # masked, their values still enter the weighted sum times 0, and a non-finite value
        # there (another request's) would make this one's output NaN.
        slots = jnp.where((loc > 0) & (k < hi[:, None]), loc, 0)
        k_c, v_c = gather_kv(slots)
        if not decode:
            # A prefill block's run holds several requests' keys: a non-finite value of one is
            # zeroed for the others (its own tokens still see NaN, through its non-finite key).
            v_c = jnp.where(jnp.isfinite(v_c), v_c, jnp.zeros_like(v_c))
        # The dots see a block's tokens and group as one axis: with tokens and group as axes of
        # their own, XLA transposed each chunk's K before the dot.
        s = jnp.einsum(f"bhtd,{kv_dims}->bhtc", q_rows, k_c, preferred_element_type=jnp.float32).reshape(mask_shape)
        s = jnp.where(mask, s * scale, _MASKED)
        # Halvings, not reductions (reductions.py): at jax 0.8 XLA CPU ran this max and the sum
        # below as windowed reductions (one bf16 0.5B layer: decode x1.5, prefill x2.5-3 slower).
        m_new = jnp.maximum(m, reduce_last(s, jnp.maximum, jnp.max))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        denom = denom * correction + reduce_last(p, jnp.add, jnp.sum)
        pv = jnp.einsum(
            f"bhtc,{kv_dims}->bhtd", p.astype(v_c.dtype).reshape(weights_shape), v_c, preferred_element_type=jnp.float32
        ).reshape(acc.shape)
        return m_new, denom, acc * correction[..., None] + pv

    stats = (num_blocks, num_kv_heads, q_block, group)
    init = (
        jnp.full(stats, _MASKED, jnp.float32),
        jnp.zeros(stats, jnp.float32),
        jnp.zeros((*stats, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_chunks, step, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    out = jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(num_blocks * q_block, num_heads * head_dim)[:num_tokens]
    return out.astype(q.dtype)
