"""rollout/engine/draw.py: the blocked argmax of the replacement sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout.engine.draw import row_argmax_and_max


@pytest.mark.parametrize("vocab", [7, 100, 1500, 4096])
def test_blocked_argmax_is_jnp_argmax(vocab):
    """The first largest entry of each row (its first NaN, if any), as jnp.argmax gives it, and
    the row's max: ties inside a block, across blocks and with the ragged last block (1500 is
    23 blocks of 64 and 28 more; 100 one block of 64 and 36 more; 7 is blocks of 1), rows of
    -inf and of NaN."""
    rng = np.random.default_rng(vocab)
    rows = rng.normal(0.0, 1.0, (9, vocab)).astype(np.float32)
    last = vocab - 1
    rows[1, [3, vocab // 2, last]] = 9.0  # a tie across blocks: the first wins
    rows[2, [last - 1, last]] = 9.0  # a tie at the end (in the ragged block, at 1500)
    rows[3, last] = 9.0  # the largest is the last entry
    rows[4] = -np.inf
    rows[5, [2, vocab // 2]] = np.nan
    rows[6, last] = np.nan  # a NaN at the end only
    rows[7, 0] = 9.0
    rows[7, last] = 9.0  # a tie between the first and the last entry
    rows[8, 1:] = -np.inf  # one finite entry
    top, peak = jax.jit(row_argmax_and_max)(jnp.asarray(rows))
    np.testing.assert_array_equal(np.asarray(top), np.argmax(rows, axis=-1))
    np.testing.assert_array_equal(np.asarray(peak)[:, 0], np.max(rows, axis=-1))
    assert top.dtype == jnp.int32 and peak.shape == (9, 1)
