"""Test set-up: JAX on CPU with 4 fake devices, tiny model dirs shared by the session."""

import os

# Before JAX is imported anywhere: several CPU devices so sharding code paths really run.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import pytest  # noqa: E402

import rollout  # noqa: E402, F401 - before any JAX computation: the XLA flags it sets (rollout/in_place_updates.py)
from models.tiny import TinyModelSpec, write_tiny_model  # noqa: E402
from models.tiny_moe import TinyMoeSpec  # noqa: E402


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    """Qwen2: biases, GQA (2 heads, 1 KV head), tied embeddings, with a tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec())


@pytest.fixture(scope="session")
def qwen2_untied_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen2_untied"), TinyModelSpec(tie_word_embeddings=False, seed=1))


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory):
    """The session's tiny Qwen2 (same weights: seed 0) with a ChatML chat template; also the
    stand-in for Qwen2.5-3B-Instruct."""
    return write_tiny_model(tmp_path_factory.mktemp("chat"), TinyModelSpec(chat_template=True))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """Qwen3: qk-norm, no biases, multi-head (2 KV heads), no tokenizer files."""
    spec = TinyModelSpec(architecture="qwen3", num_key_value_heads=2, seed=2)
    return write_tiny_model(tmp_path_factory.mktemp("qwen3"), spec, with_tokenizer=False)


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    """8 experts, top-2, normalized top-k weights; layer 0 dense (mlp_only_layers), layer 1 sparse."""
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), TinyMoeSpec(), with_tokenizer=False)
