"""examples/rl_loop.py: an output dir is bound to one run; the fixed evaluation; the worker a run starts."""

import dataclasses
import json
import types

import numpy as np
import pytest

from examples.grpo import PRESETS
from examples.rl_loop import EVAL_STREAM, Task, _evaluate, claim_output_dir, step_seed, worker_config


def test_a_resume_in_an_output_dir_must_be_the_same_run(tmp_path, chat_dir, monkeypatch):
    """A resume with another seed would restore one run's weights and go on with another run's
    prompts and KL reference: refused before anything starts, naming the file and both values.
    Before a first checkpoint nothing is bound (a rerun may fix a start-up error)."""
    config = dataclasses.replace(PRESETS["tiny"], seed=2)
    claim_output_dir(config, tmp_path)
    claim_output_dir(dataclasses.replace(config, seed=0), tmp_path)  # no checkpoint yet: rebinds
    assert json.loads((tmp_path / "run.json").read_text())["seed"] == 0
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    claim_output_dir(dataclasses.replace(config, seed=0, steps=90), tmp_path)  # the same run, resumed for longer
    with pytest.raises(
        ValueError, match=r"run\.json: this output dir holds checkpoints of a run with seed=0; this one has seed=2"
    ):
        claim_output_dir(config, tmp_path)
    # A local model dir named by another path is the same run.
    other = tmp_path / "other"
    other.mkdir()
    claim_output_dir(dataclasses.replace(config, model=str(chat_dir)), other)
    (other / "checkpoints" / "1").mkdir(parents=True)
    monkeypatch.chdir(chat_dir.parent)
    claim_output_dir(dataclasses.replace(config, model=chat_dir.name), other)


def test_decode_steps_reach_the_worker_and_are_not_part_of_a_runs_identity(tmp_path):
    """--decode-steps is how the engines run, not what they sample: a resume may change it."""
    config = dataclasses.replace(PRESETS["tiny"], decode_steps=8)
    assert worker_config(config, tmp_path).decode_steps == 8
    assert worker_config(PRESETS["tiny"], tmp_path).decode_steps == 1
    claim_output_dir(config, tmp_path)
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    claim_output_dir(dataclasses.replace(config, decode_steps=1), tmp_path)
    with pytest.raises(ValueError, match="decode_steps must be >= 1, got 0"):
        dataclasses.replace(config, decode_steps=0)


def test_lr_decay_spans_the_train_steps_after_the_warm_up():
    config = dataclasses.replace(
        PRESETS["tiny"], steps=10, ppo_epochs=2, minibatches=4, warmup_updates=20, lr_decay=False
    )
    assert config.decay_updates == 0
    assert dataclasses.replace(config, lr_decay=True).decay_updates == 10 * 2 * 4 - 20
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        dataclasses.replace(config, scale_rewards="std")


def test_the_warm_start_is_part_of_a_runs_identity(tmp_path):
    """The warm-started policy is the KL reference and the start of the run: a resume with
    another warm start would train against another reference."""
    config = PRESETS["tiny-tools"]
    claim_output_dir(config, tmp_path)
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)
    claim_output_dir(dataclasses.replace(config, steps=90), tmp_path)
    with pytest.raises(ValueError, match=r"warm_start_steps=100; this one has warm_start_steps=5"):
        claim_output_dir(dataclasses.replace(config, warm_start_steps=5), tmp_path)


def test_the_evaluation_rolls_out_the_same_problems_with_the_same_seeds_every_time():
    """--eval-every: one fixed set of problems and one call seed, whatever the step, the seed no
    training step's; the eval figures are their rewards."""
    config = dataclasses.replace(PRESETS["tiny"], eval_every=5, eval_prompts=4, return_logprobs=True)
    task = Task(config, tokenizer=None)
    calls = []

    class AnswersEveryOther:
        def generate(self, prompts, *, n, seed, return_logprobs, return_routing, **_):
            assert not return_logprobs and not return_routing  # what only the update reads
            calls.append((prompts, seed))
            answers = [p.answer for p in task.sample(config.eval_prompts, EVAL_STREAM)]
            index = np.repeat(np.arange(len(prompts)), n)
            texts = [answers[i] if row % 2 == 0 else "x" for row, i in enumerate(index)]
            return types.SimpleNamespace(completion_texts=texts, prompt_index=index)

    first, again = (_evaluate(config, AnswersEveryOther(), task) for _ in range(2))
    for figures in (first, again):
        assert figures["eval_s"] >= 0
        assert {k: v for k, v in figures.items() if k != "eval_s"} == {"eval_reward": 0.5, "eval_solved": 0.5}
    assert calls[0] == calls[1] and len(calls[0][0]) == 4
    assert calls[0][1] not in {step_seed(config.seed, step) for step in range(config.steps)}
    with pytest.raises(ValueError, match="eval_every must be >= 0"):
        dataclasses.replace(config, eval_every=-1)
