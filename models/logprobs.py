"""The sampling distribution, as log-probabilities: one definition for the engine and the trainer.

The rollout engine draws every token from :func:`sampling_log_probs` of its logits and reports
the drawn token's log-prob with :func:`sampled_token_log_probs`; a trainer recomputes the same
numbers from its own logits with :func:`completion_log_probs`. Sharing the code means a mismatch
between the two can only come from the logits (weights, mapping, dtype), never from the sampling
arithmetic.

Order of operations (as in sglang, vLLM and HF): temperature, then top-k, top-p (on the tempered
distribution, smallest prefix of the sorted probabilities whose mass before the token is at most
``top_p``) and min-p (tokens with probability below ``min_p`` times the largest), then
renormalization over the kept tokens. Ties at the cut-off are all kept. The cut-off comes from
the top ``PRESELECT`` entries of each row when the kept tokens fit in them, and from bisections
over the row's values otherwise: the same tokens either way (no sort of the vocabulary).

Logits come from :func:`table_logits` on both sides: the model's dtype in, float32 accumulation
and output (a bfloat16 logit keeps 8 significant bits: steps of 0.125 at a logit of 20).

Greedy rows (``top_k == 1``, which is what ``temperature=0`` becomes) would always report 0; they
report the log-prob under the unfiltered distribution at their temperature instead (temperature
1 for ``temperature=0``), which is what a trainer computes for them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Sorted entries a filtering row is first cut from (lax.top_k): a full sort of a 151936-token
# vocabulary costs ~100x as much on a CPU. When some row's kept tokens do not fit, bisections
# over the values (32 passes over the rows, no sort) find the same cut-off.
PRESELECT = 256


def table_logits(hidden, table) -> jax.Array:
    """Float32 logits [..., V] of ``hidden`` [..., H] against a [V, H] table (a tied embedding, an
    engine's LM head), both in the model's dtype. Asking the dot for float32 output is also what
    XLA's CPU backend runs fastest: a bfloat16-output dot against the table's transpose was 5-8x
    slower (jax 0.12, 64 rows of the Qwen2.5-0.5B head)."""
    contract = (((hidden.ndim - 1,), (1,)), ((), ()))
    return jax.lax.dot_general(hidden, table, contract, preferred_element_type=jnp.float32)


def sampling_log_probs(logits, temperature, top_k, top_p, min_p) -> tuple[jax.Array, jax.Array]:
    """(tempered, filtered) log-probs [N, V] of the distribution rows of ``logits`` sample from.

    ``tempered`` is ``log_softmax(logits / temperature)``; ``filtered`` is the renormalized
    distribution after top-k, top-p and min-p, ``-inf`` outside the kept tokens. The sampling
    parameters are scalars or [N] arrays; ``temperature`` must be > 0 and ``top_k`` >= 1 (a
    value >= V keeps every token).
    """
    logits = jnp.asarray(logits, jnp.float32)
    rows, vocab = logits.shape

    def column(x, dtype):
        return jnp.broadcast_to(jnp.asarray(x, dtype).reshape(-1), (rows,))[:, None]

    temperature = column(temperature, jnp.float32)
    top_k, top_p, min_p = column(top_k, jnp.int32), column(top_p, jnp.float32), column(min_p, jnp.float32)

    tempered = jax.nn.log_softmax(logits / temperature, axis=-1)
    tempered = jnp.nan_to_num(tempered, nan=-jnp.inf)
    keeps_all = (top_k >= vocab) & (top_p >= 1.0) & (min_p <= 0.0)  # rows that filter nothing

    # min-p's floor; from a max of its own: a slice of top_k's output makes XLA sort the row.
    floor = tempered.max(axis=-1, keepdims=True) + jnp.log(min_p)

    def cutoff(descending, width):
        """Per row: the smallest kept log-prob, and whether the kept prefix fits in the first
        ``width`` sorted entries (it always does when they are the whole row)."""
        probs = jnp.exp(descending)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # Each condition holds on a prefix of the sorted row, so together they keep a prefix;
        # the first token always stays.
        keep = (jnp.arange(width)[None, :] < top_k) & (mass_before <= top_p) & (descending >= floor)
        kept = jnp.maximum(keep.sum(axis=-1, keepdims=True), 1)
        fits = (kept < width) | (top_k <= width) | (width == vocab) | keeps_all
        return jnp.take_along_axis(descending, kept - 1, axis=-1), jnp.all(fits)

    def searched_cutoff(tempered, descending, width):
        """The same cut-off without sorting: bisections over the values' order (32 passes)."""
        keys = _order_keys(tempered)
        probs = jnp.exp(tempered)
        # top-p: the smallest value whose strictly larger tokens weigh at most top_p.
        top_p_key = _bisect(lambda x: jnp.where(keys > x, probs, 0.0).sum(-1, keepdims=True) <= top_p, keys)
        # top-k: the k-th largest value, read from the preselection where k is inside it (greedy
        # padding rows, usual top-k) or keeping all at k >= V (top-p-only rows); searched (fewer
        # than k tokens above it) only when some row's k lies between: half the passes otherwise.
        known = jnp.where(
            top_k >= vocab,
            jnp.iinfo(jnp.int32).min,
            _order_keys(jnp.take_along_axis(descending, jnp.clip(top_k, 1, width) - 1, axis=-1)),
        )
        searched = (top_k > width) & (top_k < vocab)
        top_k_key = jax.lax.cond(
            jnp.any(searched),
            lambda: jnp.where(searched, _bisect(lambda x: (keys > x).sum(-1, keepdims=True) < top_k, keys), known),
            lambda: known,
        )
        return jnp.maximum(jnp.maximum(top_p_key, top_k_key), _order_keys(floor))

    def filtered(tempered):
        # The top PRESELECT entries decide every row whose kept prefix ends inside them (the
        # same prefix as in a full sort); otherwise bisections find it.
        width = min(PRESELECT, vocab)
        descending = jax.lax.top_k(tempered, width)[0]
        threshold, fits = cutoff(descending, width)
        threshold_key = jax.lax.cond(
            fits, lambda: _order_keys(threshold), lambda: searched_cutoff(tempered, descending, width)
        )
        # Rows that filter nothing keep every token (a batch's other rows may filter).
        threshold_key = jnp.where(keeps_all, jnp.iinfo(jnp.int32).min, threshold_key)
        masked = jnp.where(_order_keys(tempered) >= threshold_key, tempered, -jnp.inf)
        return masked - jax.nn.logsumexp(masked, axis=-1, keepdims=True)

    # The filter only runs when some row filters.
    filters = ~jnp.all(keeps_all)
    return tempered, jax.lax.cond(filters, filtered, lambda tempered: tempered, tempered)


def _order_keys(x):
    """float32 -> int32 keys in the same order (-inf first)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _bisect(holds, keys):
    """Per row, the smallest int32 key ``x`` in [min key, max key] at which ``holds(x)`` [N, 1]
    is true, for ``holds`` false then true as ``x`` grows (true at the row's largest key)."""
    lo = keys.min(axis=-1, keepdims=True) - 1  # holds(lo) is taken as false
    hi = keys.max(axis=-1, keepdims=True)

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        ok = holds(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, step, (lo, hi))[1]


def sampled_token_log_probs(tempered, filtered, tokens, top_k) -> jax.Array:
    """The log-prob [N] reported for each row's drawn token (greedy rows: the tempered one)."""
    tokens = jnp.asarray(tokens, jnp.int32).reshape(-1, 1)
    greedy = jnp.broadcast_to(jnp.asarray(top_k).reshape(-1), (tempered.shape[0],)) == 1
    from_tempered = jnp.take_along_axis(tempered, tokens, axis=-1)[:, 0]
    from_filtered = jnp.take_along_axis(filtered, tokens, axis=-1)[:, 0]
    return jnp.where(greedy, from_tempered, from_filtered)


# The engine runs a temperature below this as greedy (sglang-jax 0.0.2's _SAMPLING_EPS).
GREEDY_BELOW = 1e-6
# The engine's top-k that keeps every token (its TOP_K_ALL); any larger one keeps as many, and
# past int32 would overflow its batch's top-k array.
TOP_K_ALL = 2**30


def engine_sampling_params(temperature: float, top_k: int) -> tuple[float, int]:
    """(temperature, top_k) as the engine runs them: a temperature below ``GREEDY_BELOW``
    (``0`` included) is top-k 1 at temperature 1, and ``top_k=-1`` keeps every token."""
    if temperature < GREEDY_BELOW:
        return 1.0, 1
    return float(temperature), (TOP_K_ALL if top_k == -1 else min(int(top_k), TOP_K_ALL))


def completion_log_probs(
    logits, tokens, completion_mask, *, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, kept_counts=None
) -> jax.Array:
    """Log-probs [B, T] of the completion tokens under the sampling distribution, 0 elsewhere.

    ``logits`` [B, T, V] come from a forward over ``tokens`` [B, T]: column ``t - 1`` predicts
    token ``t``. ``completion_mask`` [B, T] marks sampled tokens (a ``RolloutBatch`` layout).
    Sampling parameters are the ones ``RolloutWorker.generate`` took.

    ``kept_counts`` [B, T] (``RolloutBatch.kept_counts``): at each completion token keep that
    many of the largest tokens, as the engine did, instead of cutting top-k, top-p and min-p
    afresh. Logits that differ from the engine's in their last bits can move a token across
    the top-p boundary, which shifts the token's log-prob by the log of the kept mass; with the
    engine's count both sides keep the same tokens (up to an exact tie swapped by rounding).
    """
    temperature, top_k = engine_sampling_params(temperature, top_k)
    batch, length, vocab = logits.shape
    targets = tokens[:, 1:, None]
    if top_k == 1 or (top_k >= vocab and top_p >= 1.0 and min_p <= 0.0):
        # Nothing filtered (or a greedy row): skip the sort over the vocabulary.
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
        chosen = jnp.take_along_axis(logp, targets, axis=-1)[..., 0]
    else:
        flat = logits[:, :-1].reshape(-1, vocab)
        if kept_counts is None:
            tempered, filtered = sampling_log_probs(flat, temperature, top_k, top_p, min_p)
        else:
            counts = jnp.asarray(kept_counts)[:, 1:].reshape(-1)
            # Positions without a sampled token (count 0) filter nothing.
            counts = jnp.where(counts > 0, counts, vocab)
            tempered, filtered = sampling_log_probs(flat, temperature, counts, 1.0, 0.0)
        # top_k only tells greedy rows apart here (a count of 1 is not a greedy row).
        chosen = sampled_token_log_probs(tempered, filtered, targets.reshape(-1), top_k)
        chosen = chosen.reshape(batch, length - 1)
    chosen = jnp.concatenate([jnp.zeros((batch, 1), jnp.float32), chosen], axis=1)
    return jnp.where(completion_mask, chosen, 0.0)
