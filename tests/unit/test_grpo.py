"""examples/grpo.py: GRPOConfig's checks, presets and command line."""

import dataclasses

import pytest

from examples.grpo import PRESETS, GRPOConfig, parse_args
from trainer_bridge import LoraConfig


def test_config_validation_and_presets():
    with pytest.raises(ValueError, match="preset must be one of"):
        GRPOConfig(preset="gpt5")
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="kv_tokens=100 cannot hold one step"):
        GRPOConfig(kv_tokens=100)
    with pytest.raises(ValueError, match="max_operand must be a digit"):
        GRPOConfig(max_operand=10)
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        GRPOConfig(lora_rank=-1)
    with pytest.raises(ValueError, match="lora_rank with routing_replay is not supported"):
        GRPOConfig(preset="tiny-moe", lora_rank=4, routing_replay=True)
    assert GRPOConfig().lora is None
    with pytest.raises(ValueError, match="lora_alpha must be > 0"):
        GRPOConfig(lora_rank=8, lora_alpha=0.0)
    assert parse_args(["--preset", "qwen2.5-3b", "--lora-rank", "16"]).lora == LoraConfig(rank=16, alpha=32.0)
    assert GRPOConfig(lora_rank=8).lora.scale == 2.0 and GRPOConfig(lora_rank=8, lora_alpha=4.0).lora.scale == 0.5
    with pytest.raises(ValueError, match="needs a model and a dataset"):
        dataclasses.replace(PRESETS["qwen2.5-3b"], model=None)
    with pytest.raises(ValueError, match="needs a model and a dataset"):
        dataclasses.replace(PRESETS["qwen2.5-3b"], dataset=None)
    big = PRESETS["qwen2.5-3b"]
    assert big.model == "Qwen/Qwen2.5-3B-Instruct" and big.dataset == "openai/gsm8k" and big.dtype == "bfloat16"
    assert big.kl_beta > 0, "the preset trains against its reference model"
    assert big.prompts_per_step * big.group_size * (big.max_prompt_tokens + big.max_new_tokens) <= big.kv_tokens
    config = parse_args(["--preset", "qwen2.5-3b", "--steps", "3", "--no-resync"])
    assert config.steps == 3 and config.resync is False and config.max_new_tokens == 512


def test_a_command_line_error_names_the_command_a_user_runs(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--steps", "x"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("usage: python -m examples.grpo ")
