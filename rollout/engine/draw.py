"""Drawing one token per row from log-probabilities by inverse CDF, in about one pass.

``jax.random.categorical`` draws with the Gumbel-max trick: one random number per vocabulary
entry per row (151936 per row for Qwen), which is most of a decode step on a CPU. The inverse
CDF needs one uniform per row: the vocabulary is cut into blocks, the block is chosen from the
running sum of block masses, then the token from the running sum inside that one block. The
draw follows the distribution exactly (up to float32 sums) and never returns a token of zero
probability.

Pure JAX (no sglang-jax import).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def block_size(vocab: int) -> int:
    """Tokens per block: the power of two nearest above sqrt(vocab), so both running sums are
    short (512 for a 151936-token vocabulary)."""
    return 1 << max(0, math.ceil(math.log2(math.sqrt(vocab))))


def draw_tokens(log_probs: jax.Array, uniforms: jax.Array) -> jax.Array:
    """Token [N] of each row of ``log_probs`` [N, V] (normalized or not; ``-inf`` excluded) at
    quantile ``uniforms`` [N] in [0, 1)."""
    rows, vocab = log_probs.shape
    block = block_size(vocab)
    blocks = -(-vocab // block)
    probs = jnp.exp(log_probs.astype(jnp.float32) - jnp.max(log_probs, axis=-1, keepdims=True))
    probs = jnp.pad(probs, ((0, 0), (0, blocks * block - vocab))).reshape(rows, blocks, block)
    masses = probs.sum(axis=-1)
    ends = jnp.cumsum(masses, axis=-1)
    target = uniforms.astype(jnp.float32) * ends[:, -1]
    # The first block whose running mass passes the target (it has mass > 0); if the target
    # rounds up to the total, the last block of mass > 0.
    last_block = blocks - 1 - jnp.argmax((masses > 0)[:, ::-1], axis=-1)
    chosen = jnp.minimum(jnp.sum(ends <= target[:, None], axis=-1), last_block)
    before = jnp.where(chosen > 0, jnp.take_along_axis(ends, jnp.maximum(chosen - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(probs, chosen[:, None, None], axis=1)[:, 0]  # [rows, block]
    running = before[:, None] + jnp.cumsum(inner, axis=-1)
    # The first token whose running mass passes the target has probability > 0; if float
    # rounding leaves the target past the block's own sum, its last token of mass > 0.
    index = jnp.sum(running <= target[:, None], axis=-1)
    last = block - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
    return (chosen * block + jnp.minimum(index, last)).astype(jnp.int32)


def keyed_uniforms(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One uniform in [0, 1) per row from a key folded from (row seed, row position): the same
    draw for the same seed and position whatever the batch."""
    base = jax.random.key(0)

    def uniform(seed, position):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(base, seed), position))

    return jax.vmap(uniform)(seeds.astype(jnp.uint32), positions.astype(jnp.uint32))
