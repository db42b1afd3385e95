"""Test set-up: JAX on CPU with 4 fake devices, tiny model dirs shared by the session."""

import gc
import os
import pathlib
import sys

# Before JAX is imported anywhere: several CPU devices so sharding code paths really run.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
# Every test module and subprocess (pinning checks, servers, pod processes, example runs) compiles
# the same tiny programs again; JAX's persistent cache keeps them on disk, one per environment.
# Entries are keyed by the program, jax version, devices and XLA flags, so nothing stale is
# reused. No size limit: with one, every new entry reads every entry's access time for its LRU
# eviction (0.33 s per write at the ~2,300 entries a run leaves; two unit files that add 658
# entries took 60 s instead of 12). Without the limit's file lock, a process that reads an entry
# another is still writing gets a warning and compiles the program itself.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    str(pathlib.Path(__file__).resolve().parent.parent / ".cache" / "jax" / pathlib.Path(sys.prefix).name.lstrip(".")),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

import rollout  # noqa: E402, F401 - before any JAX computation: the XLA flags it sets (rollout/in_place_updates.py)
from models.tiny import TinyModelSpec, write_tiny_model  # noqa: E402
from models.tiny_moe import TinyMoeSpec  # noqa: E402


@pytest.fixture
def caplog(caplog):
    """The log of this test alone: earlier tests' garbage is collected first. Some of it logs when
    collected, in whichever test that happens: a failed orbax restore leaves reads in flight on a
    loop it has closed, whose errors asyncio logs ("_GatheringFuture exception was never
    retrieved") once they are collected. What a fixture's set-up logs is not the test's record."""
    gc.collect()
    return caplog


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
