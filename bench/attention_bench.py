"""Off-TPU attention: the paged attention against sglang-jax 0.0.2's native one.

    JAX_PLATFORMS=cpu python -m bench.attention_bench [--layers 24] [--settings 16x2048,64x32768]
        [--rollouts paged,paged@400,native@400] [--no-memory] [--no-layouts]
        [--layout-contexts 96,512,1024]

On a random Qwen2.5-0.5B-shaped model (bfloat16, dummy weights):

1. XLA's memory analysis of the engine's compiled forward (a prefill chunk and a decode step)
   at each ``max_running_requests x context_length`` setting, for both attentions: scratch
   bytes, and how they change from the first setting to the last.
2. Rollouts with the default ``WorkerConfig`` apart from the KV budget (and ``context_length``
   where a run names one, ``native@400``): 16 prompts x 256 tokens, n=4, 128 new tokens; wall
   time (compiles included), tokens/s and peak RSS, each run in a fresh process. The native
   attention cannot run the default setting (part 1 prints the scratch its prefill needs there),
   so compare it with a context_length the batch fits in.
3. The paged attention's two KV layouts (``head_major``: each KV head's rows gathered apart,
   what the engine runs where :func:`rollout.engine.attention.runs_head_major_dots` says so;
   slot rows, what it runs elsewhere), ``paged_attention`` jitted alone on one bfloat16 layer
   of the 0.5B shape: a decode of ``decode_rows`` requests at each of ``layout_contexts`` keys,
   and a prefill chunk of 32 prompts x 64 tokens; median of 15 calls each.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import PeakRss, gib, median_seconds
from models import TinyModelSpec
from rollout import RolloutWorker, WorkerConfig
from rollout.engine import attention, patches

# Qwen2.5-0.5B: hidden 896, intermediate 4864, 24 layers, 14 heads, 2 KV heads, head_dim 64,
# vocab 151936, tied embeddings, 32768 positions.
QWEN25_05B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
)
QWEN25_05B_HEAD_DIM = 64


@dataclasses.dataclass(frozen=True)
class AttentionBenchConfig:
    layers: int = 24
    # (max_running_requests, context_length) pairs for the memory analysis.
    settings: tuple[tuple[int, int], ...] = ((16, 2048), (64, 32768))
    memory: bool = True
    prefill_tokens: int = 2048  # the default chunked_prefill_size
    decode_rows: int = 16
    # "paged" or "native", with "@<context_length>" to override the model's.
    rollouts: tuple[str, ...] = ("paged", "paged@400", "native@400")
    prompts: int = 16
    prompt_tokens: int = 256
    n: int = 4
    new_tokens: int = 128
    max_total_tokens: int = 32768
    layouts: bool = True
    layout_rows: int = 64
    layout_contexts: tuple[int, ...] = (96, 512, 1024)


def qwen25_05b_dir(root: Path, layers: int) -> Path:
    """config.json only: with load_format="dummy" the engine needs no weights file, and head_dim
    64 is only safe without one (the safetensors loader pads head_dim to 128)."""
    spec = TinyModelSpec(num_hidden_layers=layers, **QWEN25_05B_SHAPE)
    config = spec.hf_config() | {"head_dim": QWEN25_05B_HEAD_DIM, "torch_dtype": "bfloat16"}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root


def attention_choice(paged: bool):
    return contextlib.nullcontext() if paged else patches.engine_native_attention()


def forward_memory(model_dir: Path, config: AttentionBenchConfig, paged: bool, max_requests: int, context: int):
    worker_config = WorkerConfig(
        model_path=str(model_dir),
        load_format="dummy",
        max_total_tokens=config.max_total_tokens,
        max_running_requests=max_requests,
        context_length=context,
    )
    with attention_choice(paged), RolloutWorker(worker_config) as worker:
        prefill = worker.engine.forward_memory(config.prefill_tokens)
        decode = worker.engine.forward_memory(config.decode_rows, decode=True)
    return prefill.temp_bytes, decode.temp_bytes


def rollout(model_dir: Path, config: AttentionBenchConfig, paged: bool, context: int | None) -> dict:
    worker_config = WorkerConfig(
        model_path=str(model_dir),
        load_format="dummy",
        max_total_tokens=config.max_total_tokens,
        context_length=context,
    )
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, QWEN25_05B_SHAPE["vocab_size"], (config.prompts, config.prompt_tokens)).tolist()
    with attention_choice(paged), PeakRss() as rss, RolloutWorker(worker_config) as worker:
        start = time.perf_counter()
        batch = worker.generate(
            prompts, n=config.n, temperature=1.0, max_new_tokens=config.new_tokens, ignore_eos=True, seed=0
        )
        seconds = time.perf_counter() - start
    tokens = int(batch.completion_mask.sum())
    assert tokens == config.prompts * config.n * config.new_tokens, tokens
    return dict(seconds=seconds, tokens=tokens, peak_rss=rss.peak, completions=batch.completions)


def rollout_in_fresh_process(*args) -> dict:
    """Peak RSS of a run on its own, not raised by what earlier runs left in the allocator."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(rollout, *args).result()


def memory_analysis(model_dir: Path, config: AttentionBenchConfig) -> None:
    print(
        f"\nXLA temp bytes of the compiled forward: prefill of {config.prefill_tokens} tokens "
        f"(requests padded to max_running_requests), decode of {config.decode_rows} rows"
    )
    temps = {}
    for max_requests, context in config.settings:
        for paged in (True, False):
            temps[paged, max_requests, context] = forward_memory(model_dir, config, paged, max_requests, context)
            prefill, decode = temps[paged, max_requests, context]
            print(
                f"  {'paged ' if paged else 'native'} {max_requests:>4} x {context:<6} "
                f"prefill {gib(prefill):>14}  decode {gib(decode):>14}",
                flush=True,
            )
    first = config.settings[0]
    for setting in config.settings[1:]:
        for paged in (True, False):
            small, large = temps[(paged, *first)], temps[(paged, *setting)]
            print(
                f"  {'paged ' if paged else 'native'} {setting[0]}x{setting[1]} / {first[0]}x{first[1]}: "
                f"prefill x{large[0] / small[0]:.2f}, decode x{large[1] / small[1]:.2f}"
            )
    for max_requests, context in config.settings:
        native, paged = temps[False, max_requests, context], temps[True, max_requests, context]
        print(
            f"  native / paged at {max_requests}x{context}: prefill x{native[0] / paged[0]:.1f}, "
            f"decode x{native[1] / paged[1]:.1f}"
        )


def rollouts(model_dir: Path, config: AttentionBenchConfig) -> None:
    rows = config.prompts * config.n
    print(
        f"\nRollout: {config.prompts} prompts x {config.prompt_tokens} tokens, n={config.n}, "
        f"{config.new_tokens} new tokens ({rows} rows), temperature 1, seed 0; default WorkerConfig, "
        f"max_total_tokens={config.max_total_tokens}; time includes compiles"
    )
    results = {}
    for run in config.rollouts:
        attention, _, context = run.partition("@")
        label = f"{attention:<6} context_length={context or 'model (32768)'}"
        try:
            result = rollout_in_fresh_process(model_dir, config, attention == "paged", int(context or 0) or None)
        except Exception as error:  # an allocation the machine cannot give is a result too
            print(f"  {label:<36} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        results[run] = result
        print(
            f"  {label:<36} {result['seconds']:8.1f} s  {result['tokens'] / result['seconds']:7.2f} tokens/s  "
            f"peak RSS {gib(result['peak_rss'])}",
            flush=True,
        )
    for run, result in results.items():
        attention, _, context = run.partition("@")
        paged = results.get(f"paged@{context}" if context else "paged")
        if attention == "native" and paged is not None:
            print(
                f"  at context_length={context}: paged x{result['seconds'] / paged['seconds']:.2f} faster, "
                f"peak RSS x{result['peak_rss'] / paged['peak_rss']:.2f} lower; same completions: "
                f"{result['completions'] == paged['completions']}"
            )


def layout_seconds(head_major: bool, rows: int, tokens_per_row: int, context: int) -> float:
    """One bfloat16 layer of the 0.5B shape: ``rows`` requests of ``context`` keys each, the
    last ``tokens_per_row`` of them new (1: a decode step), their slots spread over the pool."""
    heads, kv_heads = QWEN25_05B_SHAPE["num_attention_heads"], QWEN25_05B_SHAPE["num_key_value_heads"]
    key_q, key_kv, key_slots = jax.random.split(jax.random.key(0), 3)
    slots = rows * context
    pool = jax.random.normal(key_kv, (slots + 1, 2 * kv_heads, QWEN25_05B_HEAD_DIM), jnp.bfloat16)
    cache_loc = jax.random.permutation(key_slots, slots).astype(jnp.int32) + 1
    q = jax.random.normal(key_q, (rows * tokens_per_row, heads * QWEN25_05B_HEAD_DIM), jnp.bfloat16)
    seq_lens = jnp.full((rows,), context, jnp.int32)
    extend = () if tokens_per_row == 1 else (seq_lens - tokens_per_row, jnp.full((rows,), tokens_per_row, jnp.int32))
    attend = jax.jit(
        lambda *args: attention.paged_attention(
            *args, num_heads=heads, num_kv_heads=kv_heads, scale=QWEN25_05B_HEAD_DIM**-0.5, head_major=head_major
        )
    )
    run = lambda: jax.block_until_ready(attend(q, pool, cache_loc, seq_lens, *extend))  # noqa: E731
    run()
    return median_seconds(run, 15)


def layouts(config: AttentionBenchConfig) -> None:
    platform = jax.default_backend()
    print(f"\nKV layouts, one bfloat16 layer, paged_attention jitted alone (median of 15 calls), {platform}:")
    if not attention.runs_head_major_dots(platform, "bfloat16"):
        print("  head-major: this backend cannot run its bfloat16 batched dots (the engine gathers slot rows)")
        return
    cases = [(f"decode {config.layout_rows} rows x {c} keys", config.layout_rows, 1, c) for c in config.layout_contexts]
    cases.append(("prefill 32 prompts x 64 tokens", 32, 64, 64))
    for label, rows, tokens, context in cases:
        head_major = layout_seconds(True, rows, tokens, context)
        slot_rows = layout_seconds(False, rows, tokens, context)
        print(
            f"  {label:<32} head-major {head_major * 1e3:7.2f} ms  slot rows {slot_rows * 1e3:7.2f} ms  "
            f"x{slot_rows / head_major:.2f}",
            flush=True,
        )


def main(config: AttentionBenchConfig) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = qwen25_05b_dir(Path(tmp), config.layers)
        print(f"Qwen2.5-0.5B shape, {config.layers} of 24 layers, bfloat16, dummy weights")
        if config.memory:
            memory_analysis(model_dir, config)
        if config.rollouts:
            rollouts(model_dir, config)
    if config.layouts:
        layouts(config)


def parse_args() -> AttentionBenchConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = AttentionBenchConfig()
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument(
        "--settings",
        default=",".join(f"{r}x{c}" for r, c in defaults.settings),
        help="max_running_requests x context_length pairs for the memory analysis",
    )
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--rollouts", default=",".join(defaults.rollouts), help="'' for none")
    parser.add_argument("--prompts", type=int, default=defaults.prompts)
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    parser.add_argument("--n", type=int, default=defaults.n)
    parser.add_argument("--new-tokens", type=int, default=defaults.new_tokens)
    parser.add_argument("--max-total-tokens", type=int, default=defaults.max_total_tokens)
    parser.add_argument("--no-layouts", dest="layouts", action="store_false")
    parser.add_argument("--layout-rows", type=int, default=defaults.layout_rows)
    parser.add_argument("--layout-contexts", default=",".join(map(str, defaults.layout_contexts)))
    args = vars(parser.parse_args())
    args["layout_contexts"] = tuple(int(c) for c in args["layout_contexts"].split(","))
    args["settings"] = tuple(tuple(int(x) for x in pair.split("x")) for pair in args["settings"].split(","))
    args["rollouts"] = tuple(run for run in args["rollouts"].split(",") if run)
    return AttentionBenchConfig(**args)


if __name__ == "__main__":
    main(parse_args())
