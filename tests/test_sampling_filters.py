"""Sampled first tokens follow the truncated softmax of the model's own logits: temperature,
top_k, top_p and min_p checked against the Flax model (models/qwen_flax.py) for one prompt."""

import jax.numpy as jnp
import numpy as np
import pytest

from models import QwenConfig, QwenForCausalLM
from rollout import RolloutWorker
from tests.helpers import tiny_worker_config
from trainer_bridge import load_hf_params

PROMPT = [5, 17, 42, 8, 100, 3]
ROWS = 1000
# Each frequency is a mean of 1000 draws: its standard deviation is at most 0.016, so 0.065 is
# over 4 standard deviations; a filter that lets a wrong token through or a distribution
# flattened towards uniform misses by far more (and a token outside the allowed set fails outright).
TOLERANCE = 0.065
TEMPERATURE = 0.5


@pytest.fixture(scope="module")
def worker(qwen2_dir):
    # The tiny config's 16 running requests: much larger sampled batches on 4 fake CPU devices
    # can stall a collective while the sampler's host callback sorts (XLA then aborts).
    with RolloutWorker(tiny_worker_config(qwen2_dir)) as w:
        yield w


@pytest.fixture(scope="module")
def probs(qwen2_dir):
    """softmax(logits / TEMPERATURE) of the next token after PROMPT, from the Flax model, sorted
    by probability (descending) as (token ids, probabilities)."""
    model = QwenForCausalLM(QwenConfig.from_hf(qwen2_dir))
    tokens = jnp.asarray([PROMPT])
    logits = model.apply({"params": load_hf_params(qwen2_dir)}, tokens, jnp.ones_like(tokens, dtype=bool))[0, -1]
    p = np.asarray(softmax(np.asarray(logits, np.float64) / TEMPERATURE))
    order = np.argsort(-p, kind="stable")
    return order, p[order]


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def sampled_frequencies(worker, vocab, **filters):
    batch = worker.generate([PROMPT], n=ROWS, temperature=TEMPERATURE, max_new_tokens=1, ignore_eos=True, seed=11, **filters)
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
