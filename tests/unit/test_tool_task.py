"""The calculator task of the tiny-tools GRPO preset, without an engine."""

import dataclasses
import types

import numpy as np
import pytest
from transformers import AutoTokenizer

from examples.grpo import PRESETS
from examples.rl_loop import TINY_MODELS, _roll_out
from examples.tool_task import (
    ToolTask,
    calculator,
    call_text,
    demonstration,
    digit_reward,
    messages,
    product_problems,
)
from models.tiny import write_tiny_model
from rollout.chat import parse_tool_calls
from rollout.episodes import TurnFrames


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(
        write_tiny_model(tmp_path_factory.mktemp("tools"), TINY_MODELS["tiny-tools"](0))
    )


@pytest.mark.parametrize("expression, value", [("37*58", "2146"), ("(2+3)*-4", "-20"), (" 7 - 10 ", "-3")])
def test_the_calculator_evaluates_integer_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ['__import__("os")', "2**64", "1/2", "x", "1.5*2", "9" * 65, 7])
def test_the_calculator_runs_nothing_else(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_a_call_is_a_qwen_tool_call_of_eleven_tokens(tokenizer):
    text = call_text("37*58")
    (call,) = parse_tool_calls(text).tool_calls
    assert (call.name, call.arguments) == ("calculator", {"expression": "37*58"})
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 11 and tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in ids


def test_products_have_four_digits_and_depend_on_the_seed_only():
    problems = product_problems(np.random.default_rng(3), 50)
    assert all(len(p.answer) == 4 and calculator(p.prompt.rstrip("=")) == p.answer for p in problems)
    assert product_problems(np.random.default_rng(3), 50) == problems


@pytest.mark.parametrize(
    "text, reward",
    [
        ("2146", 1.0),
        (" 2146 ", 1.0),
        ("2140", 0.375),
        ("1246", 0.25),
        ("214", 0.0),
        ("abcd", 0.0),
        ("\u00b2146", 0.0),  # a superscript two: a digit to str.isdigit, not a number
        ("\u0662146", 0.0),  # an Arabic-Indic two
    ],
)
def test_the_reward_pays_the_product_and_digits_in_place(text, reward):
    assert digit_reward(text, "2146") == reward


def test_a_demonstration_is_laid_out_as_the_models_own_episodes(tokenizer):
    frames = TurnFrames(tokenizer)
    (problem,) = product_problems(np.random.default_rng(0), 1)
    shown = demonstration(frames, tokenizer, problem)
    prompt = frames.prompt(messages(problem))
    assert shown.tokens[: len(prompt)] == prompt and not any(shown.loss_mask[: len(prompt)])
    learned = tokenizer.decode([t for t, m in zip(shown.tokens, shown.loss_mask) if m])
    expression = problem.prompt.rstrip("=")
    assert learned == call_text(expression) + "<|im_end|>" + problem.answer + "<|im_end|>"
    text = tokenizer.decode(shown.tokens)
    assert f"<tool_response>\n{problem.answer}\n</tool_response>" in text
    assert tokenizer.unk_token_id not in shown.tokens
    # The preset's limits hold a demonstrated episode.
    config = PRESETS["tiny-tools"]
    assert len(prompt) <= config.max_prompt_tokens and len(shown.tokens) - len(prompt) <= config.max_new_tokens


def test_the_tool_presets_check_their_settings():
    config = PRESETS["tiny-tools"]
    assert config.max_turns > 1 and config.warm_start_steps > 0
    with pytest.raises(ValueError, match="async_rollout generates single-turn"):
        type(config)(**{**vars(config), "async_rollout": True, "tis_cap": 2.0})
    with pytest.raises(ValueError, match="warm_start_steps shows worked tool episodes"):
        type(config)(**{**vars(config), "max_turns": 1})


def test_the_tool_task_asks_for_routing_when_the_run_replays_it():
    """--routing-replay with episodes: the step's episodes return their routing, for the
    update's forwards; the evaluation, which trains nothing, does not ask for it."""
    # The tools preset of the real models, on an MoE model (a hub id: not read), as no tiny
    # preset has both tools and experts.
    moe = dict(model="Qwen/Qwen3-30B-A3B", dataset="gsm8k.jsonl")
    config = dataclasses.replace(PRESETS["qwen2.5-3b-tools"], **moe, routing_replay=True, prompts_per_step=2)
    task = ToolTask(config, tokenizer=None, tiny=True)
    asked = []

    class Recording:
        def run_episodes(self, prompts, make_env, *, n, **options):
            asked.append(options["return_routing"])
            episodes = [types.SimpleNamespace(turns=[], prefill_tokens=0, status="done")] * (len(prompts) * n)
            return types.SimpleNamespace(batch="batch", rewards=np.zeros(len(episodes)), episodes=episodes)

    problems = task.sample(2, step=0)
    assert _roll_out(config, Recording(), task, problems, seed=1)[0] == "batch"
    _roll_out(config, Recording(), task, problems, seed=1, for_training=False)
    _roll_out(dataclasses.replace(config, routing_replay=False), Recording(), task, problems, seed=1)
    assert asked == [True, False, False]
