"""Drawing one token per row from log-probabilities by inverse CDF, in two passes over the rows.

``jax.random.categorical`` draws with the Gumbel-max trick: one random number per vocabulary
entry per row (151936 per row for Qwen), which is most of a decode step on a CPU. The inverse
CDF needs one uniform per row: the vocabulary is cut into blocks, the block is chosen from the
running sum of block masses, then the token from the running sum inside that one block. The
draw follows the distribution exactly (up to float32 sums) and never returns a token of zero
probability. Two passes over each row: its max, and its block masses (with the exp fused in).

Pure JAX (no sglang-jax import).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .reductions import pairwise


def block_size(vocab: int) -> int:
    """Tokens per block: a power of two near sqrt(vocab), so both running sums are short; one
    that divides the vocabulary if there is one within 4x below (then no ragged last block
    is cut off and summed apart: 128 for Qwen's 151936 tokens, 256 for Llama 3's 128256). At
    least 64 where the vocabulary has that many: XLA's CPU backend ran the pairwise block sums
    of 32-token blocks at ~4 ns a token (vocabulary 320, 64 rows, jax 0.12: 83 us, 17 us in
    64-token blocks; the whole draw 115 against 92 us)."""
    smallest = 64 if vocab >= 64 else 1
    target = max(smallest, 1 << max(0, math.ceil(math.log2(math.sqrt(vocab)))))
    for size in (target, target // 2, target // 4):
        if size >= smallest and vocab % size == 0:
            return size
    return target


def draw_tokens(scores: jax.Array, uniforms: jax.Array, greedy: jax.Array | None = None) -> jax.Array:
    """Token [N] of each row of ``scores`` [N, V] (log-probabilities, normalized or not; ``-inf``
    excluded) at quantile ``uniforms`` [N] in [0, 1); rows where ``greedy`` [N] holds take their
    largest score instead."""
    return draw_tokens_and_log_probs(scores, uniforms, greedy)[0]


def draw_tokens_and_log_probs(
    scores: jax.Array, uniforms: jax.Array, greedy: jax.Array | None = None, temperatures: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """:func:`draw_tokens` from ``scores / temperatures`` (if given, [N]), and each token's
    log-probability [N] under that distribution, from the same two passes over the rows (a max,
    then the block masses; the division is fused into both, never stored)."""
    rows, vocab = scores.shape
    scale = jnp.ones((rows, 1), jnp.float32) if temperatures is None else 1.0 / temperatures.reshape(-1, 1)
    scores = scores.astype(jnp.float32)
    block = block_size(vocab)
    full = vocab // block

    # The max is taken before the temperature is applied (same order for a positive scale), so
    # no scaled copy of the rows is stored. The argmax (for greedy rows) comes with it: from
    # block maxes, both cost about what a plain max does at jax 0.12, and 6x less at 0.8.
    top, peak = row_argmax_and_max(scores)

    def probs(x):
        return jnp.exp((x - peak) * scale)

    # Block masses straight from the scores (the exp is fused into the sums).
    masses = pairwise(probs(scores[:, : full * block]).reshape(rows, full, block), jnp.add)
    if full * block < vocab:
        masses = jnp.concatenate([masses, probs(scores[:, full * block :]).sum(-1, keepdims=True)], axis=1)
    blocks = masses.shape[1]
    ends = jnp.cumsum(masses, axis=-1)
    target = uniforms.astype(jnp.float32) * ends[:, -1]
    # The first block whose running mass passes the target (it has mass > 0); if the target
    # rounds up to the total, the last block of mass > 0.
    last_block = blocks - 1 - jnp.argmax((masses > 0)[:, ::-1], axis=-1)
    chosen = jnp.minimum(jnp.sum(ends <= target[:, None], axis=-1), last_block)
    before = jnp.where(chosen > 0, jnp.take_along_axis(ends, jnp.maximum(chosen - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    # The chosen block's probabilities, recomputed from its scores (past the vocabulary: 0).
    columns = chosen[:, None] * block + jnp.arange(block)[None, :]
    inner = jnp.where(
        columns < vocab,
        probs(jnp.take_along_axis(scores, jnp.minimum(columns, vocab - 1), axis=-1)),
        0.0,
    )
    running = before[:, None] + jnp.cumsum(inner, axis=-1)
    # The first token whose running mass passes the target has probability > 0; if float
    # rounding leaves the target past the block's own sum, its last token of mass > 0.
    index = jnp.sum(running <= target[:, None], axis=-1)
    first = jnp.argmax(inner > 0, axis=-1)
    last = block - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
    # Clamped into the block's tokens of mass > 0 (a running sum that rounds down could
    # otherwise leave the target before the first of them).
    tokens = chosen * block + jnp.clip(index, first, last)
    if greedy is not None:
        tokens = jnp.where(greedy, top, tokens)
    tokens = tokens.astype(jnp.int32)
    # The token's distance to the max before scaling (0 for the max itself, exactly) minus the
    # log of the mass (>= 1): never above 0. ``scores[token] * scale - (peak * scale + log)``
    # carried the rounding of two products as large as the scaled scores, 0.06 at a
    # temperature of 2e-6, and gave the max positive log-probs.
    chosen = jnp.take_along_axis(scores, tokens[:, None], axis=-1)
    return tokens, ((chosen - peak) * scale)[:, 0] - jnp.log(ends[:, -1])


def row_argmax_and_max(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's ``jnp.argmax`` [N] (int32: its first largest entry, or its first NaN) and
    ``jnp.max`` [N, 1] of ``scores`` [N, V], from block maxes: the first block holding the
    row's largest, then that block's own argmax. XLA's CPU backend runs a plain argmax over
    Qwen's 151936 logits ~15x slower (21 ms against 1.4 ms for 64 rows at jax 0.12)."""
    rows, vocab = scores.shape
    block = block_size(vocab)
    full = vocab // block
    blocks = scores[:, : full * block].reshape(rows, full, block)
    block_maxes = pairwise(blocks, jnp.maximum)  # NaN if any
    top_block = jnp.argmax(block_maxes, axis=-1)
    inside = jnp.take_along_axis(blocks, top_block[:, None, None], axis=1)[:, 0]
    top = top_block * block + jnp.argmax(inside, axis=-1)
    peak = jnp.take_along_axis(block_maxes, top_block[:, None], axis=-1)
    if full * block < vocab:  # the ragged last block: taken only where strictly larger, or NaN first
        tail = scores[:, full * block :]
        tail_top = full * block + jnp.argmax(tail, axis=-1)
        tail_peak = jnp.max(tail, axis=-1, keepdims=True)
        take = (tail_peak > peak) | (jnp.isnan(tail_peak) & ~jnp.isnan(peak))
        top = jnp.where(take[:, 0], tail_top, top)
        peak = jnp.where(take, tail_peak, peak)
    return top.astype(jnp.int32), peak


def keyed_uniforms(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One uniform in [0, 1) per row from a key folded from (row seed, row position): the same
    draw for the same seed and position whatever the batch."""
    base = jax.random.key(0)

    def uniform(seed, position):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(base, seed), position))

    return jax.vmap(uniform)(seeds.astype(jnp.uint32), positions.astype(jnp.uint32))
