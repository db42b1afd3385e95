"""How 0.0.2's scheduler admits and ends requests: four fixes.

- ``retracted-admission``: a request retracted for memory (its KV freed, its sampled tokens
  kept) is admitted again only if its input, the sampled tokens included, plus its whole
  ``max_new_tokens`` fits the pool, while it has only ``max_new_tokens`` less what it sampled
  left: one retracted late in a tight pool waited forever (``generate`` never returned). Its
  admission counts the tokens it has left.
- ``stop-ids-with-ignore-eos``: ``Req.check_finished`` tests the stop token ids only without
  ``ignore_eos``, so a call with both ran to ``max_new_tokens``. The worker adds the model's
  EOS ids to the stop ids itself unless ``ignore_eos``, so the stop ids are tested in both.
- ``stop-token-at-length``: ``Req.check_finished`` tests the length before the stop ids, so a
  completion whose last allowed token is a stop token (its EOS) ended as ``"length"``: a
  trainer that penalizes truncation penalized a completion that ended. It ends as ``"stop"``.
- ``aborted-queued-state``: a request aborted while it waits in the queue is answered by an
  ``AbortReq`` whose handler marks its state finished but never deletes it, as an ended
  request's is: every call cancelled before its rows were admitted (a client gone at once)
  left them in ``TokenizerManager.rid_to_state`` for the engine's life. It is deleted there.
"""

from __future__ import annotations

import functools

from .workarounds import workaround_enabled


def patch_scheduling() -> None:
    from sgl_jax.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN, Req
    from sgl_jax.srt.managers.schedule_policy import PrefillAdder
    from sgl_jax.srt.managers.tokenizer_manager import TokenizerManager

    if workaround_enabled("aborted-queued-state"):
        TokenizerManager._handle_abort_req = _forgetting_the_state(TokenizerManager._handle_abort_req)

    if workaround_enabled("retracted-admission"):
        PrefillAdder.add_one_req = _counting_tokens_left(PrefillAdder.add_one_req)
    under_ignore_eos = workaround_enabled("stop-ids-with-ignore-eos")
    at_length = workaround_enabled("stop-token-at-length")
    if under_ignore_eos or at_length:
        Req.check_finished = _ending_on_stop_ids(
            Req.check_finished,
            FINISH_MATCHED_TOKEN,
            FINISH_LENGTH if at_length else None,
            under_ignore_eos=under_ignore_eos,
        )


def _forgetting_the_state(handle_abort_req):
    @functools.wraps(handle_abort_req)
    def handle_abort_req_forgetting_the_state(self, recv_obj):
        if recv_obj.rid not in self.rid_to_state:  # forgotten already: nothing waits for it
            return
        handle_abort_req(self, recv_obj)  # a waiter holds the state itself: it still reads the answer
        del self.rid_to_state[recv_obj.rid]

    return handle_abort_req_forgetting_the_state


def _counting_tokens_left(add_one_req):
    @functools.wraps(add_one_req)
    def add_one_req_counting_tokens_left(self, req):
        params, sampled = req.sampling_params, len(req.output_ids)
        # 0.0.2's path for ignore_eos without a prefix cache counts what a request sampled.
        if not sampled or (params.ignore_eos and getattr(self.tree_cache, "disable", True)):
            return add_one_req(self, req)
        asked = params.max_new_tokens
        params.max_new_tokens = max(asked - sampled, 0)  # read for this request's budget only
        try:
            return add_one_req(self, req)
        finally:
            params.max_new_tokens = asked

    return add_one_req_counting_tokens_left


def _ending_on_stop_ids(check_finished, finish_matched_token, finish_length=None, *, under_ignore_eos: bool):
    """``check_finished`` ending on a stop id under ``ignore_eos`` too (``under_ignore_eos``),
    and on one sampled as the last allowed token (given ``finish_length``, the reason that
    0.0.2 gives it otherwise)."""

    @functools.wraps(check_finished)
    def check_finished_on_stop_ids(self):
        check_finished(self)
        params = self.sampling_params
        if not params.stop_token_ids or not self.output_ids:
            return
        if self.finished():
            if finish_length is None or not isinstance(self.finished_reason, finish_length):
                return
        elif not (under_ignore_eos and params.ignore_eos):
            return
        last = int(self.output_ids[-1])
        if last in params.stop_token_ids:
            self.finished_reason = finish_matched_token(matched=last)

    return check_finished_on_stop_ids
