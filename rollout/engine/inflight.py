"""In-flight weight swaps: what happens to the scheduler's running requests and prefix cache
when the weights change between two forward steps (scheduler thread only).

At a forward boundary (the top of a scheduler loop iteration) the requests holding KV are the
running decode batch, the prefill batch just run (merged into the running batch by the next
iteration) and at most one request half-way through a chunked prefill. After a swap:

- ``recompute=True``: every one of them is retracted as sglang-jax's own retract-decode path
  does (``Req.reset_for_retract``) and put back at the head of the waiting queue, and the whole
  KV state is reset: each is prefilled again, prompt plus the tokens it has, under the new
  weights before it samples its next token.
- ``recompute=False``: decode requests keep their KV (computed under the old weights) and go
  on. The prefix cache is flushed for everyone else: unlocked prefixes are evicted, and the
  prefixes the running requests still hold are moved under keys no token sequence matches, so
  no later request reuses them; a request that continues from them gives its KV back without
  inserting it into the cache. The request being chunked restarts its prefill (it has no
  sampled token yet, so this costs only the chunks already done).
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from . import sessions

# The per-scheduler bookkeeping of requests continuing from KV of earlier weights.
_STALE = "_rollout_stale_kv"


@dataclasses.dataclass(frozen=True)
class SwapRecord:
    """One weight swap on the scheduler thread (``time.perf_counter()`` seconds)."""

    version: int
    queued: float  # when the swap was asked for
    start: float
    end: float
    in_flight: bool
    running: int  # requests holding KV at the swap
    recomputed_tokens: int  # tokens those requests prefill again (recompute only)


def _unfinished(reqs) -> list:
    seen, out = set(), []
    for req in reqs:
        if id(req) not in seen and not req.finished():
            seen.add(id(req))
            out.append(req)
    return out


def decoding_requests(scheduler) -> list:
    """Requests past their prefill that hold KV at a forward boundary."""
    reqs = list(scheduler.running_batch.reqs)
    last = scheduler.last_batch
    if last is not None and last.forward_mode.is_extend():
        chunked = last.chunked_req
        reqs += [r for r in last.reqs if r is not chunked]
    return _unfinished(reqs)


def output_lengths(scheduler) -> dict[str, int]:
    """rid -> tokens sampled so far, for every request the scheduler holds (waiting or running)."""
    reqs = list(scheduler.waiting_queue) + decoding_requests(scheduler)
    if scheduler.chunked_req is not None:
        reqs.append(scheduler.chunked_req)
    return {req.rid: len(req.output_ids) for req in _unfinished(reqs)}


def reset_kv_state(scheduler) -> None:
    """Forget every cached prefix and KV allocation (no request may hold KV)."""
    pins = sessions.pins_of(scheduler)
    if pins is not None:
        pins.forget_all()
    scheduler.tree_cache.reset()
    scheduler.req_to_token_pool.clear()
    scheduler.token_to_kv_pool_allocator.clear()
    scheduler.last_batch = None
    scheduler.__dict__.get(_STALE, {}).clear()


def recompute_running(scheduler) -> tuple[int, int]:
    """Retract every request holding KV to the head of the waiting queue and reset the KV
    state: they are prefilled again under the weights now in place. Returns (requests, tokens
    they prefill again)."""
    from sgl_jax.srt.managers.schedule_batch import ScheduleBatch

    reqs = decoding_requests(scheduler)
    chunked = scheduler.chunked_req
    if chunked is not None and not chunked.finished():
        reqs.append(chunked)
    for req in reqs:
        req.reset_for_retract()
    scheduler.chunked_req = None
    scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    scheduler.waiting_queue[:0] = reqs
    reset_kv_state(scheduler)
    return len(reqs), sum(len(r.origin_input_ids) + len(r.output_ids) for r in reqs)


def keep_running(scheduler) -> int:
    """Flush the prefix cache while decode requests keep their KV. Returns how many do."""
    tree = scheduler.tree_cache
    stale = _stale_requests(scheduler)
    chunked = scheduler.chunked_req
    if chunked is not None and not chunked.finished():
        _restart_chunked(scheduler, chunked)
    if getattr(tree, "disable", True):
        return len(decoding_requests(scheduler))
    pins = sessions.pins_of(scheduler)
    if pins is not None:  # their prefixes hold the old weights' KV: evicted with the rest
        pins.release_all()
    tree.evict(tree.evictable_size())
    # What is left is held by running requests: out of reach of every lookup and insert, still
    # reached by eviction once they let go.
    root = tree.root_node
    for key in [k for k in root.children if not _is_stale_key(k)]:
        root.children[("stale", next(_stale_keys))] = root.children.pop(key)
    running = decoding_requests(scheduler)
    for req in running:
        entry = stale.get(req.rid)
        if entry is None or entry[0] is not req.prefix_indices:
            stale[req.rid] = (req.prefix_indices, len(req.prefix_indices))
    return len(running)


_stale_keys = itertools.count()


def _is_stale_key(key) -> bool:
    return isinstance(key, tuple) and len(key) == 2 and key[0] == "stale"


def _restart_chunked(scheduler, req) -> None:
    """Free a half-prefilled request's KV and queue it first, to prefill from the start."""
    pool = scheduler.req_to_token_pool
    if req.req_pool_idx is not None:
        # A radix tree owns the prefix it matched and the chunks it cached (its lock is let go
        # below); without one (ChunkCache: prefix_cache=False) ``prefix_indices`` are the
        # chunks already done, which only the request holds.
        owned_by_tree = len(req.prefix_indices) if not getattr(scheduler.tree_cache, "disable", True) else 0
        own = pool.req_to_token[req.req_pool_idx, owned_by_tree : len(req.fill_ids)]
        scheduler.token_to_kv_pool_allocator.free(own)
        pool.free(req.req_pool_idx)
    if req.last_node is not None:
        scheduler.tree_cache.dec_lock_ref(req.last_node)
    req.reset_for_retract()
    scheduler.chunked_req = None
    scheduler.waiting_queue.insert(0, req)


def _stale_requests(scheduler) -> dict:
    """rid -> (prefix_indices at the swap, how many of them the prefix cache owns), with the
    prefix cache patched (once) to release those requests without caching their KV."""
    stale = scheduler.__dict__.get(_STALE)
    if stale is not None:
        return stale
    stale = {}
    setattr(scheduler, _STALE, stale)
    tree = scheduler.tree_cache
    cache_finished_req = tree.cache_finished_req

    def release_or_cache(req):
        entry = stale.pop(req.rid, None)
        # A request retracted since (memory pressure) was prefilled again: cached as usual.
        if entry is None or entry[0] is not req.prefix_indices:
            return cache_finished_req(req)
        pool = scheduler.req_to_token_pool
        kv = pool.read(req.req_pool_idx, len(req.origin_input_ids) + len(req.output_ids) - 1)
        scheduler.token_to_kv_pool_allocator.free(kv[entry[1] :])
        pool.free(req.req_pool_idx)
        tree.dec_lock_ref(req.last_node)

    tree.cache_finished_req = release_or_cache
    return stale


def swap_at_boundary(scheduler, swap, *, version: int, recompute: bool, queued: float) -> SwapRecord:
    """Run ``swap`` (the weights change) with requests in flight, then make the KV state agree."""
    start = time.perf_counter()
    swap()
    if recompute:
        running, tokens = recompute_running(scheduler)
    else:
        running, tokens = keep_running(scheduler), 0
    return SwapRecord(version, queued, start, time.perf_counter(), True, running, tokens)
