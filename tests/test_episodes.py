"""Sessions (a conversation's prefix pinned between its calls) and multi-turn episodes."""

import asyncio

import jax
import numpy as np
import pytest

from models import router_choices
from rollout import InvalidRequest, RolloutWorker, WorkerUnavailable
from rollout.episodes import EpisodeLimits, StepResult, Turn, run_episode, run_episodes
from tests.helpers import flax_model, tiny_worker_config
from trainer_bridge import load_hf_params

pytestmark = pytest.mark.one_end


@pytest.fixture(scope="module")
def worker(chat_dir):
    # A KV pool of 256 tokens, so that a few other requests evict every unpinned prefix.
    config = tiny_worker_config(chat_dir, max_total_tokens=256, session_budget_tokens=100)
    with RolloutWorker(config) as w:
        yield w


def fill_the_kv_pool(worker):
    """Requests that need nearly the whole pool: the cache evicts every prefix it may."""
    worker.generate([[200 + i for i in range(40)]], n=4, max_new_tokens=20, ignore_eos=True)
    worker.generate([[100 + i for i in range(60)]], n=2, max_new_tokens=60, ignore_eos=True)


def test_a_session_keeps_its_conversation_cached_while_other_requests_need_the_memory(worker):
    first = [10 + i for i in range(30)]
    turn = worker.generate([first], max_new_tokens=8, ignore_eos=True, seed=1, session="kept")
    assert turn.cached_tokens.tolist() == [0]
    (stats,) = worker.session_stats()
    assert (stats.sessions, stats.pinned_tokens) == (1, 30 + 8 - 1)  # the last token has no KV yet
    fill_the_kv_pool(worker)
    following = first + turn.completions[0] + [5, 6, 7]
    second = worker.generate([following], max_new_tokens=8, ignore_eos=True, seed=2, session="kept")
    assert second.cached_tokens.tolist() == [30 + 8 - 1]
    (stats,) = worker.session_stats()
    assert (stats.sessions, stats.pinned_tokens) == (1, len(following) + 8 - 1)  # the longer prefix replaced it
    assert worker.release_session("kept") and not worker.release_session("kept")
    assert worker.session_stats()[0].sessions == 0
    for no_name in (None, 123, ""):  # None and 123 had been an AttributeError from a hash of the name
        with pytest.raises(InvalidRequest, match="session must be a non-empty string") as refused:
            worker.release_session(no_name)
        assert refused.value.field == "session"

    # Without a session the same conversation is evicted by the same requests.
    other = [40 + i for i in range(30)]
    turn = worker.generate([other], max_new_tokens=8, ignore_eos=True, seed=1)
    fill_the_kv_pool(worker)
    second = worker.generate([other + turn.completions[0] + [5]], max_new_tokens=8, ignore_eos=True, seed=2)
    assert second.cached_tokens.tolist() == [0]


def test_pins_past_the_budget_release_the_oldest_first(worker):
    before = worker.session_stats()[0]
    for k in range(3):  # 3 x 47 tokens against a budget of 100: the first is released
        worker.generate([[20 + k * 50 + i for i in range(40)]], max_new_tokens=8, ignore_eos=True, session=f"b{k}")
    stats = worker.session_stats()[0]
    assert stats.sessions == 2 and stats.pinned_tokens == 2 * 47 <= stats.budget_tokens == 100
    assert stats.released_for_budget == before.released_for_budget + 1
    assert not worker.release_session("b0")
    assert worker.release_session("b1") and worker.release_session("b2")


def test_a_weight_sync_and_a_kv_drop_release_every_pin_and_the_idle_engine_stays_sound(worker, chat_dir):
    params = jax.device_put(load_hf_params(chat_dir), worker.param_shardings())
    for flush in (lambda: worker.sync_params(params), worker.drop_kv):
        worker.generate([[7] * 20], max_new_tokens=4, ignore_eos=True, session="flushed")
        assert worker.session_stats()[0].sessions == 1
        flush()
        assert worker.session_stats()[0].sessions == 0
        assert not worker.release_session("flushed")
    # The idle scheduler's leak check ran with pins held, and after they went: still serving.
    assert worker.generate([[7] * 20], max_new_tokens=4, ignore_eos=True).completions[0]


def test_pins_never_keep_a_request_from_running(worker):
    """Pinned tokens are neither free nor evictable: a request that needs them would wait for
    ever, and with it the sessions' next calls. With nothing running the pins are released."""
    worker.generate([[30 + i for i in range(80)]], max_new_tokens=10, ignore_eos=True, session="holding")
    assert worker.session_stats()[0].pinned_tokens == 89
    # 230 tokens of a 256-token pool: more than the pool less the 89 pinned.
    batch = worker.generate([[120 + i for i in range(30)]], max_new_tokens=200, ignore_eos=True)
    assert len(batch.completions[0]) == 200
    assert worker.session_stats()[0].sessions == 0 and not worker.release_session("holding")


@pytest.mark.parametrize(
    "prompts, n, message",
    [
        ([[1, 2], [3, 4]], 1, "one prompt and n=1, got 2 prompt"),
        ([[1, 2]], 2, "x n=2"),
    ],
)
def test_a_session_call_continues_one_conversation(worker, prompts, n, message):
    with pytest.raises(InvalidRequest, match=message) as error:
        worker.generate(prompts, n=n, session="s")
    assert error.value.field == "session"


def test_a_session_key_is_a_string(worker):
    with pytest.raises(InvalidRequest, match="session must be a non-empty string"):
        worker.generate([[1, 2]], session=3)
    assert np.array_equal(worker.generate([[1, 2]], max_new_tokens=1).cached_tokens.shape, (1,))


# ---- episodes -------------------------------------------------------------------------------------

LIMITS = EpisodeLimits(max_turns=5, max_new_tokens=12)
IM_END = 2  # models/tiny.py's SPECIAL_TOKENS


@pytest.fixture(scope="module")
def episode_worker(chat_dir):
    config = tiny_worker_config(chat_dir, max_total_tokens=8192, context_length=512, max_running_requests=64)
    with RolloutWorker(config) as w:
        yield w


class Talk:
    """Answers every turn with a user message, done after ``turns`` turns (reward 1 then);
    ``delay``: an async step that sleeps that long first."""

    def __init__(self, turns: int = 5, delay: float = 0.0):
        self.turns, self.delay, self.seen = turns, delay, []

    async def step(self, turn: Turn) -> StepResult:
        self.seen.append(turn)
        if self.delay:
            await asyncio.sleep(self.delay)
        if len(self.seen) == self.turns:
            return StepResult(reward=1.0, done=True)
        return StepResult(observation=f"now {len(self.seen)}+{len(self.seen)}=", reward=0.25)


def sampled_spans(episode):
    return [(t.start, t.end) for t in episode.turns]


def test_the_trainer_gets_exactly_the_sampled_tokens_across_five_turns(episode_worker):
    worker, envs = episode_worker, []
    prompt = [{"role": "user", "content": "what is 12+30? then 7+7?"}]

    def make_env(i, j):
        envs.append(Talk())
        return envs[-1]

    out = worker.run_episodes([prompt], make_env, limits=LIMITS, temperature=0.0, return_logprobs=True, seed=5)
    (episode,) = out.episodes
    assert episode.status == "done" and len(episode.turns) == 5 and episode.reward == pytest.approx(2.0)
    tokens = episode.token_ids
    mask = np.zeros(len(tokens), bool)
    drifted = 0
    for turn, seen in zip(episode.turns, envs[0].seen):
        sampled = tokens[turn.start : turn.end]
        assert sampled == seen.token_ids  # what the environment was shown
        mask[turn.start : turn.end] = True
        # The model's own tokens for this conversation, sampled again from scratch (greedy).
        again = worker.generate(
            [tokens[: turn.start]], temperature=0.0, max_new_tokens=turn.end - turn.start, stop_token_ids=[IM_END]
        )
        assert again.completions[0] == sampled
        # Decoding and encoding again would have handed the trainer other tokens.
        drifted += worker.tokenizer.encode(seen.text, add_special_tokens=False) != sampled
    assert drifted >= 1
    assert np.array_equal(episode.loss_mask, mask)
    assert np.all(episode.logprobs[mask] < 0) and np.all(episode.logprobs[~mask] == 0)
    assert np.all(episode.token_versions[mask] == worker.weight_version) and np.all(episode.token_versions[~mask] == -1)
    # Each observation is framed as a ChatML user turn, once, after the model's turn is closed.
    text = worker.tokenizer.decode(tokens[episode.turns[0].end : episode.turns[0].observation_end])
    assert text.endswith("<|im_end|>\n<|im_start|>user\nnow 1+1=<|im_end|>\n<|im_start|>assistant\n")
    # The batch the RL loop trains on: the same tokens, the loss mask as completion_mask.
    batch = out.batch
    width = batch.prompt_width
    assert width == episode.prompt_length
    rest = len(tokens) - width
    assert batch.tokens[0, : width + rest].tolist() == tokens
    assert np.array_equal(batch.completion_mask[0, : width + rest], mask)
    assert np.array_equal(batch.logprobs[0, : width + rest], episode.logprobs)
    assert batch.attention_mask[0, : width + rest].all() and batch.finish_reasons == ["done"]


def test_each_turn_prefills_only_what_was_appended(episode_worker):
    out = episode_worker.run_episodes(
        [[{"role": "user", "content": "count 1 2 3 4 5 6 7 8 9"}]], lambda i, j: Talk(4), n=2, limits=LIMITS, seed=8
    )
    for episode in out.episodes:
        first, *later = episode.turns
        assert first.prompt_tokens == episode.prompt_length
        # The engine's cache hits and our count of its prefill work agree (nothing retracted here).
        assert all(t.prefill_tokens == t.prompt_tokens - t.cached_tokens for t in episode.turns)
        for before, turn in zip(episode.turns, later):
            # The previous turn's last sampled token (no forward took it yet) and what followed it.
            assert turn.prefill_tokens == before.observation_end - before.end + 1
        assert episode.prefill_tokens < sum(t.prompt_tokens for t in episode.turns) / 2


def test_64_concurrent_episodes_with_environments_that_sleep_at_random_lose_nothing(episode_worker):
    rng = np.random.default_rng(0)
    envs = {}

    def make_env(i, j):
        envs[i, j] = Talk(4, delay=float(rng.uniform(0, 0.05)))
        return envs[i, j]

    prompts = [[{"role": "user", "content": f"{a}+{a}="}] for a in range(16)]
    limits = EpisodeLimits(max_turns=6, max_new_tokens=8)
    out = episode_worker.run_episodes(prompts, make_env, n=4, limits=limits, temperature=1.0, seed=1)
    assert len(out.episodes) == 64 and out.batch.size == 64
    for row, episode in enumerate(out.episodes):
        env = envs[row // 4, row % 4]
        assert episode.status == "done" and len(episode.turns) == 4 == len(env.seen)
        assert [t.index for t in env.seen] == [0, 1, 2, 3]
        assert [episode.token_ids[t.start : t.end] for t in episode.turns] == [t.token_ids for t in env.seen]
        assert episode.reward == pytest.approx(1.75)
    assert out.rewards.tolist() == [1.75] * 64
    # Every pin was released, every KV slot given back.
    assert episode_worker.session_stats()[0].sessions == 0
    assert episode_worker.engine.testing.kv_tokens_held() == 0


class Failing:
    def __init__(self, how: str):
        self.how = how

    async def step(self, turn: Turn):
        if turn.index == 0:
            return StepResult(observation="go on")
        if self.how == "raise":
            raise RuntimeError("the tool server is down")
        if self.how == "hang":
            await asyncio.Event().wait()
        return 42


class SyncTalk:
    def step(self, turn: Turn) -> StepResult:  # a plain function: run in a thread
        return StepResult(observation=[5, 6, 7], done=turn.index == 2, reward=1.0)


def test_a_failing_environment_ends_its_own_episode_only(episode_worker):
    def run(envs, **limits):
        limits = EpisodeLimits(max_turns=4, max_new_tokens=6, **limits)
        return episode_worker.run_episodes(
            [[{"role": "user", "content": "hi"}]] * len(envs), lambda i, j: envs[i], limits=limits, seed=2
        ).episodes

    # The hanging one alone under a short timeout: a step on a thread starved for that long on a
    # loaded host would fail too.
    hung = run([Failing("hang")], env_timeout_s=1.0)
    episodes = run([Failing("raise"), Failing("return"), SyncTalk(), Talk(2)])
    episodes.insert(1, hung[0])
    statuses = [(e.status, e.error) for e in episodes]
    assert statuses[0] == ("env_error", "turn 1: RuntimeError: the tool server is down")
    assert statuses[1][0] == "env_error" and "more than 1.0 s (EpisodeLimits.env_timeout_s)" in statuses[1][1]
    assert statuses[2] == ("env_error", "turn 1: TypeError: the environment's step returned int, not a StepResult")
    assert statuses[3:] == [("done", None), ("done", None)]
    # Each failed episode keeps what happened before the failure, for inspection or training.
    assert all(len(e.turns) == 2 for e in episodes[:3])
    # Token observations are framed as the template frames text.
    framed = episodes[3]
    observation = framed.token_ids[framed.turns[0].end : framed.turns[0].observation_end]
    content = episode_worker.tokenizer.decode([5, 6, 7])
    assert episode_worker.tokenizer.decode(observation) == (
        f"<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert any(observation[k : k + 3] == [5, 6, 7] for k in range(len(observation)))


def test_a_cancelled_episode_frees_its_turn_and_the_others_finish(episode_worker):
    started = asyncio.Event()

    class Announcing:
        """The worker, saying when the cancelled episode's second turn starts generating."""

        def __getattr__(self, name):
            return getattr(episode_worker, name)

        first_prompt = None

        async def agenerate(self, prompts, **options):
            if self.first_prompt is None:
                self.first_prompt = len(prompts[0])
            elif len(prompts[0]) > self.first_prompt:  # the second turn
                started.set()
            return await episode_worker.agenerate(prompts, **options)

    async def main():
        limits = EpisodeLimits(max_turns=3, max_new_tokens=200)
        long_turns = dict(limits=limits, ignore_eos=True, seed=3)
        cancelled = asyncio.ensure_future(
            run_episode(Announcing(), [{"role": "user", "content": "a long one"}], Talk(3), **long_turns)
        )
        others = [
            asyncio.ensure_future(run_episode(episode_worker, [{"role": "user", "content": f"{k}"}], Talk(2), seed=k))
            for k in range(3)
        ]
        await started.wait()
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return await asyncio.gather(*others)

    results = asyncio.run(main())
    assert [r.status for r in results] == ["done"] * 3
    assert episode_worker.session_stats()[0].sessions == 0
    assert episode_worker.engine.testing.kv_tokens_held() == 0


def test_the_answer_to_the_last_allowed_turn_is_not_appended(episode_worker):
    limits = EpisodeLimits(max_turns=2, max_new_tokens=6)
    out = episode_worker.run_episodes([[{"role": "user", "content": "go"}]], lambda i, j: Talk(10), limits=limits)
    (episode,) = out.episodes
    assert episode.status == "max_turns" and len(episode.turns) == 2
    assert episode.turns[0].observation_end > episode.turns[0].end
    assert episode.turns[1].observation_end == episode.turns[1].end == len(episode.token_ids)


def test_a_response_limit_bounds_what_follows_the_prompt(episode_worker):
    limits = EpisodeLimits(max_turns=10, max_new_tokens=10, max_response_tokens=40)
    out = episode_worker.run_episodes(
        [[{"role": "user", "content": "go"}], [{"role": "user", "content": "a longer first prompt"}]],
        lambda i, j: Talk(10),
        limits=limits,
        ignore_eos=True,
        completion_width=40,
    )
    assert [e.status for e in out.episodes] == ["length", "length"]
    assert all(len(e.token_ids) - e.prompt_length <= 40 for e in out.episodes)
    assert out.batch.tokens.shape[1] == out.batch.prompt_width + 40


@pytest.mark.parametrize("overflow, status", [("truncate", "length"), ("error", "context_exceeded")])
def test_a_conversation_past_its_limit_ends_as_the_caller_chose(episode_worker, overflow, status):
    limits = EpisodeLimits(max_turns=10, max_new_tokens=10, max_total_tokens=60, overflow=overflow)
    out = episode_worker.run_episodes(
        [[{"role": "user", "content": "go"}]], lambda i, j: Talk(10), limits=limits, ignore_eos=True, seed=4
    )
    (episode,) = out.episodes
    assert episode.status == status
    assert len(episode.token_ids) <= 60
    if overflow == "error":
        assert "10 more would pass the limit of 60" in episode.error
    else:  # the last turn sampled what fitted, then nothing fitted
        assert episode.turns[-1].end - episode.turns[-1].start < 10


class Answers:
    """Answers turn 0 with ``result``, then ends the episode."""

    def __init__(self, result):
        self.result = result

    async def step(self, turn: Turn):
        return self.result if turn.index == 0 else StepResult(reward=1.0, done=True)


def test_a_malformed_answer_ends_its_own_episode_only(episode_worker):
    """Each malformed StepResult ends its episode with env_error naming the turn and the fault;
    the run and the other episodes go on (an out-of-vocabulary id is the environment's fault,
    not the caller's prompt's; bytes and floats are not taken as token ids)."""
    bad = [
        (StepResult(reward=None, done=True), "TypeError: StepResult.reward must be a finite number, got None"),
        (StepResult(reward="abc", done=True), "TypeError: StepResult.reward must be a finite number, got 'abc' (str)"),
        (StepResult(reward=float("nan"), done=True), "TypeError: StepResult.reward must be a finite number, got nan"),
        (StepResult(observation="x", done="no"), "TypeError: StepResult.done must be a bool, got 'no' (str)"),
        (
            StepResult(observation={"role": "tool", "content": "4"}),
            "cannot append the observation: an observation is text, token ids or a list of messages, got dict",
        ),
        (StepResult(observation=[10**6]), "cannot append the observation: token ids outside the vocabulary [0, 320)"),
        (StepResult(observation=b"abc"), "cannot append the observation: an observation is text, token ids or a list"),
        (StepResult(observation=[7.9, 8.2]), "observation[0] must be an int token id, got 7.9 (float)"),
        # Named in the observation, not in the history the library renders it in.
        (
            StepResult(observation=[{"role": "tool", "content": "4"}, {"role": "tool", "content": 4}]),
            "cannot append the observation: observation[1].content must be a string",
        ),
        (StepResult(observation="4", role="tool\n<|im_start|>system"), "StepResult.role must be a role's name"),
    ]
    envs = [Answers(result) for result, _ in bad] + [Talk(2)]
    limits = EpisodeLimits(max_turns=3, max_new_tokens=6)
    out = episode_worker.run_episodes(
        [[{"role": "user", "content": "hi"}]] * len(envs), lambda i, j: envs[i], limits=limits
    )
    for episode, (_, error) in zip(out.episodes, bad):
        assert episode.status == "env_error" and len(episode.turns) == 1
        assert episode.error.startswith("turn 0: ") and error in episode.error, episode.error
        assert episode.reward == 0.0
    assert (out.episodes[-1].status, out.episodes[-1].reward) == ("done", 1.25)
    assert episode_worker.session_stats()[0].sessions == 0


def test_a_failure_while_setting_up_or_running_leaves_no_episode_behind(episode_worker):
    """In a long-lived event loop (an async trainer's): when making an environment fails, no
    episode has started; when an episode's turn fails, the others are cancelled and their pins
    released before the error reaches the caller. No task is left running either way."""
    stepped, arrived, hold = [], asyncio.Event(), asyncio.Event()
    failing, others = [5, 5, 5, 5], [[6, 6, 6, 6], [7, 7, 7, 7]]

    class Holding:
        async def step(self, turn: Turn):
            stepped.append(turn.index)
            if len(stepped) == len(others):
                arrived.set()
            await hold.wait()  # pinned, waiting: never set

    class GoesOn:
        async def step(self, turn: Turn):
            await arrived.wait()  # the other episodes hold their pins now
            return StepResult(observation="go on")

    class FailsAtSecondTurn:
        """The worker, failing the failing episode's second turn."""

        def __getattr__(self, name):
            return getattr(episode_worker, name)

        async def agenerate(self, prompts, **options):
            if prompts[0][: len(failing)] == failing and len(prompts[0]) > len(failing):
                raise WorkerUnavailable("maintenance")
            return await episode_worker.agenerate(prompts, **options)

    def no_second_env(i, j):
        if i == 1:
            raise KeyError("no environment for prompt 1")
        return Holding()

    async def trainer_loop():
        limits = EpisodeLimits(max_turns=3, max_new_tokens=6)
        with pytest.raises(KeyError):
            await episode_worker.arun_episodes(others, no_second_env, limits=limits, seed=1)
        assert asyncio.all_tasks() == {asyncio.current_task()} and stepped == []
        envs = [GoesOn(), Holding(), Holding()]
        with pytest.raises(WorkerUnavailable):
            await run_episodes(FailsAtSecondTurn(), [failing] + others, lambda i, j: envs[i], limits=limits, seed=1)
        assert asyncio.all_tasks() == {asyncio.current_task()} and len(stepped) == 2
        assert episode_worker.session_stats()[0].sessions == 0

    asyncio.run(trainer_loop())
    assert episode_worker.engine.testing.kv_tokens_held() == 0


@pytest.fixture(scope="module")
def moe_worker(moe_dir):
    with RolloutWorker(tiny_worker_config(moe_dir, load_format="auto", record_routing=True)) as w:
        yield w


class TokenTalk:
    """Answers each turn with token ids (the model has no tokenizer), done after 3 turns."""

    async def step(self, turn: Turn) -> StepResult:
        if turn.index == 2:
            return StepResult(reward=1.0, done=True)
        return StepResult(observation=[30 + turn.index, 31, 32])


def test_an_episodes_routing_is_its_whole_conversations(moe_worker, moe_dir):
    """return_routing: every token a forward took as input, the first prompt, earlier turns and
    observations included (found in the session's cache by later turns), carries the experts
    the fp32 Flax model routes it to over the whole conversation; the last sampled token and
    the padding -1. The batch's routing is the episodes', aligned with its tokens."""
    limits = EpisodeLimits(max_turns=3, max_new_tokens=6, max_response_tokens=30)
    out = moe_worker.run_episodes(
        [[5, 17, 42, 8], [100, 3]],
        lambda i, j: TokenTalk(),
        n=2,
        limits=limits,
        ignore_eos=True,
        seed=3,
        return_routing=True,
        pad_prompts_to=6,
        completion_width=30,
    )
    batch = out.batch
    assert all(e.status == "done" and len(e.turns) == 3 for e in out.episodes)
    assert all(t.cached_tokens > 0 for e in out.episodes for t in e.turns[1:])
    params = load_hf_params(moe_dir)
    own = np.asarray(router_choices(flax_model(moe_dir), params, batch.tokens, batch.attention_mask, batch.positions))
    routed = batch.routed_experts
    assert routed.shape == batch.tokens.shape + (1, 2)
    recorded = routed[..., 0, 0] >= 0
    expected = batch.attention_mask.copy()
    expected[np.arange(batch.size), batch.prompt_width + batch.completion_lengths - 1] = False
    np.testing.assert_array_equal(recorded, expected)
    np.testing.assert_array_equal(routed[recorded], own[recorded])
    assert np.all(routed[~recorded] == -1)
    for row, episode in enumerate(out.episodes):
        start = batch.prompt_width - episode.prompt_length
        np.testing.assert_array_equal(routed[row, start : start + len(episode.token_ids)], episode.routed_experts)
