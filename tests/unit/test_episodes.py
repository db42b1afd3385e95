"""Episodes without an engine: the chat template's framing, the tool environment, the packing."""

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import threading
import types

import numpy as np
import pytest
from transformers import AutoTokenizer

from models.tiny import TinyModelSpec, write_tiny_model
from rollout import InvalidRequest, SamplingParams
from rollout.batch import pack_rollouts
from rollout.chat import ChatError, parse_tool_calls
from rollout.episodes import (
    EpisodeLimits,
    EpisodeResult,
    EpisodeTurn,
    StepResult,
    ToolEnvironment,
    Turn,
    TurnFrames,
    pack_episodes,
    run_episode,
    run_episodes,
    run_until_returned,
)
from rollout.sampling import as_call_seed, row_seeds


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("chat"), TinyModelSpec(chat_template=True))
    return AutoTokenizer.from_pretrained(path)


def text_of(tokenizer, ids):
    return tokenizer.decode(ids)


def test_frames_close_the_models_turn_and_open_the_next(tokenizer):
    frames = TurnFrames(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert frames.turn_stop == [im_end]
    assert text_of(tokenizer, frames.turn_end) == "<|im_end|>\n"
    # A turn that stopped at <|im_end|> needs only the newline; one cut by its budget, all of it.
    assert text_of(tokenizer, frames.close_turn([40, 41, im_end])) == "\n"
    assert text_of(tokenizer, frames.close_turn([40, 41])) == "<|im_end|>\n"
    user = frames.observation(StepResult(observation="12+3"))
    assert text_of(tokenizer, user) == "<|im_start|>user\n12+3<|im_end|>\n<|im_start|>assistant\n"
    tool = frames.observation(
        StepResult(observation=[{"role": "tool", "content": "15"}, {"role": "tool", "content": "7"}])
    )
    assert text_of(tokenizer, tool) == (
        "<|im_start|>user\n<tool_response>\n15\n</tool_response>\n<tool_response>\n7\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    opening = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)
    ids = frames.observation(StepResult(observation=[50, 51], role="user"))
    assert ids[: len(opening)] == opening and ids[len(opening) : len(opening) + 2] == [50, 51]
    assert text_of(tokenizer, ids[len(opening) + 2 :]) == "<|im_end|>\n<|im_start|>assistant\n"


# Qwen3's layout in short: an assistant message after the last user message opens with an empty
# <think> block, earlier ones are written without it (their reasoning dropped).
QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3's: a header per message, <|eot_id|> after each, JSON-quoted tool results.
LLAMA3_LIKE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (m['content'] | tojson) + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def test_frames_follow_templates_that_render_earlier_turns_differently(tokenizer):
    tokenizer.chat_template, original = QWEN3_LIKE, tokenizer.chat_template
    try:
        frames = TurnFrames(tokenizer)
        assert text_of(tokenizer, frames.turn_end) == "<|im_end|>\n"
        user = frames.observation(StepResult(observation="7+7"))
        assert text_of(tokenizer, user) == "<|im_start|>user\n7+7<|im_end|>\n<|im_start|>assistant\n"
        tokenizer.chat_template = LLAMA3_LIKE
        frames = TurnFrames(tokenizer)
        assert text_of(tokenizer, frames.turn_end) == "<|eot_id|>"
        user = frames.observation(StepResult(observation="hi"))
        assert text_of(tokenizer, user) == (
            "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        tool = frames.observation(StepResult(observation=[{"role": "tool", "content": "15"}]))
        assert text_of(tokenizer, tool).startswith('<|start_header_id|>ipython<|end_header_id|>\n\n"15"<|eot_id|>')
        with pytest.raises(ValueError, match="return that observation as text or messages"):
            frames.observation(StepResult(observation=[5, 6], role="tool"))
    finally:
        tokenizer.chat_template = original


def test_the_first_prompt_is_the_templates_with_the_generation_prompt(tokenizer):
    frames = TurnFrames(tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert frames.prompt(messages) == tokenizer.encode(text, add_special_tokens=False)


# Qwen3's switch: with enable_thinking false, each generation prompt holds an empty reasoning block.
THINKING_SWITCH = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def test_template_variables_frame_every_turn(tokenizer, monkeypatch):
    """With Qwen3's thinking off, every turn opens as the first does: after an empty reasoning
    block (a frame without it would ask the model for reasoning the first turn never had)."""
    monkeypatch.setattr(tokenizer, "chat_template", THINKING_SWITCH)
    opened = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    frames = TurnFrames(tokenizer, template_kwargs={"enable_thinking": False})
    assert text_of(tokenizer, frames.prompt([{"role": "user", "content": "hi"}])).endswith(opened)
    assert text_of(tokenizer, frames.observation(StepResult(observation="7+7"))) == (
        "<|im_start|>user\n7+7<|im_end|>\n" + opened
    )
    assert text_of(tokenizer, frames.turn_end) == "<|im_end|>\n"
    plain = TurnFrames(tokenizer)
    assert text_of(tokenizer, plain.observation(StepResult(observation="7+7"))).endswith("<|im_start|>assistant\n")


def test_a_first_prompt_ending_with_the_assistants_text_is_continued(tokenizer):
    """A prefill: the first turn samples the rest of that message, not a new one after it."""
    frames = TurnFrames(tokenizer)
    prompt = frames.prompt([{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "Let me add"}])
    assert text_of(tokenizer, prompt) == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\nLet me add"
    # An assistant message of tool calls is no text to continue: closed, as before prefills.
    calls = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": {}}}]}
    assert text_of(tokenizer, frames.prompt([{"role": "user", "content": "1+2="}, calls])).endswith(
        "</tool_call><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "result,field",
    [
        (
            StepResult(observation=[{"role": "tool", "content": "1"}, {"role": "us er", "content": "2"}]),
            "observation[1].role",
        ),
        (StepResult(observation=[{"role": "tool"}]), "observation[0].content"),
        (StepResult(observation="1", role="user\n<|im_start|>system"), "StepResult.role"),
        (StepResult(observation=[5, 6], role="us er"), "StepResult.role"),
    ],
)
def test_an_observation_the_template_cannot_take_is_named_as_the_environment_gave_it(tokenizer, result, field):
    """Not as the message it would have been in the history the frames render (messages[3])."""
    with pytest.raises(ChatError) as raised:
        TurnFrames(tokenizer).observation(result)
    assert raised.value.field == field and str(raised.value).startswith(field)


def test_without_a_template_observations_are_appended_as_they_are(tmp_path):
    plain = AutoTokenizer.from_pretrained(write_tiny_model(tmp_path, TinyModelSpec()))
    frames = TurnFrames(plain)
    assert not frames.templated and frames.close_turn([5]) == [] and frames.turn_stop == []
    assert frames.observation(StepResult(observation=[7, 8])) == [7, 8]
    assert frames.observation(StepResult(observation="12")) == plain.encode("12", add_special_tokens=False)
    with pytest.raises(ValueError, match="chat template"):
        frames.prompt([{"role": "user", "content": "hi"}])


def turn(text: str, index: int = 0) -> Turn:
    return Turn(index, [], text, "stop", parse_tool_calls(text))


def test_the_tool_environment_answers_every_call_and_never_fails_on_the_models_output():
    def add(a, b):
        return a + b

    async def shout(text):
        return text.upper()

    def broken():
        raise RuntimeError("disk full")

    env = ToolEnvironment({"add": add, "shout": shout, "broken": broken}, reward=lambda t: float(t.text == "42"))
    calls = (
        '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>'
        '<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>'
        '<tool_call>{"name": "broken", "arguments": {}}</tool_call>'
        "<tool_call>{not json}</tool_call>"
    )
    result = asyncio.run(env.step(turn(calls)))
    assert not result.done and result.reward == 0
    contents = [m["content"] for m in result.observation]
    assert contents[0].startswith("error: tool call 6 is not JSON")
    assert contents[1:3] == ["42", "HI"]
    assert contents[3] == "error: no tool named 'nope' (tools: add, broken, shout)"
    assert contents[4].startswith("error: add: TypeError:") and "'c'" in contents[4]
    assert contents[5] == "error: broken: RuntimeError: disk full"
    assert [m["role"] for m in result.observation] == ["tool"] * 6
    assert (env.calls, env.failed_calls) == (6, 4)
    final = asyncio.run(env.step(turn("42", 1)))
    assert final.done and final.reward == 1.0 and final.observation is None


def episode(tokens, prompt_length, sampled, status="done", reward=1.0):
    loss_mask = np.zeros(len(tokens), bool)
    loss_mask[list(sampled)] = True
    versions = np.where(loss_mask, 3, -1)
    logprobs = np.where(loss_mask, -0.5, 0.0).astype(np.float32)
    turn_ = EpisodeTurn(prompt_length, len(tokens), len(tokens), "stop", prompt_length, 0, prompt_length)
    return EpisodeResult(
        tokens, prompt_length, loss_mask, logprobs, versions, np.where(loss_mask, 9, 0), [turn_], reward, status
    )


def test_pack_episodes_lays_them_out_as_the_rl_loop_trains_on():
    first = episode([1, 2, 3, 10, 11, 20, 21, 12], 3, [3, 4, 7])
    second = episode([1, 2, 3, 13, 22], 3, [3], status="length", reward=0.0)
    other_prompt = episode([4, 5, 14, 15], 2, [2, 3])
    third = episode([4, 5, 16], 2, [2])
    batch = pack_episodes([first, second, other_prompt, third], n=2, pad_token_id=0, completion_width=6)
    assert batch.prompt_width == 3 and batch.tokens.shape == (4, 9)
    assert batch.tokens[0].tolist() == [1, 2, 3, 10, 11, 20, 21, 12, 0]
    assert batch.tokens[2].tolist() == [0, 4, 5, 14, 15, 0, 0, 0, 0]  # the prompt left-padded
    assert batch.completion_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 0]
    assert batch.completion_mask[1].tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert batch.attention_mask[0].tolist() == [1] * 8 + [0]
    assert batch.positions[2].tolist()[1:5] == [0, 1, 2, 3]
    assert batch.logprobs[0, 3] == -0.5 and batch.logprobs[0, 5] == 0 and batch.token_versions[0, 5] == -1
    assert batch.kept_counts[0, 7] == 9
    assert batch.finish_reasons == ["done", "length", "done", "done"] and batch.weight_version == 3
    assert batch.prompt_index.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_turns", 0, "max_turns must be a positive int"),
        ("max_new_tokens", True, "max_new_tokens must be a positive int"),
        ("max_total_tokens", 1, "max_total_tokens must be an int >= 2"),
        ("overflow", "wrap", "overflow must be 'truncate' or 'error'"),
        ("env_timeout_s", 0, "env_timeout_s must be a positive number"),
        ("env_timeout_s", float("nan"), "env_timeout_s must be a positive number"),
        ("pin_prefix", "no", "pin_prefix must be a bool"),
    ],
)
def test_limits_are_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        EpisodeLimits(**{field: value})


@pytest.mark.parametrize(
    "content, kind",
    [
        (b"abc", "bytes"),
        ([7.9, 8.2], "float"),
        ([5, True], "bool"),
        ({"role": "tool", "content": "4"}, "dict"),
        (7, "int"),
    ],
)
def test_only_int_token_ids_are_token_observations(tokenizer, content, kind):
    """Bytes are not the ids of their byte values, floats are not truncated to ids: the
    episode's environment answered something else than token ids, and is told which type."""
    for frames in (TurnFrames(tokenizer), TurnFrames(None)):
        with pytest.raises(TypeError, match=rf"got {kind}|\({kind}\)"):
            frames.observation(StepResult(observation=content))
    assert TurnFrames(None).observation(StepResult(observation=np.array([7, 8]))) == [7, 8]


def test_a_tool_result_json_cannot_encode_is_an_error_the_model_reads():
    functions = {"s": lambda: {1, 2}, "b": lambda: b"x", "o": lambda: object(), "n": lambda: [float("nan")]}
    env = ToolEnvironment({**functions, "i": lambda x: x}, reward=lambda t: 0.0)
    calls = "".join(f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>' for name in "sbon")
    calls += '<tool_call>{"name": "i", "arguments": {"x": 1e400}}</tool_call>'  # no float holds it
    result = asyncio.run(env.step(turn(calls)))
    contents = [m["content"] for m in result.observation]
    assert contents[0] == "error: tool call 5 is not JSON: 1e400 is beyond a float's range"
    assert [c.split(": TypeError: ")[0] for c in contents[1:4]] == ["error: s", "error: b", "error: o"]
    assert all("is not JSON serializable" in c for c in contents[1:4])
    assert contents[4].startswith("error: n: ValueError: Out of range float values are not JSON compliant")
    assert (env.calls, env.failed_calls) == (5, 5)


def test_a_plain_reward_that_hangs_ends_its_own_episode_at_the_timeout():
    """A plain function runs on a thread: the step times out while it hangs, the other episode
    finishes, and the run returns without waiting for it (asyncio.run would have)."""
    release, threads = threading.Event(), []

    def reward(turn):
        threads.append(threading.current_thread().name)
        release.wait()  # set by the test once the run returned
        return 1.0

    async def quick_reward(turn):  # on the loop: no thread to start within the timeout
        return 1.0

    limits = EpisodeLimits(max_turns=2, max_new_tokens=2, env_timeout_s=0.05)
    envs = [ToolEnvironment({}, reward=reward), ToolEnvironment({}, reward=quick_reward)]
    returned, outcome = threading.Event(), {}

    def run():
        main = run_episodes(ScriptedWorker(), [[5], [6]], lambda i, j: envs[i], limits=limits)
        outcome["batch"] = run_until_returned(main)
        returned.set()

    threading.Thread(target=run, daemon=True).start()
    in_time = returned.wait(timeout=60)  # a bound for the failure only: the reward is never released
    release.set()
    assert in_time, "the run waited for the hung reward"
    hung, healthy = outcome["batch"].episodes
    assert hung.status == "env_error" and "took more than 0.05 s" in hung.error
    assert healthy.status == "done" and healthy.reward == 1.0
    assert threads[0].startswith("episode"), "on the run's own threads (one an episode), not a shared pool"


class ScriptedWorker:
    """A worker without an engine: every turn samples [7, 8]; counts its generate calls."""

    vocab_size = 320
    max_prompt_tokens = 300
    max_request_tokens = 400
    pad_token_id = 0
    closed = False

    def __init__(self, tokenizer=None, max_tokens_per_call=None):
        self.tokenizer = tokenizer
        self.calls = 0
        self.config = types.SimpleNamespace(max_tokens_per_call=max_tokens_per_call)

    def call_seed(self, seed=None):
        return as_call_seed(0 if seed is None else seed)  # the worker's stream: a constant here

    def turn(self, max_new_tokens) -> tuple[list[int], str | None, str]:
        """A turn's tokens, text and finish reason."""
        return [7, 8][:max_new_tokens], None, "length"

    async def agenerate(self, prompts, *, max_new_tokens, **_):
        self.calls += 1
        sampled, text, finish_reason = self.turn(max_new_tokens)
        return pack_rollouts(
            prompts,
            [sampled],
            n=1,
            completion_width=max_new_tokens,
            pad_token_id=0,
            finish_reasons=[finish_reason],
            weight_version=0,
            seeds=np.zeros(1),
            completion_texts=None if text is None else [text],
            token_versions=[[0] * len(sampled)],
            cached_tokens=[0],
            prefill_tokens=[len(prompts[0])],
        )

    def check_sampling(self, **sampling):
        return SamplingParams(**sampling)

    def release_session(self, session):
        return False


class Done:
    async def step(self, turn):
        return StepResult(reward=1.0, done=True)


LONG_TOOL = {
    "type": "function",
    "function": {"name": "add", "description": "add " * 20, "parameters": {"type": "object", "properties": {}}},
}


@pytest.mark.parametrize(
    "arguments, field",
    [
        (dict(n=0), "n"),
        (dict(n=-1), "n"),
        (dict(n=True), "n"),
        (dict(n=1.5), "n"),
        (dict(limits=None), "limits"),
        (dict(seed="7"), "seed"),
        (dict(pad_prompts_to=3), "pad_prompts_to"),
        (dict(pad_prompts_to=20.0), "pad_prompts_to"),
        (dict(pad_prompts_to=401), "pad_prompts_to"),  # wider than a request may be
        # Without a response limit, what follows a prompt may fill the engine's request.
        (dict(completion_width=64), "completion_width"),
        (dict(completion_width=64, limits=EpisodeLimits(max_response_tokens=65)), "completion_width"),
        (dict(completion_width=0), "completion_width"),
        (dict(completion_width=2**40, limits=EpisodeLimits(max_response_tokens=16)), "completion_width"),
        (dict(threads=4), "threads"),
        (dict(max_new_tokens=5), "max_new_tokens"),
        (dict(session="s"), "session"),
        (dict(temperature=-1.0), "temperature"),
        (dict(prompts=[[5, 6], [5, 7.0]]), "prompts[1]"),
        (dict(prompts=[[5, 6], [5, 999]]), "prompts[1]"),
        (dict(prompts=[[5, 6], []]), "prompts[1]"),
        (dict(prompts=[]), "prompts"),
        # The first prompt does not fit the engine (the tools block makes it long) ...
        (dict(prompts=[[5, 6], [5] * 301]), "prompts[1]"),
        (dict(prompts=[[{"role": "user", "content": "hi"}]], tools=[LONG_TOOL]), "prompts[0]"),
        # Messages or tools the template cannot take.
        (dict(prompts=[[5], [{"role": "user"}]]), "prompts[1]"),
        (dict(prompts=[[5], [{"role": 1, "content": "hi"}]]), "prompts[1]"),
        (dict(tools=[{"type": "search"}]), "tools[0].type"),
        (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs.tools"),
        (dict(chat_template_kwargs="enable_thinking"), "chat_template_kwargs"),
        (dict(prompts=[[5], [{"role": "user", "content": "1"}, {"role": "assistant", "content": ""}]]), "prompts[1]"),
        # ... or leaves its first turn no room under the limits.
        (dict(prompts=[[5] * 20], limits=EpisodeLimits(max_total_tokens=20)), "prompts[0]"),
        (dict(prompts=[[5] * 20], limits=EpisodeLimits(max_total_tokens=50, overflow="error")), "prompts[0]"),
    ],
)
def test_arguments_are_checked_before_any_episode_starts(tokenizer, arguments, field):
    worker, made = ScriptedWorker(tokenizer), []

    def make_env(i, j):
        made.append((i, j))
        return Done()

    arguments = {"prompts": [[5, 6, 7, 8], [9, 10]], **arguments}
    with pytest.raises(InvalidRequest) as error:
        asyncio.run(run_episodes(worker, arguments.pop("prompts"), make_env, **arguments))
    assert error.value.field == field
    assert made == [] and worker.calls == 0


def test_a_process_pool_is_refused_as_the_steps_threads():
    """Its workers cannot run a step's closure: every synchronous step had failed, each its
    episode's env_error ("Can't pickle local object")."""
    with concurrent.futures.ProcessPoolExecutor(1) as pool:
        with pytest.raises(InvalidRequest, match="threads must be a thread pool") as error:
            asyncio.run(run_episodes(ScriptedWorker(), [[5]], lambda i, j: Done(), threads=pool))
        assert error.value.field == "threads"
        with pytest.raises(InvalidRequest, match="got ProcessPoolExecutor") as error:
            asyncio.run(run_episode(ScriptedWorker(), [5], Done(), threads=pool))
        assert error.value.field == "threads"


def test_a_message_prompt_or_tools_without_a_chat_template_are_named():
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequest, match=r"prompts\[1\]: message prompts need a tokenizer") as error:
        asyncio.run(run_episodes(ScriptedWorker(), [[5], messages], lambda i, j: Done()))
    assert error.value.field == "prompts[1]"
    # Taken and ignored: the model never saw them.
    with pytest.raises(InvalidRequest, match="tools need a tokenizer with a chat template") as error:
        asyncio.run(run_episodes(ScriptedWorker(), [[5]], lambda i, j: Done(), tools=[LONG_TOOL]))
    assert error.value.field == "tools"


def test_tools_with_a_token_id_prompt_are_refused(tokenizer):
    """Only the template writes tools into a prompt: with token ids they were taken and
    ignored, the model never saw them (in a batch of messages too, for that prompt's episodes)."""
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "add"}}]
    worker = ScriptedWorker(tokenizer)
    with pytest.raises(InvalidRequest, match=r"prompts\[1\] is token ids") as error:
        asyncio.run(run_episodes(worker, [messages, [5, 6]], lambda i, j: Done(), tools=tools))
    assert error.value.field == "tools" and worker.calls == 0
    with pytest.raises(InvalidRequest, match="prompt is token ids") as error:
        asyncio.run(run_episode(worker, [5, 6], Done(), tools=tools))
    assert error.value.field == "tools" and worker.calls == 0


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_a_seed_past_int64_is_refused_as_generate_refuses_it(seed):
    """It wrapped: 2**70 drew what 2**70 + 2**64 draws."""
    with pytest.raises(InvalidRequest, match="seed must be an int64") as error:
        asyncio.run(run_episodes(ScriptedWorker(), [[5]], lambda i, j: Done(), seed=seed))
    assert error.value.field == "seed"


def test_checked_arguments_run():
    """What the checks let through: numpy integers, a width that holds every episode."""
    out = asyncio.run(
        run_episodes(
            ScriptedWorker(),
            [np.array([5, 6, 7]), [np.int32(9)]],
            lambda i, j: Done(),
            n=np.int64(2),
            limits=EpisodeLimits(max_response_tokens=16),
            pad_prompts_to=np.int64(4),
            completion_width=16,
        )
    )
    assert [e.status for e in out.episodes] == ["done"] * 4 and out.batch.tokens.shape == (4, 20)


def test_a_step_past_its_timeout_ends_its_episode_without_waiting_for_the_step(caplog, monkeypatch):
    """An async step that catches its cancellation and goes on: the episode ends at the
    timeout, not when the step gives up, and the step's late answer or error is dropped
    (retrieved: asyncio logs nothing about it)."""
    # The episode's warning would be kept by the log capture with its TimeoutError, whose
    # traceback holds the abandoned step: asyncio's complaint would come after the check.
    monkeypatch.setattr(logging.getLogger("rollout.episodes"), "disabled", True)

    async def main():
        release, ended, both_ended = asyncio.Event(), [], asyncio.Event()

        class Stubborn:
            def __init__(self, late):
                self.late = late

            async def step(self, turn):
                try:
                    await asyncio.Event().wait()  # never set: only the timeout ends the wait
                except asyncio.CancelledError:
                    await release.wait()  # a clean-up that outlasts the timeout
                    ended.append(self.late)
                    if len(ended) == 2:
                        both_ended.set()
                    if self.late == "error":
                        raise RuntimeError("the late step failed") from None
                    return StepResult(reward=5.0, done=True)

        limits = EpisodeLimits(max_turns=2, max_new_tokens=2, env_timeout_s=0.01)
        envs = [Stubborn("answer"), Stubborn("error")]
        run = asyncio.ensure_future(run_episodes(ScriptedWorker(), [[5], [6]], lambda i, j: envs[i], limits=limits))
        done, _ = await asyncio.wait({run}, timeout=60)  # a bound for the failure only: nothing is released
        release.set()
        await both_ended.wait()  # the abandoned steps end now
        assert run in done
        return run.result()

    with caplog.at_level("ERROR", logger="asyncio"):
        out = asyncio.run(main())
        gc.collect()
    for episode in out.episodes:
        assert episode.status == "env_error" and episode.reward == 0.0
        assert (
            episode.error
            == "turn 0: TimeoutError: the environment's step took more than 0.01 s (EpisodeLimits.env_timeout_s)"
        )
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_tools_arguments_may_have_any_name_and_plain_tools_raising_stopiteration_or_exit_answer():
    """A ``function`` argument once collided with the helper's own parameter; a plain function's
    StopIteration could not be set on an asyncio future (the call never returned) and its
    SystemExit ended the run."""

    def plot(function, range=1):
        return f"{function} over {range}"

    def first(items):
        return next(iter(items))

    def leave():
        raise SystemExit(3)

    env = ToolEnvironment({"plot": plot, "first": first, "leave": leave}, reward=lambda t: 0.0)
    calls = (
        '<tool_call>{"name": "plot", "arguments": {"function": "sin", "range": 2}}</tool_call>'
        '<tool_call>{"name": "first", "arguments": {"items": []}}</tool_call>'
        '<tool_call>{"name": "leave", "arguments": {}}</tool_call>'
    )
    contents = [m["content"] for m in asyncio.run(asyncio.wait_for(env.step(turn(calls)), 60)).observation]
    assert contents == [
        "sin over 2",
        "error: first: RuntimeError: first raised StopIteration()",
        "error: leave: RuntimeError: leave raised SystemExit(3)",
    ]
    assert (env.calls, env.failed_calls) == (3, 2)


def test_a_tool_or_step_that_ends_cancelled_on_its_own_fails_its_episode_only():
    async def cancelled_elsewhere():
        task = asyncio.ensure_future(asyncio.sleep(10))
        task.cancel()
        return await task  # raises CancelledError: the tool's, not the episode's

    env = ToolEnvironment({"fetch": cancelled_elsewhere}, reward=lambda t: 0.0)
    result = asyncio.run(env.step(turn('<tool_call>{"name": "fetch", "arguments": {}}</tool_call>')))
    assert [m["content"] for m in result.observation] == ["error: fetch: CancelledError: "]

    class CancelledStep:
        async def step(self, turn):
            return await cancelled_elsewhere()

    out = asyncio.run(run_episodes(ScriptedWorker(), [[5], [6]], lambda i, j: [CancelledStep(), Done()][i]))
    assert [e.status for e in out.episodes] == ["env_error", "done"]
    assert out.episodes[0].error == "turn 0: RuntimeError: the environment's step raised CancelledError"


def test_a_synchronous_step_raising_stopiteration_ends_its_episode_at_once():
    class Exhausted:
        def step(self, turn):
            return next(iter(()))

    limits = EpisodeLimits(max_turns=2, max_new_tokens=2, env_timeout_s=30)  # only if the step never returns
    (episode_,) = asyncio.run(run_episodes(ScriptedWorker(), [[5]], lambda i, j: Exhausted(), limits=limits)).episodes
    assert episode_.status == "env_error" and episode_.error == "turn 0: RuntimeError: step raised StopIteration()"


def test_steps_raising_exit_or_interrupt_end_their_episode_only_sync_or_async():
    """An async step's SystemExit, or any step's KeyboardInterrupt, was taken by asyncio for the
    event loop's end: the run failed with an empty CancelledError, every episode lost."""

    class Exits:
        async def step(self, turn):
            raise SystemExit(2)

    class Interrupts:
        def step(self, turn):
            raise KeyboardInterrupt

    class AsyncInterrupts:
        async def step(self, turn):
            raise KeyboardInterrupt

    envs = [Exits(), Interrupts(), AsyncInterrupts(), Done()]
    # Off the main thread, as the worker's run_episodes runs its loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = run_episodes(ScriptedWorker(), [[5], [6], [7], [8]], lambda i, j: envs[i])
        out = pool.submit(asyncio.run, run).result(timeout=60)
    assert [e.status for e in out.episodes] == ["env_error"] * 3 + ["done"]
    assert [e.error for e in out.episodes[:3]] == [
        "turn 0: RuntimeError: step raised SystemExit(2)",
        "turn 0: RuntimeError: step raised KeyboardInterrupt()",
        "turn 0: RuntimeError: step raised KeyboardInterrupt()",
    ]
    # On the main thread a KeyboardInterrupt is the user's Ctrl-C (asyncio's second): the run's.
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(run_episodes(ScriptedWorker(), [[7]], lambda i, j: AsyncInterrupts()))


class Blocking:
    """A synchronous step that returns once the test sets ``proceed``; ``started`` says it runs."""

    def __init__(self):
        self.started, self.proceed = threading.Event(), threading.Event()

    def step(self, turn):
        self.started.set()
        self.proceed.wait()
        return StepResult(reward=1.0, done=True)


def test_an_episodes_end_never_waits_behind_a_step_on_the_callers_threads():
    """run_episode(threads=pool) ran the pin's release on ``pool`` too: on one thread an episode
    ended only once another episode's slow step returned, and one whose own step hung past its
    timeout never did (its release queued behind that step)."""

    async def main(pool, hung_pool):
        slow, hung = Blocking(), Blocking()
        running = asyncio.ensure_future(run_episode(ScriptedWorker(), [5], slow, threads=pool))
        await asyncio.to_thread(slow.started.wait)  # the pool's one thread is taken
        quick = asyncio.ensure_future(run_episode(ScriptedWorker(), [6], Done(), threads=pool))
        # Long enough for the hung step's thread to start on a loaded machine (a step still queued
        # at its timeout is cancelled, never run).
        limits = EpisodeLimits(env_timeout_s=2.0)
        abandoned = asyncio.ensure_future(run_episode(ScriptedWorker(), [7], hung, threads=hung_pool, limits=limits))
        try:  # a bound for the failure only: the steps are not released before it
            done, _ = await asyncio.wait({quick, abandoned}, timeout=60)
            assert done == {quick, abandoned}, "an episode waited for a step on the caller's threads"
            assert not running.done() and hung.started.is_set()
        finally:
            slow.proceed.set()
            hung.proceed.set()
        return await asyncio.gather(running, quick, abandoned)

    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        concurrent.futures.ThreadPoolExecutor(1) as hung_pool,
    ):
        statuses = [e.status for e in asyncio.run(main(pool, hung_pool))]
    assert statuses == ["done", "done", "env_error"]


def test_run_episodes_runs_steps_on_the_callers_threads_and_ends_without_waiting_for_them():
    """run_episodes(threads=pool): synchronous steps and plain tools run on ``pool``; an episode
    whose step hung past its timeout on a pool of one thread still ends (its pin's release runs
    on a thread of the run's own, not queued behind that step), and so does the batch."""
    names = []

    class Recording:
        def step(self, turn):
            names.append(threading.current_thread().name)
            return StepResult(reward=1.0, done=True)

    tools = ToolEnvironment({}, reward=lambda turn: names.append(threading.current_thread().name) or 1.0)
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="caller") as pool:
        out = asyncio.run(
            run_episodes(ScriptedWorker(), [[5], [6]], lambda i, j: [Recording(), tools][i], n=2, threads=pool)
        )
    assert [e.status for e in out.episodes] == ["done"] * 4
    assert len(names) == 4 and all(name.startswith("caller") for name in names), names

    async def main(pool):
        hung = Blocking()
        # Long enough for the hung step's thread to start on a loaded machine (a step still queued
        # at its timeout is cancelled, never run, and holds no thread).
        limits = EpisodeLimits(env_timeout_s=2.0)
        run = asyncio.ensure_future(
            run_episodes(ScriptedWorker(), [[5], [6]], lambda i, j: [hung, Done()][i], limits=limits, threads=pool)
        )
        try:  # a bound for the failure only: the hung step is not released before it
            done, _ = await asyncio.wait({run}, timeout=60)
            assert run in done, "the batch waited for a step on the caller's threads"
            assert hung.started.is_set() and not hung.proceed.is_set()
        finally:
            hung.proceed.set()
        return run.result()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="caller") as pool:
        out = asyncio.run(main(pool))
    assert [e.status for e in out.episodes] == ["env_error", "done"]
    assert "took more than 2.0 s" in out.episodes[0].error


class Answers:
    """Answers each turn with the next of ``results``."""

    def __init__(self, *results):
        self.results = list(results)

    async def step(self, turn):
        return self.results.pop(0)


@pytest.mark.parametrize(
    "malformed",
    [
        StepResult(observation=None, reward=5.0),
        StepResult(observation=b"bytes", reward=5.0),
        StepResult(observation=[10**6], reward=5.0),
    ],
    ids=["no-observation", "bytes", "outside-the-vocabulary"],
)
def test_a_malformed_answer_earns_no_reward(malformed):
    env = Answers(StepResult(observation=[9], reward=1.0), malformed)
    limits = EpisodeLimits(max_turns=4, max_new_tokens=2)
    (episode_,) = asyncio.run(run_episodes(ScriptedWorker(), [[5]], lambda i, j: env, limits=limits)).episodes
    assert episode_.status == "env_error" and episode_.reward == 1.0  # the first, well-formed answer's


def test_episodes_without_a_seed_take_the_workers_call_seed():
    """As generate: from the worker's stream (WorkerConfig.seed), where they drew from the OS's."""
    out = asyncio.run(run_episodes(ScriptedWorker(), [[5], [6]], lambda i, j: Done(), n=2))
    assert out.batch.seeds.tolist() == row_seeds(ScriptedWorker().call_seed(None), 2, 2).ravel().tolist()


def test_episodes_of_a_prompt_pack_together_and_carry_their_seeds():
    out = asyncio.run(run_episodes(ScriptedWorker(), [[5], [6]], lambda i, j: Done(), n=2, seed=11))
    assert out.batch.seeds.tolist() == row_seeds(11, 2, 2).ravel().tolist()
    assert [e.seed for e in out.episodes] == out.batch.seeds.tolist()
    first, second = out.episodes[0], out.episodes[2]
    with pytest.raises(ValueError, match=r"episodes\[1\] starts from another first prompt than episodes\[0\]"):
        pack_episodes([first, second], n=2, pad_token_id=0)  # a group's failed episode filtered out
    with pytest.raises(ValueError, match="0 episodes are not n=2"):
        pack_episodes([], n=2, pad_token_id=0)
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        pack_episodes(out.episodes, n=0, pad_token_id=0)
    as_arrays = [dataclasses.replace(e, token_ids=np.array(e.token_ids)) for e in out.episodes]
    np.testing.assert_array_equal(pack_episodes(as_arrays, n=2, pad_token_id=0).tokens, out.batch.tokens)


def test_tools_a_template_does_not_write_and_environments_make_env_did_not_make_are_refused(tokenizer):
    worker = ScriptedWorker(tokenizer)
    with pytest.raises(InvalidRequest, match="'tools' must be a list") as error:
        asyncio.run(run_episodes(worker, [[5]], lambda i, j: Done(), tools=LONG_TOOL))
    assert error.value.field == "tools"

    async def make_env(i, j):  # a coroutine function: make_env is a plain one
        return Done()

    with pytest.raises(InvalidRequest, match=r"make_env\(0, 0\) returned coroutine, not an environment") as error:
        asyncio.run(run_episodes(worker, [[5]], make_env))
    assert error.value.field == "make_env" and worker.calls == 0

    without_tools = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    without_tools.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    with pytest.raises(InvalidRequest, match="the chat template does not write tools into the prompt") as error:
        asyncio.run(run_episodes(ScriptedWorker(without_tools), [[5]], lambda i, j: Done(), tools=[LONG_TOOL]))
    assert error.value.field == "tools"


def test_context_exceeded_names_the_limit_that_bites():
    limits = EpisodeLimits(max_turns=8, max_new_tokens=2, max_response_tokens=5, overflow="error")
    env = Answers(*[StepResult(observation=[9]) for _ in range(8)])
    (episode_,) = asyncio.run(run_episodes(ScriptedWorker(), [[5]], lambda i, j: env, limits=limits)).episodes
    assert episode_.status == "context_exceeded"
    assert episode_.error.endswith("more would pass the limit of 6 (EpisodeLimits.max_response_tokens)")


def test_a_reward_function_answering_no_number_fails_its_episode():
    env = ToolEnvironment({}, reward=lambda t: True)
    (episode_,) = asyncio.run(run_episodes(ScriptedWorker(), [[5]], lambda i, j: env)).episodes
    assert episode_.status == "env_error"
    assert episode_.error == "turn 0: TypeError: the reward function returned True (bool), not a number"


def test_calls_are_counted_when_a_step_is_cancelled_while_they_run():
    async def main():
        started = asyncio.Event()

        async def slow():
            started.set()
            await asyncio.Event().wait()

        env = ToolEnvironment({"slow": slow}, reward=lambda t: 0.0)
        step = asyncio.ensure_future(env.step(turn('<tool_call>{"name": "slow", "arguments": {}}</tool_call>')))
        await started.wait()
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        return env

    assert asyncio.run(main()).calls == 1


def test_options_the_worker_refuses_are_refused_before_any_environment_is_made():
    class NoAdapters(ScriptedWorker):
        def check_sampling(self, **sampling):
            if sampling.get("lora") is not None:
                raise InvalidRequest("lora", f"no LoRA adapter named {sampling['lora']!r} is loaded")
            return super().check_sampling(**sampling)

    worker, made = NoAdapters(), []
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'nope'"):
        asyncio.run(run_episodes(worker, [[5]], lambda i, j: made.append((i, j)) or Done(), lora="nope"))
    assert made == [] and worker.calls == 0


class Saying(ScriptedWorker):
    """Every turn samples ``texts``' next text (its tokens), as its completion text too."""

    def __init__(self, tokenizer, *texts):
        super().__init__(tokenizer)
        self.texts = list(texts)

    def turn(self, max_new_tokens):
        text = self.texts.pop(0)
        return self.tokenizer.encode(text)[:max_new_tokens], text, "stop"


@pytest.mark.parametrize("opened", ["<tool_call>\n", [{"type": "text", "text": "<tool_call>\n"}]], ids=["text", "part"])
def test_a_prefill_that_opens_a_tool_call_makes_the_first_turn_a_call(tokenizer, opened):
    """Prefilling "<tool_call>\\n" forces a call: the turn's text (the call's rest) had been parsed
    alone, found no call, and ended the episode as the final answer, the tool never run. Each
    turn's calls have ids of their own (every turn's first call had been call_0)."""
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    worker = Saying(tokenizer, call, "<tool_call>\n" + call, "3")
    ran, turns = [], []
    tools = ToolEnvironment({"add": lambda a, b: ran.append((a, b)) or a + b}, reward=lambda turn: 1.0)

    class Recording:
        async def step(self, turn):
            turns.append(turn)
            return await tools.step(turn)

    prompt = [{"role": "user", "content": "add 1 and 2"}, {"role": "assistant", "content": opened}]
    limits = EpisodeLimits(max_turns=3, max_new_tokens=40)
    (episode_,) = asyncio.run(run_episodes(worker, [prompt], lambda i, j: Recording(), limits=limits)).episodes
    assert episode_.status == "done" and episode_.reward == 1.0 and ran == [(1, 2), (1, 2)]
    assert turns[0].text == call  # the sampled text; parsed is the whole message's
    assert [[c.id for c in t.tool_calls] for t in turns] == [["call_0_0"], ["call_1_0"], []]
    assert turns[2].parsed.content == "3"


@pytest.mark.parametrize("element", ["b", 5, None])
def test_an_observation_list_holding_no_message_is_named(tokenizer, element):
    with pytest.raises(TypeError, match=rf"^observation\[1\] is {type(element).__name__} .*, not a message"):
        TurnFrames(tokenizer).observation(StepResult(observation=[{"role": "tool", "content": "a"}, element]))


@pytest.mark.parametrize(
    "rewards,turn,counted",
    [((3e38, 3e38), 1, 3e38), ((1e308, 1e308), 0, 0.0), ((1e39,), 0, 0.0)],
    ids=["summing-past-float32", "summing-past-float64", "one-past-float32"],
)
def test_rewards_past_the_batchs_float32_fail_their_episode_uncounted(rewards, turn, counted):
    """The batch's rewards are float32. The answer that would pass its range is not counted:
    it had been (the episode's reward inf), and a reward of 1e39 had been inf in the batch."""
    *first, last = rewards
    env = Answers(*[StepResult(observation=[9], reward=r) for r in first], StepResult(reward=last, done=True))
    limits = EpisodeLimits(max_turns=4, max_new_tokens=2)
    out = asyncio.run(run_episodes(ScriptedWorker(), [[5]], lambda i, j: env, limits=limits))
    (episode_,) = out.episodes
    assert episode_.status == "env_error" and episode_.error.startswith(f"turn {turn}: the episode's reward would sum")
    assert "beyond float32's range" in episode_.error
    assert episode_.reward == counted and out.rewards.tolist() == [np.float32(counted)]


def test_a_conversation_stays_within_max_tokens_per_call():
    """Each turn is a call of one row: WorkerConfig.max_tokens_per_call caps the conversation as
    the engine's limits do. The call past it had raised LimitExceeded, ending every episode."""
    worker = ScriptedWorker(max_tokens_per_call=12)
    env = Answers(*[StepResult(observation=[9, 9, 9]) for _ in range(5)])
    limits = EpisodeLimits(max_turns=6, max_new_tokens=2)
    (episode_,) = asyncio.run(run_episodes(worker, [[5, 6]], lambda i, j: env, limits=limits)).episodes
    assert episode_.status == "length" and len(episode_.token_ids) <= 12
    with pytest.raises(InvalidRequest, match=r"12 \(WorkerConfig\.max_tokens_per_call\)"):
        asyncio.run(run_episodes(worker, [list(range(1, 13))], lambda i, j: Done(), limits=limits))


@pytest.mark.parametrize("answer", [None, [1], "x"])
def test_a_reward_function_answering_none_or_a_list_is_named(answer):
    env = ToolEnvironment({}, reward=lambda t: answer)
    (episode_,) = asyncio.run(run_episodes(ScriptedWorker(), [[5]], lambda i, j: env)).episodes
    assert episode_.error == (
        f"turn 0: TypeError: the reward function returned {answer!r} ({type(answer).__name__}), not a number"
    )


def test_a_reward_past_a_floats_range_is_named():
    """An int no float holds: math.isfinite and float() raised OverflowError, and the episode's
    error named no reward ("turn 0: OverflowError: int too large to convert to float")."""
    huge = 10**400
    envs = [Answers(StepResult(reward=huge, done=True)), ToolEnvironment({}, reward=lambda t: huge)]
    out = asyncio.run(run_episodes(ScriptedWorker(), [[5], [6]], lambda i, j: envs[i]))
    assert [e.status for e in out.episodes] == ["env_error"] * 2
    step, tools = (e.error for e in out.episodes)
    assert step.startswith("turn 0: TypeError: StepResult.reward must be a finite number, got 1000") and step.endswith(
        " (int)"
    )
    assert tools.startswith("turn 0: ValueError: the reward function returned 1000") and tools.endswith(
        "(int), beyond a float's range"
    )
