"""Shared benchmark helpers: Qwen2.5-1.5B- and Llama-3.2-1B-shaped random model dirs, timing,
memory."""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

import jax
import psutil

from models import TinyModelSpec, write_tiny_model
from rollout import WorkerConfig

# Qwen2.5-1.5B: hidden 1536, intermediate 8960, 12 heads, 2 KV heads, head_dim 128, vocab 151936,
# tied embeddings. Layers are reduced (28 in the real model) to fit the 24 GiB CI machine.
QWEN25_15B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_attention_heads=12,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)

# Qwen2.5-3B: hidden 2048, intermediate 11008, 16 heads, 2 KV heads, head_dim 128, vocab 151936,
# tied embeddings (36 layers in the real model).
QWEN25_3B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_attention_heads=16,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


# Llama 3.2-1B: hidden 2048, intermediate 8192, 32 heads, 8 KV heads, head_dim 64, vocab 128256,
# tied embeddings, llama3 RoPE scaling (16 layers in the real model).
LLAMA32_1B_SHAPE = dict(
    architecture="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)

SHAPES = {"qwen2.5-1.5b": QWEN25_15B_SHAPE, "llama3.2-1b": LLAMA32_1B_SHAPE}


def qwen25_15b_dir(root: Path, num_layers: int) -> Path:
    return shaped_model_dir(root, "qwen2.5-1.5b", num_layers)


def shaped_model_dir(root: Path, shape: str, num_layers: int) -> Path:
    """A random model dir with one of SHAPES and ``num_layers`` layers (no tokenizer)."""
    spec = TinyModelSpec(num_hidden_layers=num_layers, **SHAPES[shape])
    return write_tiny_model(root, spec, with_tokenizer=False)


def median_seconds(fn, repeats: int, prepare=None) -> float:
    """Median time of ``fn()`` (``fn(prepare())`` with ``prepare``, which is not timed)."""
    times = []
    for _ in range(repeats):
        args = () if prepare is None else (prepare(),)
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class PeakRss:
    """Peak resident memory above the level at entry, sampled every millisecond."""

    def __enter__(self):
        self._process = psutil.Process(os.getpid())
        self.baseline = self._process.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def extra_bytes(self) -> int:
        return self.peak - self.baseline


def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def tiny_worker_config(model_dir: Path, dtype: str, tp: int, **overrides) -> WorkerConfig:
    """A worker on the first ``tp`` devices, dummy weights (the bench syncs its own), limits that
    hold a 64-row batch of a tiny model's short prompts."""
    settings = dict(
        model_path=str(model_dir),
        dtype=dtype,
        load_format="dummy",
        tp_size=tp,
        devices=tuple(jax.devices()[:tp]),
        max_total_tokens=4096,
        context_length=256,
        max_running_requests=64,
        max_prefill_tokens=1024,
        chunked_prefill_size=1024,
    )
    return WorkerConfig(**{**settings, **overrides})


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "?"
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({os.cpu_count()} cores, {isa})"
