"""The engine starts with the attention backend chosen for its platform (the choice itself, the
supported versions and the packaging that declares them: tests/unit/)."""

from rollout import RolloutWorker
from tests.helpers import tiny_worker_config


def test_engine_starts_with_the_chosen_attention_backend(qwen2_dir):
    # sglang-jax's own default is "fa", the TPU kernel, whatever the platform.
    with RolloutWorker(tiny_worker_config(qwen2_dir)) as worker:
        assert worker.engine.attention_backend == "native"
    with RolloutWorker(tiny_worker_config(qwen2_dir, attention_backend="fa")) as worker:
        assert worker.engine.attention_backend == "fa"
