"""WorkerConfig checks (rollout/config.py) that need the machine or the model dir: clear errors
before any engine starts."""

import json
import threading

import jax
import pytest

from models.tiny_moe import TinyMoeSpec
from rollout import RolloutWorker, WorkerConfig
from rollout.config import check_routing_recordable, model_context_limit
from tests.helpers import tiny_worker_config
from trainer_bridge import LoraConfig


def engine_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("sglang")]


def test_tp_size_beyond_the_devices_is_refused_before_the_engine_starts(qwen2_dir):
    before = engine_threads()
    with pytest.raises(ValueError, match=r"tp_size \(8\) = 8 devices, but the worker is given 4"):
        RolloutWorker(tiny_worker_config(qwen2_dir, tp_size=8))
    assert engine_threads() == before
    # An explicit device list: the count checked is that of the given devices.
    with pytest.raises(ValueError, match=r"tp_size \(2\) = 2 devices, but the worker is given 1"):
        tiny_worker_config(qwen2_dir, tp_size=2, devices=jax.devices()[:1]).validate()
    tiny_worker_config(qwen2_dir, tp_size=2, dp_size=2).validate()


def test_context_beyond_the_model_is_refused_unless_allowed(qwen2_dir):
    assert model_context_limit(qwen2_dir) == 1024  # TinyModelSpec.max_position_embeddings
    before = engine_threads()
    with pytest.raises(
        ValueError,
        match=r"context_length=2048 exceeds the model's context length 1024 \(.*config\.json\); "
        r"pass allow_long_context=True",
    ):
        RolloutWorker(tiny_worker_config(qwen2_dir, context_length=2048))
    assert engine_threads() == before
    tiny_worker_config(qwen2_dir, context_length=1024).validate()
    tiny_worker_config(qwen2_dir, context_length=2048, allow_long_context=True).validate()


def test_context_limit_follows_rope_scaling_and_skips_hub_ids(tmp_path):
    config = {"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_context_limit(tmp_path) == 16384
    config["rope_scaling"]["original_max_position_embeddings"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_context_limit(tmp_path) == 4096
    assert model_context_limit("Qwen/Qwen2.5-3B-Instruct") is None
    WorkerConfig(model_path="Qwen/Qwen2.5-3B-Instruct", context_length=10**6, devices=jax.devices()[:1]).validate()


def test_device_counts_must_add_up(qwen2_dir):
    with pytest.raises(ValueError, match=r"dp_size \(3\) x tp_size \(1\) = 3 devices, but the worker is given 4"):
        RolloutWorker(tiny_worker_config(qwen2_dir, dp_size=3, devices=tuple(jax.devices())))


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        RolloutWorker(tiny_worker_config(tmp_path / "nowhere"))


def test_a_phase_log_in_a_missing_directory_is_refused_before_the_engine_starts(qwen2_dir, tmp_path):
    missing = tmp_path / "no-such-dir" / "phases.jsonl"
    with pytest.raises(ValueError, match=r"phase_log=.*no-such-dir.*does not exist"):
        tiny_worker_config(qwen2_dir, phase_log=str(missing)).validate()
    tiny_worker_config(qwen2_dir, phase_log=str(tmp_path / "phases.jsonl")).validate()


def test_load_hfs_forward_check_reads_settings_as_the_forward_does(qwen2_dir, tmp_path):
    """What the shapes do not show is compared as the forward reads it: an export that writes the
    implied head_dim, or rope_scaling's type under the other key, is the same forward."""
    from rollout.config import check_same_forward
    from trainer_bridge import CheckpointError

    base = json.loads((qwen2_dir / "config.json").read_text())

    def variant(name, without=(), **changes):
        directory = tmp_path / name
        directory.mkdir()
        config = {key: value for key, value in {**base, **changes}.items() if key not in without}
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    check_same_forward(str(qwen2_dir), qwen2_dir)
    assert base["head_dim"] == base["hidden_size"] // base["num_attention_heads"]
    check_same_forward(str(qwen2_dir), variant("implied-head-dim", without=("head_dim",)))
    linear = variant("type", rope_scaling={"type": "linear", "factor": 2.0})
    check_same_forward(str(linear), variant("rope-type", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(CheckpointError, match=r"eps.*config\.json sets the forward otherwise.*rms_norm_eps 0\.01"):
        check_same_forward(str(qwen2_dir), variant("eps", rms_norm_eps=0.01))
    with pytest.raises(CheckpointError, match=r"rope_scaling .*'factor': 4\.0"):
        check_same_forward(str(linear), variant("factor", rope_scaling={"type": "linear", "factor": 4.0}))
    # Named as the load names it (transformers' ValueError listed every model type).
    (tmp_path / "no-config").mkdir()
    with pytest.raises(CheckpointError, match=r"cannot read .*no-config/config\.json: no such file"):
        check_same_forward(str(qwen2_dir), tmp_path / "no-config")


def test_unmerged_lora_must_be_a_lora_config_whose_targets_the_model_has(qwen2_dir):
    with pytest.raises(ValueError, match="unmerged_lora must be a LoraConfig or None, got '16,32'"):
        tiny_worker_config(qwen2_dir, unmerged_lora="16,32")
    config = tiny_worker_config(qwen2_dir, unmerged_lora=LoraConfig(4, 8.0, ("q_proj", "lm_head")))
    with pytest.raises(ValueError, match=r"WorkerConfig.unmerged_lora.target_modules: \['lm_head'\] .*config.json"):
        RolloutWorker(config)


def test_several_adapter_slots_need_unmerged_adapters_and_no_prefix_cache(qwen2_dir):
    with pytest.raises(ValueError, match="max_loras > 1 holds several unmerged adapters: set unmerged_lora"):
        tiny_worker_config(qwen2_dir, max_loras=2, prefix_cache=False)
    with pytest.raises(ValueError, match="max_loras > 1 needs prefix_cache=False: the engine's prefix cache keys"):
        tiny_worker_config(qwen2_dir, max_loras=2, unmerged_lora=LoraConfig(4, 8.0))
    with pytest.raises(ValueError, match="max_loras > 1 needs chunked_prefill_size > 0"):
        tiny_worker_config(qwen2_dir, max_loras=2, unmerged_lora=LoraConfig(4, 8.0), chunked_prefill_size=-1)
    with pytest.raises(ValueError, match="max_loras must be a positive int"):
        tiny_worker_config(qwen2_dir, max_loras=0)


def test_routing_is_refused_for_an_moe_config_whose_every_layer_is_dense(tmp_path):
    """Such a worker once started, and every return_routing call failed in the engine ("recorded
    routing for 0 positions")."""
    spec = TinyMoeSpec(num_hidden_layers=2, mlp_only_layers=(0, 1))
    (tmp_path / "config.json").write_text(json.dumps(spec.hf_config()))
    with pytest.raises(ValueError, match=r"record_routing: no layer of .*config\.json routes tokens to experts"):
        check_routing_recordable(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(TinyMoeSpec(num_hidden_layers=2).hf_config()))
    check_routing_recordable(str(tmp_path))


@pytest.mark.parametrize("timeout", [0, -1.0, True, float("inf"), float("nan"), 1e18, "60"])
def test_pod_timeout_is_a_finite_positive_number_of_seconds_the_runtime_can_wait(qwen2_dir, timeout):
    """The coordination service waits in whole milliseconds: inf raised OverflowError at the
    first pod call, and 1e18 s named every process lost at once."""
    with pytest.raises(ValueError, match=r"WorkerConfig\.pod_timeout_s must be a number of seconds in \(0, 604800\]"):
        tiny_worker_config(qwen2_dir, pod_timeout_s=timeout)


@pytest.mark.parametrize(
    "field, value",
    [("prefix_cache", "no"), ("precompile", 1), ("static_decode_chunks", "false"), ("allow_long_context", None)],
)
def test_switches_are_bools(qwen2_dir, field, value):
    """A string such as "no" was taken as true."""
    with pytest.raises(ValueError, match=rf"WorkerConfig\.{field} must be a bool, got {value!r}"):
        tiny_worker_config(qwen2_dir, **{field: value})
