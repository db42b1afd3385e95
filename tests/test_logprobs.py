"""Engine log-probs against the Flax trainer's, the consistency check, and what it catches."""

import dataclasses

import jax
import numpy as np
import pytest

from models import CausalLM, DecoderConfig, completion_log_probs, sampling_log_probs
from models.logprobs import PRESELECT
from rollout import ConsistencyError, InvalidRequest, RolloutWorker, SamplingParams, counting_compiles
from tests.helpers import tiny_worker_config
from trainer_bridge import SyncError, flatten_params, load_hf_params, unflatten_params

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11]]


def reference_log_probs(logits, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0):
    """Plain numpy: temperature, top-k, top-p (mass before a token <= top_p), min-p, renormalize."""
    logits = np.asarray(logits, np.float64) / temperature
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    out = np.full_like(logp, -np.inf)
    for row, values in enumerate(logp):
        order = np.argsort(-values, kind="stable")
        probs = np.exp(values[order])
        keep = np.ones(len(values), dtype=bool)
        if top_k is not None:
            keep[top_k:] = False
        if top_p < 1.0:  # at 1.0 the running sum's rounding must not drop the tail
            keep &= (np.cumsum(probs) - probs) <= top_p
        keep &= probs >= probs[0] * min_p
        kept = order[keep]
        out[row, kept] = values[kept] - np.logaddexp.reduce(values[kept])
    return out


def trainer_reference(model_dir, params, batch, **sampling):
    """Log-probs of the batch's completion tokens from the Flax model, by the numpy reference.

    Where the sampling filters and the engine reported its kept counts, the reference keeps
    that many tokens (as a trainer given ``kept_counts`` does), after checking that the count
    is the one its own cut gives, or off only at a boundary that float rounding can move."""
    logits = np.asarray(
        jax.jit(CausalLM(DecoderConfig.from_hf(model_dir)).apply)(
            {"params": params}, batch.tokens, batch.attention_mask, batch.positions
        )
    )
    filters = sampling.get("top_p", 1.0) < 1.0 or sampling.get("top_k") is not None or sampling.get("min_p", 0.0) > 0
    expected = np.zeros(batch.tokens.shape, np.float32)
    for row, col in zip(*np.nonzero(batch.completion_mask)):
        position_logits = logits[row, col - 1][None]
        logp = reference_log_probs(position_logits, **sampling)[0]
        if filters and batch.kept_counts is not None:
            kept = int(batch.kept_counts[row, col])
            assert_count_within_rounding(position_logits[0], kept, np.isfinite(logp).sum(), **sampling)
            logp = reference_log_probs(position_logits, temperature=sampling.get("temperature", 1.0), top_k=kept)[0]
        expected[row, col] = logp[batch.tokens[row, col]]
    return expected


def assert_count_within_rounding(logits, engine_count, reference_count, temperature=1.0, top_p=1.0, **_):
    """The engine's kept count is the reference's, or the top-p mass before one of the tokens
    between them is within float32 rounding of top_p."""
    if engine_count == reference_count:
        return
    values = np.sort(np.asarray(logits, np.float64) / temperature)[::-1]
    probs = np.exp(values - np.logaddexp.reduce(values))
    mass_before = np.cumsum(probs) - probs
    lo, hi = sorted((engine_count, reference_count))
    assert np.abs(mass_before[lo:hi] - top_p).min() < 1e-5, (engine_count, reference_count)


def assert_filtered_like_reference(logits, case):
    """sampling_log_probs keeps the reference's tokens with its log-probs; returns the reference."""
    _, filtered = sampling_log_probs(
        logits, case["temperature"], case.get("top_k", 2**30), case.get("top_p", 1.0), case.get("min_p", 0.0)
    )
    expected = reference_log_probs(logits, **case)
    np.testing.assert_array_equal(np.isfinite(filtered), np.isfinite(expected), err_msg=str(case))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(np.asarray(filtered)[finite], expected[finite], atol=1e-5, err_msg=str(case))
    return expected


def test_the_engines_kept_count_decides_the_trainers_top_p_boundary():
    """Engine and trainer logits differing in their last digits put the top-p boundary on either
    side of a token: cut afresh, the trainer's log-prob is off by the log of that token's mass;
    given the engine's kept count it keeps the same tokens and agrees."""
    probs = np.array([0.5, 0.4, 0.06, 0.04])
    engine_logits = np.log(probs).astype(np.float32)
    engine_logits[1] -= 2e-5  # the mass before token 2 just under 0.9: the engine keeps it
    trainer_logits = np.log(probs).astype(np.float32)
    trainer_logits[1] += 2e-5  # ... just over: a fresh cut drops it
    tempered, filtered = sampling_log_probs(engine_logits[None], 1.0, 2**30, 0.9, 0.0)
    engine_count = int(np.isfinite(np.asarray(filtered)).sum())
    assert engine_count == 3
    engine_logprob = float(filtered[0, 0])

    tokens = np.array([[3, 0]])  # column 0 predicts token 0 at column 1
    completion = np.array([[False, True]])
    logits = np.stack([trainer_logits, np.zeros(4, np.float32)])[None]
    afresh = completion_log_probs(logits, tokens, completion, top_p=0.9)
    with_count = completion_log_probs(logits, tokens, completion, top_p=0.9, kept_counts=np.array([[0, engine_count]]))
    assert abs(float(afresh[0, 1]) - engine_logprob) > 0.05  # log(0.96 / 0.9)
    assert abs(float(with_count[0, 1]) - engine_logprob) < 1e-4
    # A count of 1 is a filtering row (log-prob 0), not a greedy one.
    one = completion_log_probs(logits, tokens, completion, top_p=0.4, kept_counts=np.array([[0, 1]]))
    assert float(one[0, 1]) == 0.0


def test_sampling_log_probs_match_a_plain_reference():
    logits = np.asarray(jax.random.normal(jax.random.key(0), (6, 50)) * 3.0)
    cases = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.3, top_k=7),
        dict(temperature=0.5, min_p=0.05),
        dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.01),
    ]
    for case in cases:
        assert_filtered_like_reference(logits, case)


@pytest.mark.parametrize(
    "case",
    [
        dict(temperature=0.5, top_p=0.6),  # kept tokens fit in the preselection
        dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.001),
        dict(temperature=3.0, top_p=0.99),  # flat rows: the kept mass needs more than PRESELECT
        dict(temperature=3.0, top_k=1500),
        dict(temperature=1.0, top_k=PRESELECT),
    ],
    ids=["fits", "all-filters", "past-preselection", "top-k-past", "top-k-at"],
)
def test_preselected_filters_equal_the_full_sort_reference(case):
    # Rows of different spread in one batch: a row past the preselection takes the others along.
    vocab = 2000
    scales = np.array([8.0, 3.0, 1.0, 0.2])[:, None]
    logits = np.asarray(jax.random.normal(jax.random.key(1), (4, vocab))) * scales
    expected = assert_filtered_like_reference(logits, case)
    if case.get("top_p") == 0.99:
        assert np.isfinite(expected).sum(axis=-1).max() > PRESELECT, "the case must exceed the preselection"


@pytest.mark.parametrize("with_top_k_past", [False, True], ids=["top-k-read", "top-k-searched"])
def test_a_row_past_the_preselection_leaves_every_other_row_exact(with_top_k_past):
    """Row 0's top-p needs more than PRESELECT tokens, so the batch takes the bisection path:
    rows with a top-k inside the preselection (a greedy padding row too), with none, or (second
    case) past it keep exactly the reference's tokens, each with its own parameters."""
    rows = [
        dict(temperature=3.0, top_p=0.99),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.0, top_k=1),
        dict(temperature=0.7, top_k=30, top_p=0.9),
        dict(temperature=1.0),
    ]
    if with_top_k_past:
        rows.append(dict(temperature=1.0, top_k=1500, top_p=0.95))
    scales = np.array([0.2, 3.0, 3.0, 1.0, 8.0, 0.5][: len(rows)])[:, None]
    logits = np.asarray(jax.random.normal(jax.random.key(2), (len(rows), 2000))) * scales
    defaults = dict(temperature=1.0, top_k=2**30, top_p=1.0, min_p=0.0)
    _, filtered = sampling_log_probs(logits, *(np.array([r.get(k, d) for r in rows]) for k, d in defaults.items()))
    for row, case in enumerate(rows):
        expected = reference_log_probs(logits[row : row + 1], **case)[0]
        np.testing.assert_array_equal(np.isfinite(filtered[row]), np.isfinite(expected), err_msg=str(case))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(np.asarray(filtered[row])[finite], expected[finite], atol=1e-5, err_msg=str(case))
    assert np.isfinite(reference_log_probs(logits[:1], **rows[0])).sum() > PRESELECT, (
        "row 0 must exceed the preselection"
    )


MODELS = [("qwen2_dir", 1), ("qwen2_untied_dir", 1), ("qwen3_dir", 1), ("qwen2_dir", 2), ("qwen3_dir", 2)]
SAMPLING = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)]


@pytest.fixture(scope="module", params=MODELS, ids=[f"{m.removesuffix('_dir')}-tp{tp}" for m, tp in MODELS])
def synced(request):
    """A float32 engine serving the trainer's params (synced from the HF weights)."""
    model_fixture, tp_size = request.param
    model_dir = request.getfixturevalue(model_fixture)
    params = load_hf_params(model_dir)
    with RolloutWorker(tiny_worker_config(model_dir, tp_size=tp_size, load_format="dummy")) as worker:
        worker.sync_params(params)
        yield worker, model_dir, params


@pytest.mark.parametrize("sampling", SAMPLING, ids=["t1", "t0.7-p0.9"])
def test_engine_log_probs_equal_the_trainers(synced, sampling):
    worker, model_dir, params = synced
    batch = worker.generate(PROMPTS, n=2, max_new_tokens=8, ignore_eos=True, seed=5, return_logprobs=True, **sampling)
    assert batch.logprobs.shape == batch.tokens.shape and batch.logprobs.dtype == np.float32
    assert (batch.logprobs[~batch.completion_mask] == 0).all()
    assert (batch.logprobs[batch.completion_mask] < 0).all()
    vocab = worker.vocab_size
    assert batch.kept_counts.shape == batch.tokens.shape
    assert (batch.kept_counts[~batch.completion_mask] == 0).all()
    kept = batch.kept_counts[batch.completion_mask]
    if "top_p" in sampling:
        assert (kept >= 1).all() and (kept < vocab).any()
    else:
        assert (kept == vocab).all()
    expected = trainer_reference(model_dir, params, batch, **sampling)
    np.testing.assert_allclose(batch.logprobs, expected, atol=1e-4)

    report = worker.check_consistency(params, PROMPTS, n=2, max_new_tokens=8, atol=1e-4, **sampling)
    assert report.tokens > 0 and report.max_abs_diff < 1e-4 and abs(report.kl) < 1e-6


def test_greedy_rows_report_the_temperature_one_log_prob(synced):
    worker, model_dir, params = synced
    batch = worker.generate(PROMPTS, max_new_tokens=6, ignore_eos=True, temperature=0.0, return_logprobs=True)
    np.testing.assert_allclose(batch.logprobs, trainer_reference(model_dir, params, batch), atol=1e-4)
    # Batched with sampled requests (the engine's non-greedy branch), a greedy request keeps
    # its tokens and its temperature-1 log-probs.
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0, return_logprobs=True)
    sampled = dataclasses.replace(greedy, temperature=0.7, top_p=0.9)
    seeds = np.ones((1, 1), np.int64)
    engine = worker.engine
    # Submitted together, the two requests run in one engine batch.
    futures = [engine.submit(PROMPTS[:1], greedy, seeds), engine.submit(PROMPTS[1:2], sampled, seeds)]
    outputs = [future.result()[0] for future in futures]
    assert outputs[0].output_ids == batch.completions[0]
    np.testing.assert_allclose(outputs[0].logprobs, batch.logprobs[0, batch.prompt_width :], atol=1e-5)


def test_a_non_finite_trainer_tree_is_named_not_reported_as_a_mismatch(synced):
    """It read "max |Δ log p| = nan ... check the weight mapping and dtypes"."""
    worker, _, params = synced
    flat = flatten_params(params)
    path = next(p for p in flat if p.endswith("mlp.down_proj.kernel"))
    broken = np.array(flat[path], copy=True)
    broken[0, 0] = np.nan
    with pytest.raises(ConsistencyError, match=rf"not finite at \d+ of \d+ completion tokens .*NaN or inf at {path}"):
        worker.check_consistency(unflatten_params({**flat, path: broken}), PROMPTS, max_new_tokens=4, atol=1e-4)
    # Finite but other params: under top-k the trainer gives some sampled tokens no probability
    # (-inf), a mismatch of weights, not an overflow.
    other = {**flat, path: flat[path] * 50.0}
    with pytest.raises(ConsistencyError, match=r"train-inference mismatch: max \|Δ log p\| = inf .*weight mapping"):
        worker.check_consistency(unflatten_params(other), PROMPTS, n=4, max_new_tokens=8, top_k=3, atol=1e-4)


def test_temperatures_the_engine_runs_greedy_report_greedy_log_probs(synced):
    """The engine runs a temperature below 1e-6 as greedy: its rows report what greedy rows
    report, which the trainer's recompute at that temperature gives too; a top_k past int32
    keeps every token (the engine's batch array is int32)."""
    worker, model_dir, params = synced
    options = dict(max_new_tokens=6, ignore_eos=True, return_logprobs=True, seed=3)
    greedy = worker.generate(PROMPTS, temperature=0.0, **options)
    tiny = worker.generate(PROMPTS, temperature=1e-7, **options)
    assert tiny.completions == greedy.completions
    # Up to fp32 rounding: the second call finds the prompts cached and prefills their last token
    # alone (1 ulp apart at jax 0.8); temperature 1's log-probs would be ~0.1 away.
    np.testing.assert_allclose(tiny.logprobs, greedy.logprobs, rtol=0, atol=1e-5)
    report = worker.check_consistency(params, PROMPTS, max_new_tokens=6, temperature=1e-7, atol=1e-4)
    assert report.max_abs_diff < 1e-4
    every = worker.generate(PROMPTS, temperature=0.8, top_k=-1, **options)
    past_int32 = worker.generate(PROMPTS, temperature=0.8, top_k=2**31, **options)
    assert past_int32.completions == every.completions
    np.testing.assert_allclose(past_int32.logprobs, every.logprobs, rtol=0, atol=1e-5)
    assert worker.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=2).size == 1  # the engine lives


def test_bfloat16_engine_against_float32_trainer(qwen2_dir):
    """Weights rounded to bf16 and bf16 compute give a small, nonzero mismatch."""
    params = load_hf_params(qwen2_dir)
    with RolloutWorker(tiny_worker_config(qwen2_dir, dtype="bfloat16", load_format="dummy")) as worker:
        worker.sync_params(params)
        report = worker.check_consistency(params, PROMPTS, n=4, max_new_tokens=16, atol=BF16_MAX_ABS_DIFF)
        with pytest.raises(ConsistencyError, match=r"max \|Δ log p\| = .* exceeds 0.0001"):
            worker.check_consistency(params, PROMPTS, n=4, max_new_tokens=16, atol=1e-4)
        # Every sampled token is compared (rows that drew EOS stop early: the same seed's batch).
        sampled = worker.generate(PROMPTS, n=4, max_new_tokens=16, temperature=1.0, seed=0)
    assert report.tokens == int(sampled.completion_mask.sum()) > 3 * 4 * 8
    assert 1e-3 < report.mean_abs_diff < BF16_MEAN_ABS_DIFF
    assert report.max_abs_diff < BF16_MAX_ABS_DIFF and 0 < report.kl < BF16_KL


# Bounds for the tiny bf16 engine against its fp32 trainer (measured figures: docs/benchmarks.md#log-probs).
BF16_MEAN_ABS_DIFF = 0.05
BF16_MAX_ABS_DIFF = 0.25
BF16_KL = 1e-3


@pytest.fixture(scope="module")
def untied(qwen2_untied_dir):
    params = load_hf_params(qwen2_untied_dir)
    with RolloutWorker(tiny_worker_config(qwen2_untied_dir, load_format="dummy")) as worker:
        worker.sync_params(params)
        yield worker, params


def test_log_probs_on_or_off_compile_nothing_new(untied):
    worker, _ = untied
    kwargs = dict(n=2, max_new_tokens=6, ignore_eos=True, temperature=1.0)
    worker.generate(PROMPTS, **kwargs)
    worker.generate(PROMPTS, **kwargs)
    with counting_compiles() as compiles:
        on = worker.generate(PROMPTS, return_logprobs=True, **kwargs)
        off = worker.generate(PROMPTS, **kwargs)
    assert compiles.value == 0 and on.compiles == 0 and off.compiles == 0
    assert off.logprobs is None and on.logprobs is not None


def swap_k_v(flat):
    flat = dict(flat)
    layer = "model.layers_1.self_attn"
    for leaf in ("kernel", "bias"):
        flat[f"{layer}.k_proj.{leaf}"], flat[f"{layer}.v_proj.{leaf}"] = (
            flat[f"{layer}.v_proj.{leaf}"],
            flat[f"{layer}.k_proj.{leaf}"],
        )
    return flat


def transpose_o_proj(flat):
    key = "model.layers_0.self_attn.o_proj.kernel"
    assert flat[key].shape[0] == flat[key].shape[1], "the test needs a square o_proj"
    return {**flat, key: flat[key].T}


def lm_head_from(other_dir):
    def corrupt(flat):
        other = flatten_params(load_hf_params(other_dir))
        return {**flat, "lm_head.kernel": other["model.embed_tokens.embedding"].T}

    return corrupt


@pytest.mark.parametrize("corrupt", ["k-v-swapped", "o-proj-transposed", "lm-head-of-another-model"])
def test_wrong_mappings_that_shapes_cannot_catch_are_caught(untied, qwen2_dir, corrupt):
    worker, params = untied
    flat = flatten_params(params)
    bad = {
        "k-v-swapped": swap_k_v,
        "o-proj-transposed": transpose_o_proj,
        "lm-head-of-another-model": lm_head_from(qwen2_dir),
    }[corrupt](flat)
    worker.sync_params(unflatten_params(bad))  # every shape and dtype fits: the sync succeeds
    try:
        with pytest.raises(ConsistencyError, match=r"max \|Δ log p\| = .* exceeds 0.001") as error:
            worker.check_consistency(params, PROMPTS, n=2, max_new_tokens=8)
        assert error.value.report.max_abs_diff > 0.01
    finally:
        worker.sync_params(params)
    assert worker.check_consistency(params, PROMPTS, n=2, max_new_tokens=8).max_abs_diff < 1e-4


def test_other_statistics_name_themselves(untied):
    worker, params = untied
    with pytest.raises(ConsistencyError, match=r"mean \|Δ log p\| = .* exceeds 0"):
        worker.check_consistency(params, PROMPTS, max_new_tokens=4, mean_atol=0.0)
    report = worker.check_consistency(params, PROMPTS, n=2, max_new_tokens=4, worst=3)
    assert len(report.worst) == 3
    diffs = [abs(w.engine - w.trainer) for w in report.worst]
    assert diffs == sorted(diffs, reverse=True) and diffs[0] == pytest.approx(report.max_abs_diff, abs=1e-7)
    # No worst positions asked for: the statistic is still named (it once raised AttributeError).
    with pytest.raises(ConsistencyError, match=r"mean \|Δ log p\| = .* exceeds 0 over \d+ tokens; the engine"):
        worker.check_consistency(params, PROMPTS, max_new_tokens=4, mean_atol=0.0, worst=0)


@pytest.mark.parametrize(
    "kwargs, field", [(dict(worst=-1), "worst"), (dict(atol=float("nan")), "atol"), (dict(max_kl="0.1"), "max_kl")]
)
def test_bad_consistency_arguments_are_named(untied, kwargs, field):
    worker, params = untied
    with pytest.raises(InvalidRequest) as error:
        worker.check_consistency(params, PROMPTS, max_new_tokens=4, **kwargs)
    assert error.value.field == field


def test_consistency_takes_the_trees_a_sync_takes_and_names_a_bad_one_by_path(untied):
    worker, params = untied
    flat = flatten_params(params)
    assert worker.check_consistency(flat, PROMPTS, max_new_tokens=4).max_abs_diff < 1e-4  # dotted paths
    missing = {k: v for k, v in flat.items() if k != "model.norm.scale"}
    with pytest.raises(SyncError, match=r"missing 1 expected path\(s\): model\.norm\.scale"):
        worker.check_consistency(missing, PROMPTS, max_new_tokens=4)
    bad_shape = {**flat, "model.norm.scale": flat["model.norm.scale"][:-1]}
    with pytest.raises(SyncError, match=r"'model\.norm\.scale' has shape"):
        worker.check_params(bad_shape)


def test_chunked_prefill_keeps_log_probs_aligned(qwen3_dir):
    """A prompt prefilled in several chunks gets no log-prob for the chunks before the last."""
    params = load_hf_params(qwen3_dir)
    config = tiny_worker_config(qwen3_dir, load_format="dummy", chunked_prefill_size=16, max_prefill_tokens=16)
    long_prompts = [list(range(3, 43)), [7, 8, 9]]
    with RolloutWorker(config) as worker:
        worker.sync_params(params)
        report = worker.check_consistency(params, long_prompts, n=2, max_new_tokens=6, atol=1e-4)
    assert report.tokens > 0 and report.max_abs_diff < 1e-4
