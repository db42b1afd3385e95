"""Weights freed under a running call: the trainer donated arrays the engine serves (a train
step called outside ``released_for_training``) while requests ran. The next dispatch of a
forward, or of a decode chunk ahead, finds them deleted and raises before anything runs (no KV
buffer is consumed, jax 0.8 to 0.12). Instead of the engine failing for good (a new worker
being the only way out), every request it holds is aborted, each call failing with
:class:`WorkerUnavailable` saying why, and the engine serves on: the next ``sync_params`` makes
it usable again (scheduler thread only).
"""

from __future__ import annotations

import logging

from ..errors import WorkerUnavailable
from . import inflight
from .programs import forward_cells

logger = logging.getLogger(__name__)


def aborted_for_freed_weights(scheduler, control, exc: Exception) -> bool:
    """Whether ``exc``, raised out of the scheduler loop, was a dispatch meeting freed weight
    leaves (some of the forward's leaves are deleted: the engine's dispatch raised a ValueError
    at jax 0.8, a RuntimeError at jax 0.12): then every request was aborted and the loop may go
    on. False (the engine fails) for any other error, and where no request was there to abort
    (an error no abort can end)."""
    error = freed_weights_error(scheduler)
    if error is None:
        return False
    if any(buffer.is_deleted() for buffer in scheduler.tp_worker.worker.model_runner.token_to_kv_pool.kv_buffer):
        return False  # the failed dispatch consumed the KV pool (not seen at jax 0.8-0.12): nothing to serve on
    aborted = abort_everything(scheduler, control, error)
    logger.error("%s: %s (%d requests aborted)", control.name, error, aborted, exc_info=exc)
    return aborted > 0


def freed_weights_error(scheduler) -> WorkerUnavailable | None:
    """The error of the calls running when the engine found weight leaves freed (deleted since
    they were put in place), or None if none is."""
    leaves = forward_cells(scheduler.tp_worker.worker.model_runner)["model_state_leaves"].cell_contents
    freed = [leaf for leaf in leaves if getattr(leaf, "is_deleted", lambda: False)()]
    if not freed:
        return None
    return WorkerUnavailable(
        "the weights were freed during the call",
        f"the weights this call generated with were freed while it ran ({len(freed)} leaves, the first of shape "
        f"{tuple(freed[0].shape)}): a train step donated the arrays the engine served, outside "
        "worker.released_for_training(); the call's rows were aborted. Call worker.sync_params(params), then "
        "generate again.",
    )


def abort_everything(scheduler, control, error: WorkerUnavailable) -> int:
    """Finish every request ``scheduler`` holds as aborted, their calls failing with ``error``
    (``control.aborted``, read with each answer), and forget all KV state. The answers go out
    as any request's last output does (``stream_output``): on the outputs' own socket, after
    what was sent before them, and the tokenizer manager forgets the requests. Returns how many
    were aborted."""
    from sgl_jax.srt.managers.schedule_batch import FINISH_ABORT, ScheduleBatch

    reqs = list(scheduler.waiting_queue) + list(scheduler.running_batch.reqs)
    for batch in (scheduler.cur_batch, scheduler.last_batch):
        if batch is not None:
            reqs += batch.reqs
    if scheduler.chunked_req is not None:
        reqs.append(scheduler.chunked_req)
    reqs = list({id(req): req for req in reqs if not req.finished()}.values())
    if control.decode_chunks is not None:
        control.decode_chunks.release()
    scheduler.waiting_queue.clear()
    scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    scheduler.cur_batch = scheduler.chunked_req = None
    inflight.reset_kv_state(scheduler)
    # Answered last: a caller told of the abort finds the engine holding nothing.
    for req in reqs:
        # Only a call still waiting reads (and drops) its entry: one that already left has none.
        if req.rid in control.version_sinks:
            control.aborted[req.rid] = error
        req.finished_reason = FINISH_ABORT(error.reason)
    scheduler.stream_output(reqs, False)
    return len(reqs)
