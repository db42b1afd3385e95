"""Tasks and rewards: a tiny arithmetic task made in code, and GSM8K for the real-model preset."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str  # what the model sees (for GSM8K, after the chat template)
    answer: str  # the final answer, as a string of digits
    # The chat messages ``prompt`` was rendered from (GSM8K), for tasks that render their own.
    messages: tuple[dict, ...] | None = None


# ---- tiny task: single-digit addition --------------------------------------------------------


def addition_problems(rng: np.random.Generator, count: int, max_operand: int = 9) -> list[Problem]:
    """``a+b=`` with digits ``a, b`` in ``[0, max_operand]``; the answer is the decimal sum."""
    if not 0 <= max_operand <= 9:
        raise ValueError(f"max_operand must be a digit (0-9), got {max_operand}")
    a = rng.integers(0, max_operand + 1, count)
    b = rng.integers(0, max_operand + 1, count)
    return [Problem(f"{x}+{y}=", str(x + y)) for x, y in zip(a, b)]


def addition_reward(completion: str, answer: str, near_credit: float = 0.5) -> float:
    """1 for exactly the answer; a wrong number gets up to ``near_credit`` the closer it is;
    other text 0.

    The shaped part gives a random policy rewards it sometimes earns, so the group-relative
    advantages have a signal from the first step, and it points at the right answer. It also
    makes a near answer a place to stay: once a prompt's samples agree on one, nothing in the
    group-relative advantages pushes it down (GRPO's tiny preset pays exact answers only).
    """
    text = completion.strip()
    if text == answer:
        return 1.0
    if text.isascii() and text.isdigit():  # str.isdigit takes "²" (int() refuses it) and "٣"
        return near_credit * max(0.0, 1.0 - abs(int(text) - int(answer)) / 10)
    return 0.0


# ---- GSM8K -------------------------------------------------------------------------------

GSM8K_SYSTEM_PROMPT = (
    "You are a helpful assistant. Solve the math problem step by step, then give the final "
    "answer on its own line as: #### <number>"
)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> str | None:
    text = text.replace(",", "").replace("$", "").strip()
    try:
        value = float(text)
    except ValueError:
        return None
    return str(int(value)) if value == int(value) else str(value)


def gsm8k_reference_answer(solution: str) -> str:
    """The number after ``####`` in a GSM8K reference solution."""
    if "####" not in solution:
        raise ValueError("GSM8K solution has no '####' answer line")
    answer = normalize_number(solution.split("####")[-1])
    if answer is None:
        raise ValueError(f"GSM8K answer is not a number: {solution.split('####')[-1]!r}")
    return answer


def extract_final_number(completion: str) -> str | None:
    """The model's final answer: after the last ``####`` if present, else the last number."""
    tail = completion.split("####")[-1] if "####" in completion else completion
    numbers = _NUMBER.findall(tail)
    return normalize_number(numbers[-1]) if numbers else None


def gsm8k_correctness_reward(completion: str, answer: str) -> float:
    return 1.0 if extract_final_number(completion) == answer else 0.0


def gsm8k_format_reward(completion: str) -> float:
    """0.5 when the completion ends with a ``#### <number>`` line, as the system prompt asks."""
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return 0.5 if lines and re.fullmatch(r"####\s*" + _NUMBER.pattern, lines[-1]) else 0.0


def gsm8k_reward(completion: str, answer: str) -> float:
    return gsm8k_correctness_reward(completion, answer) + gsm8k_format_reward(completion)


def gsm8k_messages(question: str) -> tuple[dict, ...]:
    return ({"role": "system", "content": GSM8K_SYSTEM_PROMPT}, {"role": "user", "content": question})


def gsm8k_prompt(tokenizer, question: str) -> str:
    """The question in the model's chat template, ready for the assistant's turn."""
    messages = list(gsm8k_messages(question))
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def gsm8k_problems(tokenizer, source: str = "openai/gsm8k", split: str = "train") -> list[Problem]:
    """GSM8K rows (``question``, ``answer`` with a ``#### <n>`` line) as chat prompts.

    ``source`` is a local JSON-lines file of such rows, or an HF hub dataset id (needs
    ``datasets`` and a network; its ``main`` config and ``split``).
    """
    if Path(source).is_file():
        rows = [(f"{source}:{i}", row) for i, row in _json_lines(Path(source))]
    else:
        from datasets import load_dataset

        rows = [(f"{source}[{i}]", row) for i, row in enumerate(load_dataset(source, "main", split=split))]
    problems = []
    for where, row in rows:
        if not isinstance(row, dict) or not {"question", "answer"} <= set(row):
            raise ValueError(f"{where}: a GSM8K row needs 'question' and 'answer' fields")
        try:
            answer = gsm8k_reference_answer(row["answer"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        question = row["question"]
        problems.append(Problem(gsm8k_prompt(tokenizer, question), answer, gsm8k_messages(question)))
    if not problems:
        raise ValueError(f"{source} has no GSM8K rows")
    return problems


def _json_lines(path: Path) -> list[tuple[int, object]]:
    """(line number, parsed row) for each non-blank line."""
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rows.append((i, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not a JSON line ({exc.msg})") from None
    return rows
