"""Sessions: a conversation's KV kept in the prefix cache between its calls (scheduler thread).

A multi-turn episode sends turn N+1 as turn N's tokens plus what its environment appended. The
radix cache already finds turn N's tokens, unless it evicted them while the episode waited on
its environment: an unlocked prefix is the first thing eviction frees under memory pressure. A
request sent with a session key locks, as it finishes, the prefix it leaves in the cache (its
prompt and every sampled token but the last, whose KV no forward computed) under that key,
until the session's next request finishes (which locks its own, longer prefix) or the session
is released.

Bounds: a session pins at most ``max_session_tokens`` (the first ones: a longer conversation's
tail stays evictable), and all sessions of an engine at most ``budget_tokens`` together; a pin
that would pass the budget releases the oldest pins first (their prefixes become evictable
again, not freed: they are found if nothing needed their memory meanwhile). Each pin released
that way is counted (``released_for_budget``). Pins never stop the engine: when requests wait
and nothing runs (the idle scheduler's check), every pin is released. Weight changes and KV
drops, which flush the prefix cache, release every pin first.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Hashable

logger = logging.getLogger(__name__)

_ATTRIBUTE = "_rollout_sessions"


@dataclasses.dataclass(frozen=True)
class SessionStats:
    """What an engine's session pins hold (read on the scheduler thread)."""

    sessions: int  # sessions holding a pin
    pinned_tokens: int  # tokens those pins hold (a token shared by two pins counts twice)
    budget_tokens: int
    pins_made: int
    released_for_budget: int


class SessionPins:
    """The pins of one engine's prefix cache; every method runs on the scheduler thread, except
    :meth:`expect` and :meth:`withdraw` (the request loop registers its requests' sessions)."""

    def __init__(self, tree, budget_tokens: int, max_session_tokens: int | None = None):
        self._tree = tree
        self.budget_tokens = budget_tokens
        self.max_session_tokens = max_session_tokens
        # rid -> session key of a request in flight that pins its prefix when it finishes.
        self.wanted: dict[str, Hashable] = {}
        # session -> (locked node, tokens it holds), oldest pin first.
        self._pins: collections.OrderedDict[Hashable, tuple[object, int]] = collections.OrderedDict()
        self._pins_made = 0
        self._released_for_budget = 0

    @property
    def caching(self) -> bool:
        """False when the engine keeps no prefix cache (``EngineOptions.prefix_cache=False``)."""
        return hasattr(self._tree, "root_node") and not getattr(self._tree, "disable", False)

    def expect(self, rid: str, session: Hashable) -> None:
        self.wanted[rid] = session

    def withdraw(self, rid: str) -> None:
        self.wanted.pop(rid, None)

    def finished(self, req) -> None:
        """After ``cache_finished_req`` put ``req``'s tokens in the cache: pin them for its session."""
        session = self.wanted.get(req.rid)
        if session is None or not self.caching:
            return
        key = (list(req.origin_input_ids) + list(req.output_ids))[:-1]
        if self.max_session_tokens is not None:
            key = key[: self.max_session_tokens]
        match = self._tree.match_prefix(key)
        node, tokens = match.last_device_node, len(match.device_indices)
        if node is self._tree.root_node or tokens == 0:
            self.release(session)
            return
        self._tree.inc_lock_ref(node)
        self.release(session)  # after the new lock: the shared part never becomes evictable
        self._pins[session] = (node, tokens)
        self._pins_made += 1
        while self.pinned_tokens > self.budget_tokens and len(self._pins) > 1:
            oldest = next(iter(self._pins))
            self.release(oldest)
            self._released_for_budget += 1
        if self.pinned_tokens > self.budget_tokens:  # this pin alone is over the budget
            self.release(session)
            self._released_for_budget += 1

    def release(self, session: Hashable) -> bool:
        """Unlock a session's prefix (it stays cached, now evictable). False if it held none."""
        entry = self._pins.pop(session, None)
        if entry is None:
            return False
        self._tree.dec_lock_ref(entry[0])
        return True

    def release_all(self) -> None:
        """Unlock every pin (before a flush evicts what is unlocked)."""
        for session in list(self._pins):
            self.release(session)

    def forget_all(self) -> None:
        """The prefix cache was reset: its nodes, and the locks on them, are gone."""
        self._pins.clear()

    @property
    def holding(self) -> bool:
        return bool(self._pins)

    @property
    def sessions(self) -> list[Hashable]:
        return list(self._pins)

    def locked_tokens(self) -> int:
        """Tokens of the cache's nodes the pins lock, each node once (shared prefixes too)."""
        seen: set[int] = set()
        tokens = 0
        for node, _ in self._pins.values():
            while node is not self._tree.root_node and id(node) not in seen:
                seen.add(id(node))
                tokens += len(node.value)
                node = node.parent
        return tokens

    @property
    def pinned_tokens(self) -> int:
        return sum(tokens for _, tokens in self._pins.values())

    def stats(self) -> SessionStats:
        return SessionStats(
            len(self._pins), self.pinned_tokens, self.budget_tokens, self._pins_made, self._released_for_budget
        )


def install(scheduler, budget_tokens: int, max_session_tokens: int | None = None) -> SessionPins:
    """Give ``scheduler`` session pins: its prefix cache pins a session's prefix as the
    session's request finishes. Before its first request."""
    tree = scheduler.tree_cache
    pins = SessionPins(tree, budget_tokens, max_session_tokens)
    setattr(scheduler, _ATTRIBUTE, pins)
    cache_finished_req = tree.cache_finished_req

    def cache_and_pin(req):
        cache_finished_req(req)
        pins.finished(req)

    tree.cache_finished_req = cache_and_pin
    scheduler.check_memory = _idle_check_with_pins(scheduler, pins, scheduler.check_memory)
    return pins


def _idle_check_with_pins(scheduler, pins: SessionPins, check_memory):
    """The idle scheduler's leak check, which wants every token free or evictable, with the
    pinned tokens as a third place a token may be: exactly the tokens on the pins' paths to the
    root, and nothing else locked (an idle scheduler's requests hold no locks)."""

    def check():
        if pins.holding and scheduler.waiting_queue:
            # Nothing ran although requests wait: they may need the pinned memory (a session's
            # next turn among them, the only thing that would move a pin). Unpinned, the
            # prefixes stay cached until eviction needs them.
            logger.info("requests wait with nothing running: releasing %d session pins", len(pins.sessions))
            pins.release_all()
            # The scheduler marked its batch full when the head of the queue did not fit; only a
            # finished request would clear that, and none runs: admission is retried now.
            scheduler.running_batch.batch_is_full = False
        if not pins.holding:
            return check_memory()
        tree = scheduler.tree_cache
        pinned = pins.locked_tokens()
        available = scheduler.token_to_kv_pool_allocator.available_size()
        evictable = tree.evictable_size()
        if tree.protected_size() != pinned or available + evictable + pinned != scheduler.max_total_num_tokens:
            raise ValueError(
                f"token_to_kv_pool_allocator memory leak detected! max_total_num_tokens="
                f"{scheduler.max_total_num_tokens}, available={available}, evictable={evictable}, "
                f"protected={tree.protected_size()}, pinned by sessions={pinned}"
            )
        pool = scheduler.req_to_token_pool
        if len(pool.free_slots) != pool.size:
            raise ValueError(f"req_to_token_pool memory leak detected! free={len(pool.free_slots)}, size={pool.size}")

    return check


def pins_of(scheduler) -> SessionPins | None:
    return scheduler.__dict__.get(_ATTRIBUTE)
