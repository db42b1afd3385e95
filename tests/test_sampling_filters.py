"""Sampled first tokens follow the truncated softmax of the model's own logits: temperature,
top_k, top_p and min_p checked against the Flax model (models/decoder_flax.py) for one prompt."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import CausalLM, DecoderConfig
from rollout import RolloutWorker
from rollout.engine import draw, patches
from tests.helpers import tiny_worker_config
from trainer_bridge import load_hf_params

# Jitted, as the engine's sampler runs them: op by op, their reductions dispatch (and compile)
# hundreds of small programs.
draw_tokens = jax.jit(draw.draw_tokens)
keyed_uniforms = jax.jit(draw.keyed_uniforms)

PROMPT = [5, 17, 42, 8, 100, 3]
ROWS = 1000
# Each frequency is a mean of 1000 draws: its standard deviation is at most 0.016, so 0.065 is
# over 4 standard deviations; a filter that lets a wrong token through or a distribution
# flattened towards uniform misses by far more (and a token outside the allowed set fails outright).
TOLERANCE = 0.065
TEMPERATURE = 0.5


@pytest.fixture(scope="module")
def worker(qwen2_dir):
    # The tiny config's 16 running requests: the test's batches stay small on a 2-core CPU.
    with RolloutWorker(tiny_worker_config(qwen2_dir)) as w:
        yield w


@pytest.fixture(scope="module")
def probs(qwen2_dir):
    """softmax(logits / TEMPERATURE) of the next token after PROMPT, from the Flax model, sorted
    by probability (descending) as (token ids, probabilities)."""
    model = CausalLM(DecoderConfig.from_hf(qwen2_dir))
    tokens = jnp.asarray([PROMPT])
    logits = jax.jit(model.apply)({"params": load_hf_params(qwen2_dir)}, tokens, jnp.ones_like(tokens, dtype=bool))[
        0, -1
    ]
    p = np.asarray(softmax(np.asarray(logits, np.float64) / TEMPERATURE))
    order = np.argsort(-p, kind="stable")
    return order, p[order]


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def sampled_frequencies(worker, vocab, **filters):
    batch = worker.generate(
        [PROMPT], n=ROWS, temperature=TEMPERATURE, max_new_tokens=1, ignore_eos=True, seed=11, **filters
    )
    first = np.array([c[0] for c in batch.completions])
    return np.bincount(first, minlength=vocab) / ROWS


def check(freq, order, kept):
    """``kept`` (probabilities in ``order``, zero where filtered) renormalised against ``freq``."""
    expected = np.zeros_like(freq)
    expected[order] = kept / kept.sum()
    allowed = set(order[kept > 0].tolist())
    leaked = sorted(set(np.flatnonzero(freq).tolist()) - allowed)
    assert not leaked, f"tokens outside the allowed set were sampled: {leaked}"
    np.testing.assert_allclose(freq, expected, atol=TOLERANCE)


def test_temperature_sampling_follows_the_softmax(worker, probs):
    order, p = probs
    # The distribution is far from uniform (else this would not test much).
    assert p[0] > 0.1 and p[0] > 10 / len(p)
    check(sampled_frequencies(worker, len(p)), order, p)


def test_top_k_keeps_the_k_most_likely(worker, probs):
    order, p = probs
    k = 3
    assert p[k - 1] - p[k] > 1e-3, "k-th and (k+1)-th token must be distinguishable"
    check(sampled_frequencies(worker, len(p), top_k=k), order, np.where(np.arange(len(p)) < k, p, 0.0))


def test_top_p_keeps_the_smallest_prefix_reaching_p(worker, probs):
    order, p = probs
    # Kept: sorted tokens whose preceding mass is <= top_p. top_p halfway between two prefix
    # sums keeps exactly the first `keep` tokens, whatever rounding the engine does.
    keep = 4
    before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
    top_p = float((before[keep - 1] + before[keep]) / 2)
    check(sampled_frequencies(worker, len(p), top_p=top_p), order, np.where(np.arange(len(p)) < keep, p, 0.0))


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely(worker, probs):
    order, p = probs
    keep = 5
    ratio = p / p[0]
    min_p = float((ratio[keep - 1] + ratio[keep]) / 2)
    check(sampled_frequencies(worker, len(p), min_p=min_p), order, np.where(ratio >= min_p, p, 0.0))


@pytest.mark.parametrize("vocab", [7, 100, 1500])
def test_inverse_cdf_draw_gives_each_token_its_probability(vocab):
    """Stratified quantiles (i + 0.5) / N land on each token N x p times, +-1: the exact
    distribution, with excluded (-inf) tokens and the padding of the last block never drawn."""
    rng = np.random.default_rng(vocab)
    log_probs = rng.normal(0.0, 2.0, (2, vocab))
    log_probs[:, rng.random(vocab) < 0.3] = -np.inf
    log_probs[:, 0] = 0.0
    draws = 4000
    uniforms = (np.arange(draws) + 0.5) / draws
    for row in log_probs:
        tokens = np.asarray(draw_tokens(jnp.tile(jnp.asarray(row, jnp.float32), (draws, 1)), jnp.asarray(uniforms)))
        counts = np.bincount(tokens, minlength=vocab)
        assert len(counts) == vocab
        p = softmax(row)
        np.testing.assert_array_less(np.abs(counts - draws * p), 2.0)
        assert not counts[~np.isfinite(row)].any()


def test_keyed_draw_is_the_same_whatever_the_batch():
    rng = np.random.default_rng(0)
    log_probs = jnp.asarray(rng.normal(0.0, 1.0, (6, 3000)), jnp.float32)
    seeds, positions = jnp.arange(6) * 7919, jnp.arange(6) + 3
    whole = draw_tokens(log_probs, keyed_uniforms(seeds, positions))
    parts = [draw_tokens(log_probs[i : i + 3], keyed_uniforms(seeds[i : i + 3], positions[i : i + 3])) for i in (0, 3)]
    np.testing.assert_array_equal(whole, np.concatenate(parts))
    again = draw_tokens(log_probs, keyed_uniforms(seeds, positions + 1))
    assert (np.asarray(again) != np.asarray(whole)).any(), "another position draws afresh"


def test_rows_draw_the_same_whether_or_not_another_row_filters():
    """The engine's sampler reads unfiltered batches in two passes and filtered ones through the
    shared filters: a row that does not filter gets the same token and log-prob either way, a
    greedy row its argmax with the log-prob and count of a batch where nothing filters (it kept
    one token, with log-prob 0, beside a filtering row), a filtering row a token inside its
    filter."""
    rng = np.random.default_rng(3)
    rows, vocab = 6, 3000
    logits = jnp.asarray(rng.normal(0.0, 3.0, (rows, vocab)), jnp.float32)
    seeds, positions = jnp.arange(rows) * 31, jnp.full(rows, 5)
    temperatures = jnp.full(rows, 0.8)

    def sample(top_ks, top_ps):
        operands = (
            logits,
            temperatures,
            jnp.asarray(top_ks),
            jnp.asarray(top_ps, jnp.float32),
            jnp.zeros(rows),
            seeds,
            positions,
            None,
        )
        return map(np.asarray, jax.jit(patches._draw_with_logprobs)(operands))

    everything = [2**30] * rows
    plain_ids, plain_logps, plain_kept = sample(everything, [1.0] * rows)
    mixed_ids, mixed_logps, mixed_kept = sample([2**30, 1, 2**30, 2**30, 2**30, 20], [1.0, 1.0, 1.0, 0.5, 1.0, 1.0])
    assert (plain_kept == vocab).all() and (mixed_kept[[0, 2, 4]] == vocab).all() and mixed_kept[5] == 20
    free = [0, 2, 4]
    np.testing.assert_array_equal(mixed_ids[free], plain_ids[free])
    np.testing.assert_allclose(mixed_logps[free], plain_logps[free], atol=1e-5)
    reference = jax.nn.log_softmax(logits / 0.8, axis=-1)
    np.testing.assert_allclose(
        plain_logps, np.take_along_axis(np.asarray(reference), plain_ids[:, None], 1)[:, 0], atol=1e-5
    )
    assert mixed_ids[1] == int(jnp.argmax(logits[1]))
    assert mixed_kept[1] == vocab
    np.testing.assert_allclose(mixed_logps[1], reference[1, mixed_ids[1]], atol=1e-5)
    assert mixed_ids[5] in np.argsort(-np.asarray(logits[5]))[:20]
    order = np.argsort(-np.asarray(reference[3]))
    kept = order[: np.searchsorted(np.cumsum(np.exp(np.asarray(reference[3])[order])), 0.5) + 1]
    assert mixed_ids[3] in kept and mixed_kept[3] == len(kept)
