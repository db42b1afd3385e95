"""RolloutWorker.generate on a tiny Qwen2 (with tokenizer) and a tiny Qwen3 (token ids only)."""

import asyncio
import dataclasses
import json
import shutil
import threading
import time

import numpy as np
import pytest

from rollout import InvalidRequest, RolloutWorker, SamplingParams
from rollout.engine import profile_steps, stubbed_device
from tests.helpers import tiny_worker_config

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11]]


@pytest.fixture(scope="module")
def worker(qwen2_dir):
    with RolloutWorker(tiny_worker_config(qwen2_dir)) as w:
        yield w


def test_greedy_is_deterministic(worker):
    first = worker.generate(PROMPTS, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    second = worker.generate(PROMPTS, temperature=0.0, max_new_tokens=12, ignore_eos=True, n=2)
    assert all(len(c) == 12 for c in first.completions)
    assert second.completions[0::2] == first.completions
    assert second.completions[1::2] == first.completions
    # A random model does not emit a constant: greedy decoding really ran the model.
    assert len({tuple(c) for c in first.completions}) == len(PROMPTS)


def test_temperature_sampling_is_fresh_per_call_and_repeats_with_a_seed(worker):
    kwargs = dict(temperature=1.0, max_new_tokens=12, ignore_eos=True, n=4)
    a = worker.generate(PROMPTS, **kwargs)
    b = worker.generate(PROMPTS, **kwargs)
    assert a.completions != b.completions
    c = worker.generate(PROMPTS, seed=1234, **kwargs)
    d = worker.generate(PROMPTS, seed=1234, **kwargs)
    assert c.completions == d.completions
    np.testing.assert_array_equal(c.seeds, d.seeds)
    e = worker.generate(PROMPTS, seed=1235, **kwargs)
    assert e.completions != c.completions


def test_seeded_samples_do_not_depend_on_batch_composition(worker):
    kwargs = dict(temperature=1.0, max_new_tokens=10, ignore_eos=True, n=3, seed=77)
    alone = worker.generate(PROMPTS[:1], **kwargs)
    together = worker.generate(PROMPTS[:1] + [[9, 9, 9]], **kwargs)
    assert together.completions[:3] == alone.completions


def test_n_samples_per_prompt_are_independent_and_prompt_major(worker):
    batch = worker.generate(PROMPTS, n=5, temperature=1.0, max_new_tokens=10, ignore_eos=True)
    assert batch.size == 15 and batch.n == 5
    np.testing.assert_array_equal(batch.prompt_index, np.repeat([0, 1, 2], 5))
    for p in range(3):
        group = {tuple(c) for c in batch.completions[5 * p : 5 * p + 5]}
        assert len(group) == 5, "samples of one prompt must differ"
    assert len(set(batch.seeds.tolist())) == 15


def test_padded_arrays_line_up_with_the_token_lists(worker):
    batch = worker.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=8, ignore_eos=True)
    width = batch.prompt_width
    assert width == max(len(p) for p in PROMPTS)
    assert batch.tokens.shape == (6, width + 8)
    for row in range(batch.size):
        prompt = PROMPTS[batch.prompt_index[row]]
        completion = batch.completions[row]
        assert batch.tokens[row, width - len(prompt) : width].tolist() == prompt
        assert batch.tokens[row, width : width + len(completion)].tolist() == completion
        assert batch.completion_mask[row].sum() == len(completion)
        assert batch.attention_mask[row].sum() == len(prompt) + len(completion)
        real = batch.positions[row][batch.attention_mask[row]]
        assert real.tolist() == list(range(len(prompt) + len(completion)))
    assert not (batch.completion_mask & ~batch.attention_mask).any()


def test_string_prompts_and_texts(worker):
    batch = worker.generate(["12+34=", "hello world"], temperature=0.0, max_new_tokens=6)
    tokenizer = worker.tokenizer
    assert batch.prompts[0] == tokenizer.encode("12+34=", add_special_tokens=False)
    assert batch.completion_texts == [tokenizer.decode(c, skip_special_tokens=True) for c in batch.completions]


def test_stop_token_ends_the_completion(worker):
    free = worker.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=12, ignore_eos=True)
    stop = free.completions[0][3]
    first = free.completions[0].index(stop)
    batch = worker.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=12, stop_token_ids=[stop])
    assert batch.completions[0] == free.completions[0][: first + 1]
    assert batch.finish_reasons == ["stop"]
    assert free.finish_reasons == ["length"]


# Every case is checked without an engine in tests/unit/test_sampling.py; these check that the
# worker validates with its engine's own limits.
@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([[1, 2], []], {}, r"prompts\[1\] is empty"),
        ([[1, 2, 999999]], {}, r"prompts\[0\] has token ids outside"),
        ([list(range(1, 250))], {"max_new_tokens": 64}, r"313 tokens do not fit the context length 256"),
        ([list(range(1, 300))], {}, "the engine accepts prompts of at most"),
        ([[1, 2]], {"temperature": float("nan")}, "temperature must be finite"),
        ([[1, 2]], {"stop_token_ids": [10**7]}, r"stop_token_ids\[0\] = 10000000 is outside"),
    ],
)
def test_bad_input_is_a_clear_invalid_request(worker, prompts, kwargs, message):
    # InvalidRequest (a ValueError): what the server maps to a 400 and callers catch by type.
    with pytest.raises(InvalidRequest, match=message):
        worker.generate(prompts, **kwargs)


def test_a_request_that_just_fits_the_context_runs_whole(worker):
    # The largest request the engine takes whole: prompt + completion = context - 2.
    batch = worker.generate([list(range(1, 201))], max_new_tokens=54, temperature=0.0, ignore_eos=True)
    assert len(batch.completions[0]) == 54 and batch.finish_reasons == ["length"]


def test_numpy_integers_are_accepted_everywhere(worker):
    kwargs = dict(
        n=np.int64(2), max_new_tokens=np.int32(4), top_k=np.int64(5), seed=np.uint32(3), ignore_eos=np.bool_(True)
    )
    batch = worker.generate([np.array([5, 17, 42], np.int64)], prompt_offset=np.int64(1), **kwargs)
    plain = worker.generate([[5, 17, 42]], n=2, max_new_tokens=4, top_k=5, seed=3, ignore_eos=True, prompt_offset=1)
    assert batch.completions == plain.completions and batch.size == 2


def test_a_prompt_samples_depend_on_seed_index_and_sample_only(worker):
    kwargs = dict(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=91)
    alone = worker.generate(PROMPTS[:1], n=2, **kwargs)
    others = worker.generate(PROMPTS[:1] + [[9, 9, 9], [4, 4]], n=3, **kwargs)
    # Same prompt at the same index: its first two samples are the same, whatever else runs.
    assert others.completions[:2] == alone.completions
    # The same prompt at index 1 draws other samples (seeds follow the index, documented).
    moved = worker.generate([[9, 9, 9]] + PROMPTS[:1], n=2, **kwargs)
    assert moved.completions[2:] != alone.completions


def test_samples_of_a_prompt_prefill_only_its_last_token(worker):
    """The n samples of a prompt find it in the prefix cache (the engine prefills it once
    first): each prefills one token, not the whole prompt again. That one prefill is the call's:
    every sample reports what the cache held before the call, and the prompt's first row counts
    the prefill, so the rows' prefill_tokens add up to what the call computed."""
    prompts = [[300 + i for i in range(40)], [400 + i for i in range(25)]]  # not cached before
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, n=3)
    outputs = worker.engine.generate(prompts, params, np.arange(6).reshape(2, 3))
    assert [o.cached_tokens for o in outputs] == [0] * 6
    assert [o.prefill_tokens for o in outputs] == [40 + 1, 1, 1, 25 + 1, 1, 1]
    assert [o.completion_tokens for o in outputs] == [4] * 6
    # Extended by 10 tokens: the samples found the 40 cached (and what the call added, less its last token).
    longer = [prompts[0] + [700 + i for i in range(10)]]
    outputs = worker.engine.generate(longer, params, np.arange(3).reshape(1, 3))
    assert [o.cached_tokens for o in outputs] == [40] * 3
    assert [o.prefill_tokens for o in outputs] == [10 + 1, 1, 1]
    single = worker.engine.generate([[500 + i for i in range(30)]], dataclasses.replace(params, n=1), np.zeros((1, 1)))
    assert single[0].cached_tokens == 0 and single[0].prefill_tokens == 30
    twice = [[600 + i for i in range(20)]] * 2  # a prompt given twice: prefilled once, charged once
    outputs = worker.engine.generate(twice, params, np.arange(6).reshape(2, 3))
    assert [o.cached_tokens for o in outputs] == [0] * 6
    assert [o.prefill_tokens for o in outputs] == [20 + 1] + [1] * 5
    batch = worker.generate([[200 + i for i in range(30)]], n=2, max_new_tokens=2, ignore_eos=True, seed=3)
    assert batch.cached_tokens.tolist() == [0, 0] and batch.prefill_tokens.tolist() == [31, 1]

    async def streamed():
        return [
            c
            async for c in worker.astream(
                [[10 + i * 7 % 290 for i in range(30)]], n=2, max_new_tokens=2, ignore_eos=True
            )
        ]

    last = {c.row: c for c in asyncio.run(streamed())}
    assert [last[r].cached_tokens for r in (0, 1)] == [0, 0]


@pytest.fixture(scope="module")
def small_pool_worker(qwen2_dir):
    # KV pool of 128 tokens, context 256: the pool, not the context, limits a request.
    with RolloutWorker(tiny_worker_config(qwen2_dir, max_total_tokens=128)) as w:
        yield w


def test_a_request_larger_than_the_kv_pool_is_an_error(small_pool_worker):
    # 0.0.2 would cut this completion short (finish reason "length") without an error.
    with pytest.raises(ValueError, match=r"140 tokens do not fit the KV cache pool of 128 tokens"):
        small_pool_worker.generate([list(range(1, 41))], max_new_tokens=100)
    # The largest request the pool takes runs whole.
    batch = small_pool_worker.generate([list(range(1, 27))], max_new_tokens=100, ignore_eos=True, temperature=0.0)
    assert len(batch.completions[0]) == 100


def test_a_batch_larger_than_the_kv_pool_returns_every_row_whole(small_pool_worker):
    # 6 rows x (20 + 80) tokens = 600 > 128: the engine queues rows, none is cut short.
    prompts = [list(range(10 + i, 30 + i)) for i in range(3)]
    batch = small_pool_worker.generate(prompts, n=2, temperature=1.0, max_new_tokens=80, ignore_eos=True, seed=5)
    assert [len(c) for c in batch.completions] == [80] * 6
    assert batch.finish_reasons == ["length"] * 6


def test_worker_idles_quietly(worker):
    worker.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=2)
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    time.sleep(2.0)
    busy = (time.process_time() - start_cpu) / (time.perf_counter() - start_wall)
    assert busy < 0.05, f"idle worker used {busy:.1%} of a core"


def test_qwen3_token_ids_only_and_close(qwen3_dir):
    before = {t.ident for t in threading.enumerate()}
    worker = RolloutWorker(tiny_worker_config(qwen3_dir))
    try:
        assert worker.tokenizer is None
        with pytest.raises(ValueError, match="has no tokenizer"):
            worker.generate(["text"])
        greedy = worker.generate(PROMPTS, temperature=0.0, max_new_tokens=8, ignore_eos=True)
        again = worker.generate(PROMPTS, temperature=0.0, max_new_tokens=8, ignore_eos=True)
        assert greedy.completions == again.completions
        assert greedy.completion_texts is None
        # top_k=1 leaves only the most likely token: sampling at temperature 1 is greedy decoding.
        sampled = worker.generate(PROMPTS, n=3, temperature=1.0, top_k=1, max_new_tokens=8, ignore_eos=True)
        assert sampled.completions == [c for c in greedy.completions for _ in range(3)]
        kv_buffers = worker.engine.kv_buffers()
    finally:  # no engine left running into later tests when an assertion fails
        worker.close()
    worker.close()
    assert worker.closed
    # Freed while the worker is still referenced (as a `with` block's name stays bound).
    assert kv_buffers and all(buffer.is_deleted() for buffer in kv_buffers)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("sglang")]
    assert left == []
    with pytest.raises(RuntimeError, match="closed"):
        worker.generate(PROMPTS)


def test_eos_ids_come_from_the_config_and_the_generation_config_and_may_be_0(qwen3_dir, tmp_path):
    """The worker's EOS ids are those the engine ends completions at (the generation config's
    were left out); an EOS id of 0 crashed the engine's start-up (workaround eos-token-id-zero)."""
    model_dir = tmp_path / "eos-0"
    shutil.copytree(qwen3_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    with RolloutWorker(tiny_worker_config(model_dir)) as worker:
        assert worker.eos_token_ids == {0, 7} == set(worker.engine.eos_token_ids)
        batch = worker.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=8, seed=1)
        assert all(r == "length" or c[-1] in (0, 7) for c, r in zip(batch.completions, batch.finish_reasons))


def test_eos_stop_keeps_the_eos_token(worker):
    batch = worker.generate(PROMPTS, n=16, temperature=1.5, max_new_tokens=48, seed=3)
    stopped = [c for c, r in zip(batch.completions, batch.finish_reasons) if r == "stop"]
    assert stopped, "seed 3 gives at least one eos-terminated sample"
    assert all(len(c) > 0 and c[-1] in worker.eos_token_ids for c in stopped)
    assert all(not set(c[:-1]) & worker.eos_token_ids for c in stopped)
    # Same seeds with ignore_eos: identical prefixes, EOS kept mid-sequence, full length
    # (pins the detokenizer-output-ids workaround: 0.0.2 drops such EOS tokens).
    full = worker.generate(PROMPTS, n=16, temperature=1.5, max_new_tokens=48, seed=3, ignore_eos=True)
    assert all(len(c) == 48 for c in full.completions)
    for short, long in zip(batch.completions, full.completions):
        assert long[: len(short)] == short


def test_stop_token_ids_end_a_completion_under_ignore_eos(worker):
    """ignore_eos drops the model's EOS from the stop ids, not the caller's (0.0.2 tested no stop
    id under ignore_eos: the rows ran to max_new_tokens)."""
    greedy = dict(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    full = worker.generate(PROMPTS, **greedy)
    stop = full.completions[0][3]
    stopped = worker.generate(PROMPTS, stop_token_ids=[stop], **greedy)
    for row, completion in enumerate(full.completions):
        end = completion.index(stop) + 1 if stop in completion else len(completion)
        assert stopped.completions[row] == completion[:end]
        assert stopped.finish_reasons[row] == ("stop" if stop in completion else "length")


def test_a_stop_token_sampled_last_ends_as_stop(worker):
    """A completion whose last allowed token is a stop token ended (0.0.2 tested the length
    first and called it "length"), with and without ignore_eos."""
    full = worker.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=16, ignore_eos=True).completions[0]
    last = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    for ignore_eos in (True, False):
        stopped = worker.generate(
            PROMPTS[:1], temperature=0.0, max_new_tokens=last + 1, ignore_eos=ignore_eos, stop_token_ids=[full[last]]
        )
        assert stopped.completions[0] == full[: last + 1]
        assert stopped.finish_reasons == ["stop"], ignore_eos


def test_calls_retracted_in_a_tight_kv_pool_all_return(qwen2_dir):
    """A 128-token pool. First one call of a 20-token prompt given three times, 60 new tokens
    each: the scheduler reserves an admitted row's new tokens, so it admits the first row alone
    (20 + 60), then a second once the prompt is cached (1 + 60); the two rows' 20 + 2 x 60 tokens
    overflow the pool before they end, and decode retracts one (arithmetic, not timing; it needs
    the prefix cache, on by default). Then six calls of 3 rows each at once: which rows are retracted
    depends on how the calls interleave, but every call returns (one retracted after 59 of its
    60 tokens waited forever: 0.0.2 counted its sampled tokens and all 60 new ones). A
    retracted row reports the prompt tokens its first prefill found cached (0.0.2 added the
    second prefill's: more than the prompt has). Rows are one prompt repeated with n=1: with
    n > 1 the rows report what the cache held before the call, which hides the engine's count."""
    lengths = (3, 9, 17, 40, 60, 8)

    async def calls(worker):
        return await asyncio.wait_for(
            asyncio.gather(
                *[
                    worker.agenerate(
                        [list(range(5 + i, 12 + 2 * i))] * 3,
                        temperature=1.0,
                        max_new_tokens=m,
                        ignore_eos=True,
                        seed=i,
                    )
                    for i, m in enumerate(lengths)
                ]
            ),
            timeout=300,  # a regression fails here instead of hanging the suite
        )

    with RolloutWorker(tiny_worker_config(qwen2_dir, max_total_tokens=128)) as worker:
        alone = worker.generate([list(range(5, 25))] * 3, temperature=1.0, max_new_tokens=60, ignore_eos=True)
        batches = asyncio.run(calls(worker))
        assert [[len(c) for c in b.completions] for b in batches] == [[m] * 3 for m in lengths]
        assert worker.engine.testing.kv_tokens_held() == 0
    assert [len(c) for c in alone.completions] == [60] * 3
    # The retracted row was prefilled again: more than its prompt less its cached part.
    assert (alone.prefill_tokens > 20).any(), alone.prefill_tokens
    assert (alone.cached_tokens < 20).all(), alone.cached_tokens
    for batch, length in zip(batches, [7 + i for i in range(len(lengths))]):
        assert (batch.cached_tokens < length).all(), (batch.cached_tokens, length)


def test_a_calls_requests_share_one_prefill_however_slowly_they_are_sent(worker, monkeypatch):
    """The engine's tokenizer manager sends a call's requests one at a time; made to pause
    0.2 s after each (time the idle scheduler has to start on the first), the call still takes
    one prefill and one forward per decode step."""
    from sgl_jax.srt.managers.tokenizer_manager import TokenizerManager

    worker.generate(PROMPTS, temperature=0.0, max_new_tokens=4, ignore_eos=True)  # the scheduler idle, waiting
    send = TokenizerManager._send_one_request

    def slow_send(self, *args, **kwargs):
        state = send(self, *args, **kwargs)
        time.sleep(0.2)
        return state

    monkeypatch.setattr(TokenizerManager, "_send_one_request", slow_send)
    with profile_steps() as times:
        batch = worker.generate(PROMPTS, temperature=0.0, max_new_tokens=4, ignore_eos=True)
    assert [len(c) for c in batch.completions] == [4] * 3
    assert (times.count("extend"), times.count("decode")) == (1, 3)


def test_profile_steps_splits_the_engines_steps(worker):
    with profile_steps() as times:
        worker.generate(PROMPTS, temperature=1.0, max_new_tokens=6, ignore_eos=True)
    decode = times.split("decode")
    # One extend step (the three prompts), five decode steps, the last with no wall time.
    assert times.count("extend") == 1 and decode.steps == times.count("decode") - 1 == 4
    assert 0 < decode.forward_s and 0 < decode.sample_s and decode.host_s > 0


def test_a_stubbed_device_repeats_each_shapes_first_decode_outputs_and_stops_at_exit(worker):
    kwargs = dict(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    real = worker.generate(PROMPTS, **kwargs).completions
    assert any(len(set(c[1:])) > 1 for c in real), "the model must not repeat itself already"
    others = [[token + 1 for token in prompt] for prompt in PROMPTS]
    with stubbed_device():
        first = worker.generate(PROMPTS, **kwargs).completions
        second = worker.generate(others, **kwargs)
        with_logprobs = worker.generate(others, return_logprobs=True, **kwargs)
    # Prefills run: each call's first token is its own. Every decode step then returns the
    # first decode step's ids, whatever the prompts.
    assert [c[:2] for c in first] == [c[:2] for c in real]
    assert [c[1:] for c in first] == [c[1:] for c in second.completions] == [[c[1]] * 5 for c in real]
    assert [c[0] for c in second.completions] != [c[0] for c in real]
    # Asked for log-probs, the sampler's first decode step gives them for every step after it.
    assert with_logprobs.completions == second.completions
    logprobs = with_logprobs.logprobs[with_logprobs.completion_mask].reshape(len(PROMPTS), 6)
    np.testing.assert_array_equal(logprobs[:, 2:], np.repeat(logprobs[:, 1:2], 4, axis=1))
    assert worker.generate(PROMPTS, **kwargs).completions == real
    # The decoded tokens' KV was never written: a prompt extending a completion made under the
    # stub is answered as with an empty prefix cache, not from what those slots held.
    extended = [prompt + completion for prompt, completion in zip(PROMPTS, first)]
    after = worker.generate(extended, return_logprobs=True, **kwargs)
    worker.engine.testing.flush_prefix_cache()
    fresh = worker.generate(extended, return_logprobs=True, **kwargs)
    assert after.completions == fresh.completions
    np.testing.assert_allclose(after.logprobs, fresh.logprobs, atol=1e-5)
