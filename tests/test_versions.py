"""The engine starts with the attention backend chosen for its platform (the choice itself, the
supported versions and the packaging that declares them: tests/unit/)."""

from rollout import RolloutWorker
from tests.helpers import tiny_worker_config


def test_engine_starts_with_the_attention_backend_it_runs(qwen2_dir, caplog):
    # sglang-jax's own default is "fa", the TPU kernel, whatever the platform.
    with RolloutWorker(tiny_worker_config(qwen2_dir)) as worker:
        assert worker.engine.attention_backend == "native"
    # On a CPU 0.0.2 runs "native" for "fa" (outside tpu_interpret_mode): the engine says which runs.
    with caplog.at_level("WARNING", logger="rollout.engine.handle"):
        with RolloutWorker(tiny_worker_config(qwen2_dir, attention_backend="fa")) as worker:
            assert worker.engine.attention_backend == "native"
    assert "attention_backend 'fa' (the TPU kernel) runs 'native' on a CPU" in caplog.text
