"""The engine's request loop: an asyncio loop in a thread of its own that talks to the
tokenizer manager, so callers on any thread or event loop generate at once and the scheduler
batches their requests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np

from models import engine_sampling_params

from ..errors import InvalidRequest
from ..sampling import SamplingParams
from .patches import LOGPROB_SINKS
from .routing import RoutingSink
from .runtime import SchedulerControl
from .sessions import SessionPins
from .types import EngineError, GenerateOutput, TokenLogprobSink
from .workarounds import workaround_enabled

logger = logging.getLogger(__name__)

# How often a call waiting for its answer checks that the engine is still alive.
LIVENESS_CHECK_S = 0.05
# How long a stream whose rows all ended waits for the engine's side of it to end (at once,
# unless the engine failed meanwhile) before cancelling it.
ROWS_ENDED_WAIT_S = 5.0


def request_event_loop() -> asyncio.AbstractEventLoop:
    """The event loop of an engine's requests. 0.0.2's streamed calls wait for each row in a
    task of its own, which they leave behind when their consumer stops (a server's stream whose
    choices all reached a stop string); a row that had ended then ends its task with
    StopAsyncIteration, which asyncio logs at ERROR as "Task exception was never retrieved".
    That one is not logged (workaround ``abandoned-row-tasks``); every other is."""
    loop = asyncio.new_event_loop()
    if workaround_enabled("abandoned-row-tasks"):

        def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
            if not isinstance(context.get("exception"), StopAsyncIteration):
                loop.default_exception_handler(context)

        loop.set_exception_handler(handle)
    return loop


class RequestLoop:
    """Generation for one engine (a part of :class:`EngineHandle`). ``check_alive`` raises the
    engine's error once it failed or was closed; ``kv_pool_tokens`` is its KV pool's size."""

    def __init__(
        self,
        engine,
        scheduler,
        control: SchedulerControl,
        check_alive: Callable[[], None],
        kv_pool_tokens: int,
        sessions: SessionPins,
    ):
        self._control = control
        self._sessions = sessions
        self._check_alive = check_alive
        self._kv_pool_tokens = kv_pool_tokens
        self._prefix_cache = not scheduler.server_args.disable_radix_cache
        self._tokenizer_manager = engine.tokenizer_manager
        # Every use of the tokenizer manager (its zmq sockets, its per-request asyncio events)
        # happens on this loop. (It would also install SIGTERM/SIGQUIT handlers on first use of
        # a loop of its own.)
        self._loop = request_event_loop()
        self._tokenizer_manager.no_create_loop = True
        self._tokenizer_manager.event_loop = self._loop
        self._result_task = self._loop.create_task(self._tokenizer_manager.handle_loop())
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="sglang-jax::requests", daemon=True)
        self._loop_thread.start()
        # Futures of the calls running on the loop: close() lets each fail with the engine's
        # error before the loop stops.
        self._in_flight: set[concurrent.futures.Future] = set()
        # rid -> the log-probs of a request that asked for them (filled on the scheduler thread).
        self._logprob_sinks: dict[str, TokenLogprobSink] = {}
        setattr(scheduler, LOGPROB_SINKS, self._logprob_sinks)

    # ---- generation ------------------------------------------------------------------------

    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: np.ndarray
    ) -> concurrent.futures.Future:
        """A future of the outputs of :meth:`EngineHandle.generate`."""
        return self._submit(self._generate(prompts, params, seeds))

    async def astream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: np.ndarray
    ) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """:meth:`EngineHandle.astream`."""
        caller = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        request, rids = self._request(prompts, params, seeds, stream=True)

        def deliver(update) -> bool:
            """Hand ``update`` to the caller's loop; False once that loop is closed (a caller
            that left the stream and ended its loop before the cancellation reached the pump)."""
            try:
                caller.call_soon_threadsafe(updates.put_nowait, update)
            except RuntimeError:
                return False
            return True

        async def pump():
            shared = await self._cache_prompts(prompts, params)
            with (
                self._logprobs_collected(rids, params.return_logprobs) as sinks,
                self._versions_collected(rids) as (versions, prefilled),
                self._engine_aborts_dropped(rids),
                self._session_pinned(rids, params.session),
                self._lora_slotted(rids, params.lora),
                self._aborted_if_cancelled(rids),
                self._sent_whole(rids, params),
            ):
                async for result in self._tokenizer_manager.generate_request(request, None):
                    self._raise_if_engine_aborted(result)
                    row = int(result.get("index", 0))
                    output = _to_output(result, finished_only=False)
                    count = len(output.output_ids)
                    output = dataclasses.replace(output, token_versions=versions[row][:count])
                    output = _with_prefills(output, prefilled[row])
                    if shared is not None:
                        output = shared.charged(row, output)
                    if sinks is not None:
                        output = dataclasses.replace(output, **sinks[row].first(count))
                    if not deliver((row, output)):
                        raise asyncio.CancelledError  # nobody listens: abort the rows (above)

        future = self._submit(pump())
        future.add_done_callback(lambda _: deliver(None))
        finished = set()
        try:
            while (update := await updates.get()) is not None:
                if update[1].finish_reason:
                    finished.add(update[0])
                yield update
            future.result()
        finally:
            if len(finished) == len(prompts) * params.n and not future.done():
                # Every row ended: the pump is only taking 0.0.2's last wait of each row, whose
                # tasks, left by a cancel, ended unretrieved ("ERROR asyncio: Task exception was
                # never retrieved ... StopAsyncIteration" after a server's ordinary streams).
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.wrap_future(future), ROWS_ENDED_WAIT_S)
            future.cancel()

    def _request(self, prompts, params: SamplingParams, seeds, *, stream: bool = False):
        """The engine request for a call, and its request ids (prompt-major rows)."""
        from sgl_jax.srt.managers.io_struct import GenerateReqInput

        seeds = np.asarray(seeds).reshape(len(prompts), params.n)
        if workaround_enabled("one-request-per-sample"):
            # 0.0.2 ignores n for a single prompt and is slow with batched n: one request per sample.
            input_ids = [list(map(int, ids)) for ids in prompts for _ in range(params.n)]
            sampling = [_sampling_dict(params, int(seed)) for seed in seeds.reshape(-1)]
        else:  # the engine's own n (one seed per prompt)
            input_ids = [list(map(int, ids)) for ids in prompts]
            sampling = [dict(_sampling_dict(params, int(row[0])), n=params.n) for row in seeds]
        rids = [uuid.uuid4().hex for _ in input_ids]
        return GenerateReqInput(input_ids=input_ids, sampling_params=sampling, rid=rids, stream=stream), rids

    @contextlib.contextmanager
    def _sent_whole(self, rids: list[str], params: SamplingParams):
        """The scheduler admits the call's requests together (``BatchArrivals``). Not with the
        engine's own n, whose requests get ids the engine makes up."""
        own_ids = params.n == 1 or workaround_enabled("one-request-per-sample")
        call = self._control.arrivals.expect(rids if own_ids else [])
        try:
            yield
        finally:
            self._control.arrivals.withdraw(call)

    @contextlib.contextmanager
    def _logprobs_collected(self, rids: list[str], wanted: bool):
        """Per row, the list the patched sampler appends each sampled token's log-prob to
        (None when not wanted)."""
        if not wanted:
            yield None
            return
        with _registered(self._logprob_sinks, rids, TokenLogprobSink) as sinks:
            yield sinks

    @contextlib.contextmanager
    def _routing_collected(self, rids: list[str], wanted: bool):
        """Per row, the sink the scheduler copies the request's MoE routing into (None when
        not wanted)."""
        if not wanted:
            yield None
            return
        recorder = self._control.routing
        if recorder is None:
            raise EngineError("routing was asked for but this engine does not record it (EngineOptions.record_routing)")
        with _registered(recorder.sinks, rids, RoutingSink) as sinks:
            yield sinks

    @contextlib.contextmanager
    def _session_pinned(self, rids: list[str], session: str | None):
        """A session's request pins its prefix in the cache as it finishes (``sessions``)."""
        if session is None:
            yield
            return
        for rid in rids:
            self._sessions.expect(rid, session)
        try:
            yield
        finally:
            for rid in rids:
                self._sessions.withdraw(rid)

    @contextlib.contextmanager
    def _lora_slotted(self, rids: list[str], name: str | None):
        """The requests of a call for a named adapter run on its slot (the others on slot 0)."""
        if name is None:
            yield
            return
        control = self._control
        # Looked up and registered at once: a name unloaded in between would leave its slot
        # looking free to a sync of other adapters, which this call would then run on.
        with control.lora_lock:
            slot = control.lora_names.get(name)
            if slot is None:  # unloaded since the call was validated
                loaded = sorted(control.lora_names)
                raise InvalidRequest("lora", f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
            control.lora_slots.update(dict.fromkeys(rids, slot))
        try:
            yield
        finally:
            with control.lora_lock:
                for rid in rids:
                    control.lora_slots.pop(rid, None)

    @contextlib.contextmanager
    def _aborted_if_cancelled(self, rids: list[str]):
        """A call cancelled by its caller (a client gone, a timeout) aborts its requests in the
        scheduler: they leave the running batch after at most one more forward and free their
        KV, instead of generating to the end for nobody (the tokenizer manager does not abort
        on cancellation)."""
        try:
            yield
        except asyncio.CancelledError:
            for rid in rids:
                self._tokenizer_manager.abort_request(rid)
            raise

    @contextlib.contextmanager
    def _versions_collected(self, rids: list[str]):
        """Per row, the list the scheduler appends each sampled token's weight version to, and
        [tokens its prefill chunks computed, prompt tokens its first prefill found cached]."""
        with (
            _registered(self._control.version_sinks, rids, list) as sinks,
            _registered(self._control.prefill_sinks, rids, lambda: [0, None]) as prefilled,
        ):
            yield sinks, prefilled

    async def _cache_prompts(self, prompts, params: SamplingParams) -> SharedPrefills | None:
        """Prefill every prompt once, before its ``n`` samples are sent, so they find it in the
        prefix cache and each prefills only its last token (its last page, with a page size
        above 1). Sent together, all ``n`` would be scheduled before any is cached and each
        would prefill the whole prompt (n x the prompt's forward FLOPs). The prompt-only
        requests generate nothing (``max_new_tokens`` 0); a weight sync in between flushes
        the cache and the samples prefill in full under the new weights, as any request would.
        Skipped where it cannot pay: one sample per prompt, no prefix cache, and batches whose
        distinct prompts take more than half the KV pool (the cache would evict the first before
        their samples run, and every prompt would be prefilled n + 1 times). What they prefilled
        is charged to the call's rows (:class:`SharedPrefills`); None where none was sent."""
        if params.n == 1 or not workaround_enabled("one-request-per-sample") or not self._prefix_cache:
            return None
        # A one-token prompt has nothing to share: a request always prefills its last token.
        keys = [tuple(map(int, ids)) for ids in prompts]
        distinct = [ids for ids in dict.fromkeys(keys) if len(ids) > 1]
        if not distinct or sum(map(len, distinct)) > self._kv_pool_tokens // 2:
            return None
        request, rids = self._request(
            distinct, dataclasses.replace(params, n=1), np.zeros((len(distinct), 1), np.int64)
        )
        for sampling in request.sampling_params:
            sampling["max_new_tokens"] = 0  # below what SamplingParams accepts from a caller
        with (
            self._versions_collected(rids) as (_, prefilled),
            self._engine_aborts_dropped(rids),
            self._aborted_if_cancelled(rids),
            self._sent_whole(rids, params),
        ):
            results = await self._answers(request)
        outputs = [_with_prefills(_to_output(r), sink) for r, sink in zip(results, prefilled)]
        return SharedPrefills.of(keys, params.n, dict(zip(distinct, outputs)))

    async def _answers(self, request) -> list[dict]:
        """The engine's answer to every request of ``request``, once all have finished."""
        results = await self._tokenizer_manager.generate_request(request, None).__anext__()
        results = [results] if isinstance(results, dict) else results
        for result in results:
            self._raise_if_engine_aborted(result)
        return results

    def _raise_if_engine_aborted(self, result: dict) -> None:
        """The error of a request the engine aborted itself (``freed.abort_everything``), if
        ``result`` is its answer: a copy, each call's own traceback."""
        error = self._control.aborted.get(result.get("meta_info", {}).get("id"))
        if error is not None:
            raise type(error)(error.reason, str(error))

    @contextlib.contextmanager
    def _engine_aborts_dropped(self, rids: list[str]):
        """The engine's aborts of the call's requests forgotten however the call ends (one raised
        at the first row's answer leaves the others')."""
        try:
            yield
        finally:
            for rid in rids:
                self._control.aborted.pop(rid, None)

    async def _generate(self, prompts, params: SamplingParams, seeds) -> list[GenerateOutput]:
        shared = await self._cache_prompts(prompts, params)
        request, rids = self._request(prompts, params, seeds)
        with (
            self._logprobs_collected(rids, params.return_logprobs) as sinks,
            self._versions_collected(rids) as (versions, prefilled),
            self._engine_aborts_dropped(rids),
            self._routing_collected(rids, params.return_routing) as routing,
            self._session_pinned(rids, params.session),
            self._lora_slotted(rids, params.lora),
            self._aborted_if_cancelled(rids),
            self._sent_whole(rids, params),
        ):
            results = await self._answers(request)
        outputs = [_to_output(r) for r in results]
        if len(outputs) != len(rids):  # the engine's own n: its rows are not our request ids
            versions = [None] * len(outputs)
        else:
            outputs = [_with_prefills(out, sink) for out, sink in zip(outputs, prefilled)]
            if shared is not None:
                outputs = [shared.charged(row, out) for row, out in enumerate(outputs)]
        for i, (out, tokens) in enumerate(zip(outputs, versions)):
            if tokens is not None and len(tokens) != out.completion_tokens:
                raise EngineError(
                    f"request {i}: recorded {len(tokens)} weight versions for {out.completion_tokens} completion tokens"
                )
        outputs = [dataclasses.replace(out, token_versions=tokens) for out, tokens in zip(outputs, versions)]
        if routing is not None:
            outputs = [
                dataclasses.replace(out, routed_experts=_routed_positions(i, sink, len(ids), out))
                for i, (out, sink, ids) in enumerate(zip(outputs, routing, request.input_ids))
            ]
        if sinks is None:
            return outputs
        for i, (out, sink) in enumerate(zip(outputs, sinks)):
            if len(sink) != out.completion_tokens:
                raise EngineError(
                    f"request {i}: collected {len(sink)} log-probs for {out.completion_tokens} completion tokens"
                )
        return [dataclasses.replace(out, **sink.first(len(sink))) for out, sink in zip(outputs, sinks)]

    def _submit(self, coroutine) -> concurrent.futures.Future:
        """Run ``coroutine`` on the request loop; it fails with EngineError as soon as
        the engine does."""
        try:
            self._check_alive()
        except EngineError:
            coroutine.close()
            raise
        future = asyncio.run_coroutine_threadsafe(self._guarded(coroutine), self._loop)
        self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)
        return future

    async def _guarded(self, coroutine):
        task = asyncio.ensure_future(coroutine)
        try:
            while True:
                # FIRST_COMPLETED: by default asyncio.wait waits for all, and the result task runs
                # for the engine's life, so every answer waited out the timeout (up to 50 ms).
                done, _ = await asyncio.wait(
                    {task, self._result_task}, timeout=LIVENESS_CHECK_S, return_when=asyncio.FIRST_COMPLETED
                )
                if task in done:
                    return task.result()
                if self._result_task in done:
                    exc = None if self._result_task.cancelled() else self._result_task.exception()
                    self._control.fail(exc or EngineError("engine result loop ended"))
                if self._control.error is not None or self._control.stopped.is_set():
                    raise self._control.dead_error()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def close(self) -> None:
        """Stop the loop (after the scheduler). The tokenizer manager's sockets are the
        handle's to close."""
        # The scheduler has stopped: every running call sees it within a poll and fails with
        # the engine's error (a caller waits for that, not for the loop's end).
        concurrent.futures.wait(list(self._in_flight), timeout=10)

        async def stop_results():
            self._result_task.cancel()
            with contextlib.suppress(BaseException):
                await self._result_task
            # What else is left (0.0.2's waits on each row of a stream the close cut off) ends
            # here: a task destroyed pending with the loop is logged as an error.
            left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop_results(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)
        if not self._loop_thread.is_alive():
            self._loop.close()
        self._tokenizer_manager = None


@contextlib.contextmanager
def _registered(registry: dict, rids: list[str], make: Callable):
    """A new sink per request, in ``registry`` under its request id while the call runs (the
    scheduler thread fills the sinks of the requests it finds there)."""
    sinks = [make() for _ in rids]
    registry.update(zip(rids, sinks))
    try:
        yield sinks
    finally:
        for rid in rids:
            registry.pop(rid, None)


def _sampling_dict(params: SamplingParams, seed: int) -> dict:
    """sglang-jax's per-request sampling dict."""
    # As the trainer recomputes log-probs (models.completion_log_probs).
    temperature, top_k = engine_sampling_params(params.temperature, params.top_k)
    sampling = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": temperature,
        "top_p": params.top_p,
        "top_k": top_k,
        "min_p": params.min_p,
        "ignore_eos": params.ignore_eos,
        "sampling_seed": seed,
        # Keep the stop token in the output: a trainer must learn to emit it.
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    return sampling


def _routed_positions(row: int, sink: RoutingSink, prompt_tokens: int, output: GenerateOutput) -> np.ndarray | None:
    """The routing of every position the engine took as input: the prompt and every completion
    token but the last. None for a request the engine aborted (it may stop between recording
    and sampling); the other rows keep theirs."""
    if output.finish_reason == "abort":
        return None
    expected = prompt_tokens + output.completion_tokens - 1
    if sink.prefilled is None or len(sink) != expected:
        raise EngineError(f"request {row}: recorded routing for {len(sink)} positions, expected {expected}")
    return sink.rows()


def _with_prefills(output: GenerateOutput, prefilled: list) -> GenerateOutput:
    """``output`` with what the scheduler recorded of its row's prefills: the tokens they
    computed, and the cached prompt tokens of the first (0.0.2's own count adds a retracted
    row's again when it is prefilled again: more than the prompt has)."""
    output = dataclasses.replace(output, prefill_tokens=prefilled[0])
    if prefilled[1] is not None and workaround_enabled("retracted-cached-tokens"):
        output = dataclasses.replace(output, cached_tokens=prefilled[1])
    return output


@dataclasses.dataclass(frozen=True)
class SharedPrefills:
    """What a call's prompt-only requests (:meth:`RequestLoop._cache_prompts`) prefilled, charged
    to the call's rows (prompt-major, ``n`` a prompt): each sample of a prompt reports the prompt
    tokens the cache held before the call (its own count takes in what the prompt-only request
    had just put there: all but the last token), and the first row of each prompt also counts
    the tokens that request computed, so the rows' ``prefill_tokens`` add up to the call's."""

    n: int
    prompts: tuple[tuple[int, ...], ...]
    first_rows: dict[tuple[int, ...], int]
    prefills: dict[tuple[int, ...], GenerateOutput]

    @classmethod
    def of(cls, prompts: list[tuple[int, ...]], n: int, prefills: dict[tuple[int, ...], GenerateOutput]):
        first_rows: dict[tuple[int, ...], int] = {}
        for index, prompt in enumerate(prompts):
            first_rows.setdefault(prompt, index * n)
        return cls(n, tuple(prompts), first_rows, prefills)

    def charged(self, row: int, output: GenerateOutput) -> GenerateOutput:
        prompt = self.prompts[row // self.n]
        shared = self.prefills.get(prompt)
        if shared is None:  # a one-token prompt: nothing was sent for it
            return output
        return dataclasses.replace(
            output,
            # Less where the cache lost the prompt in between (a weight sync flushes it).
            cached_tokens=min(output.cached_tokens, shared.cached_tokens),
            prefill_tokens=output.prefill_tokens + (shared.prefill_tokens if row == self.first_rows[prompt] else 0),
        )


def _to_output(result: dict, finished_only: bool = True) -> GenerateOutput:
    meta = result.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    output_ids = list(result.get("output_ids", []))
    completion_tokens = int(meta.get("completion_tokens", len(output_ids)))
    if len(output_ids) != completion_tokens and (finished_only or finish):
        logger.warning(
            "engine returned %d output ids but counted %d completion tokens", len(output_ids), completion_tokens
        )
    return GenerateOutput(
        output_ids=output_ids[:completion_tokens],
        finish_reason=str(finish.get("type", "")) if finish else ("unknown" if finished_only else ""),
        completion_tokens=completion_tokens,
        cache_miss_count=int(meta.get("cache_miss_count", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
    )
