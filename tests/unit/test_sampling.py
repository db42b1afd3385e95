"""rollout/sampling.py: a generate call's arguments checked without an engine (the limits an
engine reports, stood in for), so ``make test-fast`` covers a change to them; and the worker's
``generate`` takes every sampling field."""

import dataclasses
import inspect
import types

import numpy as np
import pytest

from rollout import RolloutWorker, SamplingParams
from rollout.consistency import check_consistency
from rollout.errors import InvalidRequest
from rollout.sampling import RequestValidator

# What a tiny engine reports (context 256: requests of 254 tokens, prompts of 249).
ENGINE = types.SimpleNamespace(
    vocab_size=320,
    context_length=256,
    max_request_tokens=254,
    max_prompt_tokens=249,
    kv_pool_tokens=2048,
    lora_names=frozenset(),
)
CONFIG = types.SimpleNamespace(
    seed=0, record_routing=False, max_rows_per_call=65536, max_tokens_per_call=1 << 26, model_path="tiny"
)


@pytest.fixture
def validator():
    return RequestValidator(CONFIG, ENGINE, tokenizer=None, eos_token_ids={2})


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([], {}, "prompts is empty"),
        ("a string", {}, "list of strings or of token-id lists"),
        ([[1, 2], []], {}, r"prompts\[1\] is empty"),
        ([[1, 2, 999999]], {}, r"prompts\[0\] has token ids outside"),
        ([[5.7, 17.2]], {}, r"prompts\[0\]\[0\] must be an int token id, got 5.7"),
        ([[1, 2], [[1, 2], [3]]], {}, r"prompts\[1\]\[0\] must be an int token id, got \[1, 2\]"),
        ([[True, 5]], {}, r"prompts\[0\]\[0\] must be an int token id, got True"),
        ([[1, 2], b"abc"], {}, r"prompts\[1\] must be a list of token ids, got bytes"),
        ([np.zeros((2, 2), np.int32)], {}, r"prompts\[0\] must be a flat list"),
        ([list(range(1, 250))], {"max_new_tokens": 64}, r"313 tokens do not fit the context length 256"),
        # len(prompt) + max_new_tokens == context_length: the engine would refuse it.
        ([list(range(1, 201))], {"max_new_tokens": 56}, r"256 tokens do not fit the context length 256"),
        ([list(range(1, 300))], {}, "the engine accepts prompts of at most 249"),
        ([[1, 2]], {"n": 0}, "n must be >= 1"),
        ([[1, 2]], {"n": 2.0}, "n must be an int"),
        ([[1, 2]], {"temperature": -1.0}, "temperature must be"),
        ([[1, 2]], {"temperature": float("nan")}, "temperature must be finite"),
        ([[1, 2]], {"temperature": "1.0"}, "temperature must be a number, got '1.0'"),
        ([[1, 2]], {"temperature": None}, "temperature must be a number, got None"),
        ([[1, 2]], {"top_p": 0.0}, "top_p must be"),
        ([[1, 2]], {"top_k": 0}, "top_k must be"),
        ([[1, 2]], {"top_k": 5.0}, "top_k must be an int"),
        ([[1, 2]], {"min_p": 1.5}, "min_p must be"),
        ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens must be"),
        ([[1, 2]], {"max_new_tokens": True}, "max_new_tokens must be an int, got True"),
        ([[1, 2]], {"seed": 2**63}, "seed must be an int64"),
        ([[1, 2]], {"seed": True}, "seed must be an int, got True"),
        ([[1, 2]], {"stop_token_ids": [10**7]}, r"stop_token_ids\[0\] = 10000000 is outside \[0, 320\)"),
        ([[1, 2]], {"stop_token_ids": 5}, "stop_token_ids must be a list of token ids, got 5"),
        ([[1, 2]], {"stop_token_ids": [5.9]}, r"stop_token_ids\[0\] must be an int, got 5.9"),
        ([[1, 2]], {"ignore_eos": "yes"}, "ignore_eos must be a bool"),
        ([[1, 2]], {"prompt_offset": -1}, "prompt_offset must be >= 0, got -1"),
        ([[1, 2]], {"prompt_offset": 1.5}, "prompt_offset must be an int, got 1.5"),
        ([[1, 2]], {"lora": "policy"}, "no LoRA adapter named 'policy' is loaded"),
        ([[1, 2]], {"return_routing": True}, "return_routing needs a worker that records routing"),
        # Past the context before past the per-call budget: the request's own limit is named.
        ([[1, 2]], {"max_new_tokens": 10**9}, r"1000000002 tokens do not fit the context length 256"),
    ],
)
def test_bad_input_is_a_clear_invalid_request(validator, prompts, kwargs, message):
    # InvalidRequest (a ValueError): what the server maps to a 400 and callers catch by type.
    with pytest.raises(InvalidRequest, match=message):
        validator.validate(prompts, kwargs)


def test_routing_asked_of_a_dense_model_says_it_has_no_experts(qwen2_dir):
    """The advice to record routing would not help: a worker would refuse to record it."""
    dense = RequestValidator(
        types.SimpleNamespace(**{**vars(CONFIG), "model_path": str(qwen2_dir)}),
        ENGINE,
        tokenizer=None,
        eos_token_ids={2},
    )
    with pytest.raises(InvalidRequest, match=r"return_routing: .*config.json is a qwen2 model, which routes no tokens"):
        dense.validate([[1, 2]], {"return_routing": True})


def test_consistency_routing_replay_is_refused_under_its_own_name(validator):
    """It was refused as return_routing, an argument its caller never passed."""
    worker = types.SimpleNamespace(check_sampling=lambda **sampling: validator.check_sampling(sampling))
    for replay, message in ((True, "routing_replay replays the engine's routing: return_routing needs"), (1, "bool")):
        with pytest.raises(InvalidRequest, match=message) as error:
            check_consistency(worker, {}, [[1, 2]], routing_replay=replay)
        assert error.value.field == "routing_replay"


def test_consistency_refuses_lora_factors_the_flax_recompute_would_ignore():
    """The Flax model ignores extra params: a tree holding adapters was recomputed as its base
    alone, and the engine, which applies them, was reported as serving another policy."""
    worker = types.SimpleNamespace(check_params=lambda params: None)
    params = {"model.layers_0.self_attn.q_proj.kernel": 0, "model.layers_0.self_attn.q_proj.kernel_lora_a": 0}
    with pytest.raises(
        InvalidRequest, match=r"'model\.layers_0\.self_attn\.q_proj\.kernel_lora_a'.*apply_adapters"
    ) as error:
        check_consistency(worker, params, [[1, 2]])
    assert error.value.field == "params"


class AddedTokens:
    """A tokenizer with tokens added past the model's vocabulary (no embedding rows)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 300 if c != "@" else 320 + len(text) for c in text]


def test_a_text_prompt_encoding_past_the_vocabulary_is_refused():
    """Such an id once ran: its row's embedding was NaN, and the NaN reached the rows batched
    with it (their attention reads its KV slots, masked, as 0 x NaN)."""
    validator = RequestValidator(CONFIG, ENGINE, tokenizer=AddedTokens(), eos_token_ids={2})
    assert validator.validate(["ab"], {}).prompts == [[97, 98]]
    with pytest.raises(InvalidRequest, match=r"prompts\[1\] encodes to token ids outside .* \[0, 320\): \[322\]"):
        validator.validate(["ab", "a@"], {})


def test_a_valid_call_gets_its_stop_ids_and_seeds(validator):
    request = validator.validate([[5, 17], [100]], {"n": 3, "seed": 7, "stop_token_ids": [9]})
    assert request.params.stop_token_ids == (2, 9) and request.params.seed == 7
    assert request.seeds.shape == (2, 3)
    assert validator.validate([[5]], {"ignore_eos": True}).params.stop_token_ids == ()


def test_generate_takes_every_sampling_field():
    """``generate`` lists its arguments (agenerate, astream and run_episodes take them as
    keywords, checked against SamplingParams): a field added to one must reach the other."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    arguments = set(inspect.signature(RolloutWorker.generate).parameters) - {"self", "prompts"}
    assert fields - arguments == set()
    assert arguments - fields == {"pad_prompts_to", "prompt_offset"}


def test_calls_without_a_seed_draw_the_same_seeds_on_validators_of_one_config():
    """The stream generate and run_episodes draw from (run_episodes had drawn from the OS's
    entropy): a restarted run samples again what it sampled."""
    first, second = (RequestValidator(CONFIG, ENGINE, tokenizer=None, eos_token_ids={2}) for _ in range(2))
    drawn = [first.call_seed(None) for _ in range(3)]
    assert drawn == [second.call_seed(None) for _ in range(3)] and len(set(drawn)) == 3
    assert first.call_seed(7) == 7
    with pytest.raises(InvalidRequest, match="seed must be an int64"):
        first.call_seed(2**64)
