"""rollout/engine/scheduling.py without an engine: 0.0.2's admission of a retracted request."""

import types

from rollout.engine import patches

POOL = 128


class Pool:
    """The KV pool and prefix cache as PrefillAdder reads them: free and evictable slots."""

    disable = False  # a prefix cache is on: the admission path every request takes

    def __init__(self, available: int, evictable: int):
        self.available, self.evictable = available, evictable

    def available_size(self):
        return self.available

    def evictable_size(self):
        return self.evictable

    def inc_lock_ref(self, node):
        pass

    def dec_lock_ref(self, node):
        pass


def request(prompt: int, sampled: int, max_new_tokens: int):
    """A request waiting for a prefill of its prompt and the tokens it sampled (none cached)."""
    return types.SimpleNamespace(
        sampling_params=types.SimpleNamespace(max_new_tokens=max_new_tokens, ignore_eos=True),
        output_ids=[7] * sampled,
        origin_input_ids=[5] * prompt,
        extend_input_len=prompt + sampled,
        fill_ids=[5] * (prompt + sampled),
        host_hit_length=0,
        prefix_indices=[],
        last_node=None,
    )


def admitted(req) -> bool:
    patches.install_workarounds()
    from sgl_jax.srt.managers.schedule_policy import PrefillAdder

    pool = Pool(available=25, evictable=POOL - 25)  # the state of the hang: nothing running
    adder = PrefillAdder(1, pool, pool, None, 0.7, rem_input_tokens=16384, rem_chunk_tokens=None)
    adder.add_one_req(req)
    return req in adder.can_run_list


def test_a_retracted_request_is_admitted_for_the_tokens_it_has_left():
    """Retracted after sampling 59 of its 60 tokens from an 11-token prompt, in a pool of 128:
    70 tokens to prefill and 1 to go fit (0.0.2 counted 70 + 60 and it waited forever), and its
    max_new_tokens is its own again afterwards. A new request that needs 130 still waits."""
    retracted = request(prompt=11, sampled=59, max_new_tokens=60)
    assert admitted(retracted)
    assert retracted.sampling_params.max_new_tokens == 60
    assert not admitted(request(prompt=70, sampled=0, max_new_tokens=60))
