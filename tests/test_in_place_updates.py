"""The engine serves the trainer's params after every donated update (rollout/in_place_updates.py).

An RL loop's train step donates the params it updates: the new values land at the old
addresses, in the very buffers the engine serves zero-copy. XLA's CPU backend in jaxlib 0.8 kept
computing with the old values there (packed weights reused by address), so these tests run
several sync -> generate -> donated update rounds and compare against the trainer's forward on
fresh copies of the params (never donated: new addresses), which no such cache can fool.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import completion_log_probs, flax_model_for
from models.tiny import tiny_llama3_spec, write_tiny_model
from rollout import RolloutWorker, check_consistency
from rollout.in_place_updates import WORKAROUND, XNNPACK_OFF, jaxlib_affected
from tests.helpers import child_env, tiny_worker_config
from trainer_bridge import flatten_params, load_hf_params, unflatten_params

REPO = Path(__file__).resolve().parents[1]
# 4 prompts x n=2 of 10-14 tokens: the prefill and the trainer's forward run 64+ rows, the dots
# XLA:CPU 0.8 packed the weights of.
PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(10 + i)] for i in range(4)]
ROUNDS = 3


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama3"), tiny_llama3_spec(seed=21))


def _buffer_addresses(tree) -> list[int]:
    return [leaf.addressable_shards[0].data.unsafe_buffer_pointer() for leaf in jax.tree_util.tree_leaves(tree)]


def _fresh_copy(tree):
    """The same values in new device buffers (allocated while the old ones live: new
    addresses). Not a device_put of ``np.asarray(x)``: on CPU that may share x's memory."""
    return jax.tree_util.tree_map(jnp.copy, tree)


def _perturbed(params, key):
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(
        tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    )


def _donated_update(params):
    """A train step's shape: every leaf rewritten, the old buffers donated, the new ones placed
    as the old (what lets XLA write them in place, as a trainer's sharded step does)."""
    return jax.jit(_perturbed, donate_argnums=0, out_shardings=jax.tree_util.tree_map(lambda x: x.sharding, params))


CASES = [("qwen2_dir", 1), ("qwen2_dir", 2), ("llama_dir", 1)]


@pytest.mark.parametrize("model_fixture, tp_size", CASES, ids=["qwen2-tp1", "qwen2-tp2", "llama3-tp1"])
def test_the_engine_serves_the_trainers_params_after_donated_updates(request, model_fixture, tp_size):
    model_dir = request.getfixturevalue(model_fixture)
    model = flax_model_for(json.loads((Path(model_dir) / "config.json").read_text()), "float32")
    forward = jax.jit(
        lambda params, tokens, mask, positions, completion: completion_log_probs(
            model.apply({"params": params}, tokens, mask, positions), tokens, completion
        )
    )

    def trainer_log_probs(params, batch):
        return np.asarray(forward(params, batch.tokens, batch.attention_mask, batch.positions, batch.completion_mask))

    with RolloutWorker(tiny_worker_config(model_dir, tp_size=tp_size, load_format="dummy")) as worker:
        # Placed where the engine wants them (every leaf it uses as it is is served zero-copy),
        # in device buffers of their own: a device_put of a numpy array may share the host
        # memory, which cannot be donated.
        shardings = flatten_params(worker.param_shardings())
        params = jax.tree_util.tree_map(
            jnp.copy,
            unflatten_params(
                {
                    path: jax.device_put(leaf, shardings[path])
                    for path, leaf in flatten_params(load_hf_params(model_dir)).items()
                }
            ),
        )
        update = _donated_update(params)
        for step in range(ROUNDS):
            report = worker.sync_params(params)
            assert report.leaves_aliased > 0
            fresh = _fresh_copy(params)
            consistency = check_consistency(worker, fresh, PROMPTS, n=2, max_new_tokens=6, seed=step, atol=1e-4)
            assert consistency.max_abs_diff < 1e-4, (step, consistency.worst[:2])
            batch = worker.generate(
                PROMPTS, n=2, max_new_tokens=6, ignore_eos=True, seed=10 + step, return_logprobs=True
            )
            expected = trainer_log_probs(fresh, batch)
            np.testing.assert_allclose(batch.logprobs, expected, atol=1e-4, err_msg=f"engine, round {step}")
            # The trainer's own compiled forward reads the donated buffers too.
            np.testing.assert_allclose(
                trainer_log_probs(params, batch), expected, atol=1e-5, err_msg=f"trainer, round {step}"
            )
            addresses = _buffer_addresses(params)
            with worker.released_for_training():
                params = update(params, jax.random.key(step))
            # The update really was in place: what the bug needs, and what RL loops do.
            assert len(set(addresses) & set(_buffer_addresses(params))) > len(addresses) // 2


_WITHOUT_THE_FLAG = """
import jax
import rollout
from rollout import PlatformError, RolloutWorker
from rollout.in_place_updates import reads_stale_weights
from tests.helpers import tiny_worker_config
stale = reads_stale_weights("cpu")
try:
    RolloutWorker(tiny_worker_config({model_dir!r}, load_format="dummy")).close()
    refused = None
except PlatformError as error:
    refused = str(error)
print("RESULT", stale, refused is not None)
print("MESSAGE", refused)
"""


@pytest.mark.parametrize("how", ["switched-off", "backend-first"])
def test_without_the_flag_the_worker_refuses_exactly_where_the_probe_reads_stale_weights(qwen2_dir, how):
    """Where the flag is missing (switched off, or JAX's CPU backend created before rollout was
    imported: too late for XLA_FLAGS) the worker refuses to start, naming the flag, exactly when
    the probe reads stale weights. Whether it does depends on the jaxlib and on the CPU (see
    cpu_reads_stale_weights_without_the_flag); where it reads fresh ones, that the engine does
    too is pinned by tests/test_engine_workarounds.py. A jaxlib outside AFFECTED_JAXLIB that
    reads stale weights fails here: widen AFFECTED_JAXLIB."""
    script = _WITHOUT_THE_FLAG.format(model_dir=str(qwen2_dir))
    if how == "backend-first":
        script = "import jax; jax.devices()\n" + script
    disabled = WORKAROUND if how == "switched-off" else ""
    env = child_env(disabled, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("RESULT", "MESSAGE")))
    stale, refused = (word == "True" for word in lines["RESULT"].split())
    assert refused == stale
    assert jaxlib_affected() or not stale
    if stale:
        assert XNNPACK_OFF in lines["MESSAGE"] and "rewritten in place" in lines["MESSAGE"]
