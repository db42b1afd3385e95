"""The calculator task: multi-turn episodes in which the model calls a tool.

A prompt asks for a product of two-digit numbers (``37*58=``), which the tiny model cannot
compute; it has a calculator. A solved episode is three messages: the model's tool call

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37*58"}}
    </tool_call>

the tool's answer (``2146``, a ``tool`` message the chat template wraps in <tool_response>), and
the model's final answer, ``2146``, which earns reward 1. A malformed call is answered with an
error message the model sees in its next turn (``rollout.episodes.ToolEnvironment``).

The tiny model's tokenizer spells digits and operators one character a token, and has one token
for each piece of tool-call markup (``TOOL_PIECES``), so a call is 11 tokens. A random model never
writes one: like the instruct models RL starts from, it is first shown how (:func:`warm_start`,
a few supervised steps on worked episodes), and GRPO takes it from there.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator

import jax.numpy as jnp
import numpy as np
import optax

from examples.grpo_math import token_logprobs
from examples.rl_update import make_train_step
from examples.tasks import Problem, gsm8k_problems, gsm8k_reward
from rollout.episodes import EpisodeLimits, StepResult, ToolEnvironment, TurnFrames

# One token each in the tiny tools model's tokenizer (models.tiny.TinyModelSpec.added_tokens).
TOOL_PIECES = (
    "user",
    "assistant",
    "tool",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    '{"name": "calculator", "arguments": {"expression": "',
    '"}}',
)

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37*58"}},
            "required": ["expression"],
        },
    },
}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """The value of an integer expression with + - * and parentheses (nothing else is run)."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression: {expression!r}")

    if not isinstance(expression, str) or len(expression) > 64:
        raise ValueError("expression must be a string of at most 64 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an integer expression: {expression!r}") from None
    return str(value(tree.body))


def product_problems(rng: np.random.Generator, count: int) -> list[Problem]:
    """``a*b=`` with ``a, b`` in [32, 99]: the product has four digits, so each copy the model
    makes (the expression into its call, the result into its answer) is a fixed distance back."""
    a, b = rng.integers(32, 100, count), rng.integers(32, 100, count)
    return [Problem(f"{x}*{y}=", str(x * y)) for x, y in zip(a, b)]


def digit_reward(text: str, answer: str) -> float:
    """1 for exactly the answer; a number of the answer's length gets up to 0.5, a share for
    each digit in its place: a signal from the first steps, pointing at the tool's result. Only
    ASCII digits count (str.isdigit also takes superscripts and other scripts' digits)."""
    text = text.strip()
    if text == answer:
        return 1.0
    if len(text) != len(answer) or not (text.isascii() and text.isdigit()):
        return 0.0
    return 0.5 * sum(a == b for a, b in zip(text, answer)) / len(answer)


def call_text(expression: str) -> str:
    """A well-formed calculator call, as Qwen2.5's template writes one."""
    arguments = {"expression": expression}
    return f'<tool_call>\n{{"name": "calculator", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def messages(problem: Problem) -> list[dict]:
    """The chat of a problem: its own messages (GSM8K), or its prompt as the user's."""
    return list(problem.messages) if problem.messages else [{"role": "user", "content": problem.prompt}]


class CalculatorEnvironment(ToolEnvironment):
    """The calculator for one problem; notes whether a call computed the problem's answer
    (``answer`` None, for problems whose answer no single call computes: whether one ran)."""

    def __init__(self, answer: str | None, reward):
        self.answer = answer
        self.right_call = False
        super().__init__({"calculator": self._calculate}, reward)

    def _calculate(self, expression: str) -> str:
        result = calculator(expression)
        self.right_call |= self.answer is None or result == self.answer
        return result


def episode_metrics(environments: list[CalculatorEnvironment], episodes) -> dict[str, float]:
    """What an RL engineer reads of a step's episodes: turns, how many episodes called the
    calculator on their problem (tool_call_success: a well-formed call whose result is the
    answer, or for GSM8K one that ran), the calls that failed, and the prefill the cache saved."""
    prompt_tokens = sum(t.prompt_tokens for e in episodes for t in e.turns)
    prefill = sum(e.prefill_tokens for e in episodes)
    calls = sum(env.calls for env in environments)
    return {
        "turns": float(np.mean([len(e.turns) for e in episodes])),
        "tool_call_success": float(np.mean([env.right_call for env in environments])),
        "failed_call_fraction": sum(env.failed_calls for env in environments) / calls if calls else 0.0,
        "episodes_answered": float(np.mean([e.status == "done" for e in episodes])),
        "prefill_saved": 1.0 - prefill / prompt_tokens if prompt_tokens else 0.0,
    }


TOOLS_SYSTEM_PROMPT = (
    "You are a helpful assistant with a calculator. Use it for the arithmetic, then give the final "
    "answer on its own line as: #### <number>"
)


class ToolTask:
    """The RL loop's task when its config asks for episodes (``max_turns > 1``): the tiny
    presets' products, or GSM8K with the calculator in the chat template's tools (the
    ``qwen2.5-3b-tools`` preset; rewarded as the single-turn GSM8K task is)."""

    def __init__(self, config, tokenizer, *, tiny: bool):
        self.config = config
        self.tiny = tiny
        # The tiny tokenizer spends a token per character: the tools' JSON would fill its context,
        # so its prompts name no tools (the warm start shows the call). Real models get them.
        self.tools = None if tiny else [CALCULATOR]
        self.pool = None if tiny else self._gsm8k_pool(tokenizer)
        self.limits = EpisodeLimits(
            max_turns=config.max_turns,
            max_new_tokens=config.turn_tokens,
            max_response_tokens=config.max_new_tokens,  # the batch's completion region
            overflow="truncate",
        )

    def _gsm8k_pool(self, tokenizer) -> list[Problem]:
        problems = gsm8k_problems(tokenizer, self.config.dataset)
        frames = TurnFrames(tokenizer, [CALCULATOR])
        pool = []
        system = {"role": "system", "content": TOOLS_SYSTEM_PROMPT}
        for p in problems:
            with_tools = Problem(p.prompt, p.answer, (system, p.messages[1]))
            if len(frames.prompt(messages(with_tools))) <= self.config.max_prompt_tokens:
                pool.append(with_tools)
        if len(pool) < self.config.prompts_drawn:
            raise ValueError(
                f"{self.config.dataset}: {len(pool)} prompts (with the calculator's tools block) fit in "
                f"max_prompt_tokens={self.config.max_prompt_tokens}, fewer than the "
                f"{self.config.prompts_drawn} a draw takes (prompts_per_step, eval_prompts)"
            )
        return pool

    def sample(self, count: int, step: int) -> list[Problem]:
        rng = np.random.default_rng([self.config.seed, step])
        if self.pool is None:
            return product_problems(rng, count)
        return [self.pool[i] for i in rng.choice(len(self.pool), count, replace=False)]

    def reward(self, problem: Problem):
        if self.tiny:
            return lambda turn: digit_reward(turn.parsed.content, problem.answer)
        return lambda turn: gsm8k_reward(turn.parsed.content, problem.answer)

    def roll_out(self, worker, problems: list[Problem], *, seed: int, return_logprobs: bool, return_routing: bool):
        """The step's episodes: (their RolloutBatch, rewards, episode metrics); ``return_routing``:
        the batch's ``routed_experts`` (each episode's, from its last turn) for routing replay."""
        config = self.config
        environments = [
            CalculatorEnvironment(p.answer if self.tiny else None, self.reward(p))
            for p in problems
            for _ in range(config.samples_per_prompt)
        ]
        out = worker.run_episodes(
            [messages(p) for p in problems],
            lambda i, j: environments[i * config.samples_per_prompt + j],
            n=config.samples_per_prompt,
            limits=self.limits,
            tools=self.tools,
            seed=seed,
            pad_prompts_to=config.max_prompt_tokens,
            completion_width=config.max_new_tokens,
            temperature=config.temperature,
            return_logprobs=return_logprobs,
            return_routing=return_routing,
        )
        return out.batch, out.rewards, episode_metrics(environments, out.episodes)


# ---- the warm start -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Demonstration:
    tokens: list[int]
    loss_mask: list[bool]  # the model's own turns


def demonstration(frames: TurnFrames, tokenizer, problem: Problem) -> Demonstration:
    """A solved episode laid out exactly as ``run_episodes`` lays out the model's own."""
    expression = problem.prompt.rstrip("=")
    call = tokenizer.encode(call_text(expression), add_special_tokens=False) + frames.turn_stop
    answer = tokenizer.encode(calculator(expression), add_special_tokens=False) + frames.turn_stop
    prompt = frames.prompt(messages(problem))
    tool = frames.close_turn(call) + frames.observation(
        StepResult(observation=[{"role": "tool", "content": calculator(expression)}])
    )
    tokens = prompt + call + tool + answer
    mask = [False] * len(prompt) + [True] * len(call) + [False] * len(tool) + [True] * len(answer)
    return Demonstration(tokens, mask)


def warm_start(model, params, tokenizer, *, steps: int, seed: int, batch_size: int = 32, learning_rate: float = 3e-3):
    """``steps`` supervised Adam steps on worked episodes (the loss on the model's turns only):
    the policy RL starts from has seen the tool-call format. Returns (params, last loss)."""
    if steps == 0:
        return params, float("nan")
    frames = TurnFrames(tokenizer)
    rng = np.random.default_rng([seed, 7])
    optimizer = optax.adam(learning_rate)

    def loss_fn(trained, batch):
        logits = model.apply({"params": trained["params"]}, batch["tokens"], batch["attention"], batch["positions"])
        logprobs = token_logprobs(logits.astype(jnp.float32), batch["tokens"])
        mask = batch["mask"][:, 1:]
        loss = -(logprobs * mask).sum() / mask.sum()
        return loss, {"loss": loss}

    step = make_train_step(loss_fn, {"params": ("opt_state", optimizer)})
    trees = {"params": params, "opt_state": optimizer.init(params)}
    for _ in range(steps):
        shown = [demonstration(frames, tokenizer, p) for p in product_problems(rng, batch_size)]
        width = max(len(d.tokens) for d in shown)
        batch = {
            "tokens": np.zeros((batch_size, width), np.int32),
            "attention": np.zeros((batch_size, width), bool),
            "mask": np.zeros((batch_size, width), np.float32),
        }
        for row, d in enumerate(shown):
            batch["tokens"][row, : len(d.tokens)] = d.tokens
            batch["attention"][row, : len(d.tokens)] = True
            batch["mask"][row, : len(d.tokens)] = d.loss_mask
        batch["positions"] = np.broadcast_to(np.arange(width, dtype=np.int32), (batch_size, width))
        trees, stats = step(trees, batch)
    return trees["params"], float(stats["loss"])
