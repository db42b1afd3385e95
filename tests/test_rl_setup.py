"""The start-up both RL loops share (examples/rl_loop.py's ``set_up``)."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from examples.async_rl import split_devices
from examples.grpo import GRPO, PRESETS
from examples.rl_loop import mismatch_metrics, set_up


@pytest.mark.example_path
def test_the_async_loop_starts_the_moe_preset_as_the_sync_loop_does(tmp_path):
    """``--async-rollout`` starts through the synchronous loop's set-up, with the trainer on the
    first half of the 4 devices and the engine on the second: the output dir is claimed, the
    trainer's model is the checkpoint's family, and it computes the log-probs the engine sampled
    with (fp32: equal up to rounding). The tiny-moe preset (Qwen3-MoE) is the one an async
    loop with its own start-up once refused ("model_type 'qwen3_moe' is not supported"); the
    tiny and tiny-llama presets start by the same path (about 20 s each: not repeated here)."""
    preset = "tiny-moe"
    config = dataclasses.replace(
        PRESETS[preset],
        output_dir=str(tmp_path),
        async_rollout=True,
        tis_cap=2.0,
        prompts_per_step=2,
        group_size=2,
    )
    with set_up(config, GRPO, split_devices) as setup:
        devices = jax.local_devices()
        assert setup.trainer_devices == devices[:2]
        assert set(setup.worker.mesh.devices.flat) == set(devices[2:])
        params = setup.state.trees["params"]
        assert all(leaf.sharding.device_set == set(devices[:2]) for leaf in jax.tree_util.tree_leaves(params))
        assert json.loads((tmp_path / "run.json").read_text())["preset"] == preset
        assert setup.state.step == 0 and setup.task.reward_fn is not None
        setup.worker.sync_params(params)
        problems = setup.task.sample(config.prompts_per_step, 0)
        batch = setup.worker.generate(
            [p.prompt for p in problems],
            n=config.group_size,
            max_new_tokens=config.max_new_tokens,
            pad_prompts_to=config.max_prompt_tokens,
            return_logprobs=True,
            seed=0,
        )
        trainer = setup.algorithm.logprobs(params, *(batch.tokens, batch.attention_mask, batch.positions))
        assert mismatch_metrics(batch, trainer)["mismatch_max"] < 1e-4
        assert np.asarray(batch.completion_mask).any()
