"""examples/tasks.py: the addition and GSM8K tasks, their prompts and rewards."""

import dataclasses
import json

import numpy as np
import pytest

from examples.grpo import PRESETS
from examples.rl_loop import Task
from examples.tasks import (
    addition_problems,
    addition_reward,
    extract_final_number,
    gsm8k_format_reward,
    gsm8k_problems,
    gsm8k_prompt,
    gsm8k_reference_answer,
    gsm8k_reward,
)
from tests.helpers import GSM8K_SAMPLE

# A real GSM8K train example (question and reference solution as the dataset stores them).
GSM8K_QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to "
    "friends in May. How many clips did Natalia sell altogether in April and May?"
)
GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)
GSM8K_THOUSANDS = "She earns 1,200 * 2 = <<1200*2=2400>>2400 dollars.\n#### 2,400"


def test_addition_task_and_reward():
    problems = addition_problems(np.random.default_rng(0), 50)
    assert all(p.prompt == f"{p.prompt[0]}+{p.prompt[2]}=" for p in problems)
    assert all(int(p.answer) == int(p.prompt[0]) + int(p.prompt[2]) for p in problems)
    small = addition_problems(np.random.default_rng(0), 200, max_operand=4)
    assert {p.prompt[0] for p in small} == {p.prompt[2] for p in small} == set("01234")
    assert addition_reward("7", "7") == 1.0
    assert addition_reward(" 7 ", "7") == 1.0
    assert addition_reward("8", "7") == pytest.approx(0.45)
    assert addition_reward("17", "7") == 0.0
    assert addition_reward("7+", "7") == 0.0
    assert addition_reward("", "7") == 0.0
    assert addition_reward("²", "7") == addition_reward("٧", "7") == 0.0  # digits int() refuses or reads


def test_gsm8k_answers_and_rewards():
    assert gsm8k_reference_answer(GSM8K_SOLUTION) == "72"
    assert gsm8k_reference_answer(GSM8K_THOUSANDS) == "2400"
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_reference_answer("72")
    good = "In May she sold 48/2 = 24 clips.\nIn total 48 + 24 = 72.\n#### 72"
    assert extract_final_number(good) == "72"
    assert gsm8k_reward(good, "72") == 1.5
    unformatted = "She sold 24 in May, so 72 clips in total."
    assert gsm8k_reward(unformatted, "72") == 1.0 and gsm8k_format_reward(unformatted) == 0.0
    wrong = "48 + 24 = 73\n#### 73"
    assert gsm8k_reward(wrong, "72") == 0.5
    assert extract_final_number("#### $2,400.00") == "2400"
    assert extract_final_number("no number here") is None


QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_gsm8k_prompt_uses_the_chat_template(qwen2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir)
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    prompt = gsm8k_prompt(tokenizer, GSM8K_QUESTION)
    assert prompt.startswith("<|im_start|>system\n")
    assert f"<|im_start|>user\n{GSM8K_QUESTION}<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids


def test_gsm8k_rows_from_a_local_file_become_chat_prompts(chat_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    rows = [json.loads(line) for line in GSM8K_SAMPLE.read_text().splitlines()]
    problems = gsm8k_problems(tokenizer, str(GSM8K_SAMPLE))
    assert [p.answer for p in problems] == [gsm8k_reference_answer(r["answer"]) for r in rows]
    assert problems[0].prompt == gsm8k_prompt(tokenizer, rows[0]["question"])
    assert problems[0].prompt.startswith("<|im_start|>system\n") and problems[0].prompt.endswith(
        "<|im_start|>assistant\n"
    )
    # The preset's task keeps the prompts that fit max_prompt_tokens (256; these are 238-296).
    config = dataclasses.replace(
        PRESETS["qwen2.5-3b"], model=str(chat_dir), dataset=str(GSM8K_SAMPLE), prompts_per_step=2
    )
    task = Task(config, tokenizer)
    lengths = [len(tokenizer.encode(p.prompt, add_special_tokens=False)) for p in problems]
    assert [p.prompt for p in task.pool] == [p.prompt for p, n in zip(problems, lengths) if n <= 256]
    assert 2 <= len(task.pool) < len(problems) and task.reward_fn is gsm8k_reward
    with pytest.raises(ValueError, match=r"3 of 8 prompts fit in max_prompt_tokens=256, fewer than the 16 a draw"):
        Task(dataclasses.replace(config, prompts_per_step=16), tokenizer)
    # The evaluation's draw too, when there is one.
    Task(dataclasses.replace(config, eval_prompts=4), tokenizer)
    with pytest.raises(ValueError, match=r"fewer than the 4 a draw takes \(prompts_per_step, eval_prompts\)"):
        Task(dataclasses.replace(config, eval_prompts=4, eval_every=5), tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: GSM8K solution has no '####' answer line"):
        gsm8k_problems(tokenizer, str(bad))


def test_addition_reward_can_pay_exact_answers_only():
    assert addition_reward("8", "7", near_credit=0.0) == 0.0
    assert addition_reward("7", "7", near_credit=0.0) == 1.0
    assert addition_reward("9", "7", near_credit=0.2) == pytest.approx(0.16)
