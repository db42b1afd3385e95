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


def abort_everything(scheduler, control, error: WorkerUnavailable, cause: BaseException) -> int:
    """Abort every request ``scheduler`` holds, their calls failing with ``error`` (through
    ``control.aborted``), and forget all KV state, after the scheduler loop raised ``cause``
    anywhere (a forward, a decode chunk dispatched ahead). Returns how many were aborted."""
    from sgl_jax.srt.managers.io_struct import AbortReq
    from sgl_jax.srt.managers.schedule_batch import ScheduleBatch

    reqs = list(scheduler.waiting_queue) + list(scheduler.running_batch.reqs)
    for batch in (scheduler.cur_batch, scheduler.last_batch):
        if batch is not None:
            reqs += batch.reqs
    if scheduler.chunked_req is not None:
        reqs.append(scheduler.chunked_req)
    rids = list(dict.fromkeys(req.rid for req in reqs if not req.finished()))
    if control.decode_chunks is not None:
        control.decode_chunks.release()
    scheduler.waiting_queue.clear()
    scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    scheduler.cur_batch = scheduler.chunked_req = None
    inflight.reset_kv_state(scheduler)
    for rid in rids:  # recorded before the answer goes out: the request loop reads it with the answer
        control.aborted[rid] = error
        scheduler.send_to_tokenizer.send_pyobj(AbortReq(rid))
    logger.error("%s: %s (%d requests aborted; the engine failed with %r)", control.name, error, len(rids), cause)
    return len(rids)
