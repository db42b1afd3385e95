"""Sessions (a conversation's prefix pinned between its calls) and multi-turn episodes."""

import jax
import numpy as np
import pytest

from rollout import InvalidRequest, RolloutWorker
from tests.helpers import tiny_worker_config
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
