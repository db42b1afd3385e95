"""Generation speed against the hardware's bound, with a per-step time split.

    JAX_PLATFORMS=cpu python -m bench.generate_bench [--shapes 0.5b,1.5b] [--layers 6,4]
        [--variants new,baseline] [--batches decode,prefill,padded] [--repeats 1] [--dummy-weights]

For each model shape (Qwen2.5-0.5B, -1.5B or -3B, some of their layers, bfloat16; the engine boots
with ``load_format="dummy"`` and then serves random weights through ``load_hf``, or with
``--dummy-weights`` its own dummy initialisation, for shapes too large to write random weights
for in the time at hand: the speed is the same, the tokens are not comparable):

1. tokens/s of a decode-heavy batch (16 prompts x 64 tokens, n=4, 64 new tokens, temperature 1,
   ``ignore_eos``: new tokens per second) and a prefill-heavy one (8 prompts x 512 tokens, one
   new token: prompt tokens per second), median of ``repeats`` calls after a warm-up call at
   the same shapes, on an engine that precompiled its extend and decode shapes at start-up
   (XLA compilations inside the timed calls, if any, are printed). ``--batches padded``: the
   decode-heavy batch with 15 prompts (60 rows, which the engine pads to its 64-row decode
   batch, as it pads every decode batch once some rows have stopped); ``decode16`` and
   ``decode256``: the decode-heavy batch at 16 and 256 rows (batch scaling).
2. The bound, measured in the same process on the same device: the batch's matmuls (every
   linear layer, the tied LM head on the rows that get logits) as plain jitted bfloat16 matmuls
   of the same shapes, step by step as the engine runs them (prefill chunks of
   ``chunked_prefill_size`` tokens, each prompt once and, for n > 1, one token per sample,
   then one decode step per new token after the first), the
   faster of bfloat16 and float32 output for the head; for decode also the weights' bytes over
   the memory bandwidth of a jitted sum over one float32 array of as many bytes, and the floor: those bytes
   plus the KV the step reads (every row's mean context) over the same bandwidth; and the
   step's matmuls under 'highest' precision, the one 0.0.2 sets on GPU. The bound is measured right
   after each timed call; printed: the median of the per-call ratios measured time / bound.
   The matmuls of a step run in the forward's order (a layer's after the layer before, the
   head after the last layer); the same matmuls each on its own input, which XLA may run side
   by side as no forward can, are printed beside it ("unordered").
3. The step split, from the engine itself (``rollout.engine.profile_steps``, one more call):
   per decode step (and per prefill chunk) its wall time, its model forward, its sampler, and
   the host (the rest: the scheduler's Python work). Inside the decode forward, from
   separately jitted functions of the engine's shapes: embedding gather, attention (the paged
   attention over the KV pool plus the KV write, all layers), projections (q/k/v/o), MLP, LM
   head; "glue" is the forward minus their sum (norms, rotary, residuals, logits slicing). The
   sampler at top-p 0.9 on logits x4 (kept tokens past the preselection) for reference.

``--torch-python PYTHON`` also runs the decode-heavy batch through Hugging Face transformers'
``generate`` on PyTorch (``bench/torch_generate.py`` under that interpreter, which needs torch
and transformers; same model dir, bfloat16, on the GPU when torch sees one), the comparison a
user makes first: ``--torch-modes`` eager (its dynamic cache) and compiled (a static cache and
``torch.compile``, CUDA graphs on a GPU).

``--trace DIR`` keeps a ``jax.profiler`` trace (Perfetto JSON, no Python tracer) of one more
decode-heavy call of 17 new tokens (its prefill forwards, then 16 decode steps) per variant, under
``DIR/<variant>``, and prints its operations of the largest self time (``bench.op_profile``).

``--variants baseline`` runs the same figures with ``ROLLOUT_DISABLE_WORKAROUNDS`` naming the
speed workarounds (``SPEED_WORKAROUNDS``), ``--variants without:NAME`` with that one workaround
off, ``--variants steps:K`` with ``WorkerConfig(decode_steps=K)`` (K decode steps per dispatch;
the profile then counts a chunk's forwards and sampling as its forward); each variant and shape
in a fresh process.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from bench.attention_bench import QWEN25_05B_HEAD_DIM, QWEN25_05B_SHAPE
from bench.common import QWEN25_3B_SHAPE, QWEN25_15B_SHAPE, PeakRss, gib, median_seconds
from bench.op_profile import perfetto_trace, self_times, trace_events
from models import TinyModelSpec, random_hf_weights, table_logits
from rollout import RolloutWorker, WorkerConfig, counting_compiles
from rollout.engine import StepSplit, attention, patches, profile_steps, workarounds
from rollout.engine.programs import engine_compiler_options

# name: (HF shape, head_dim)
SHAPES = {
    "0.5b": (QWEN25_05B_SHAPE, QWEN25_05B_HEAD_DIM),
    "1.5b": (QWEN25_15B_SHAPE, 128),
    "3b": (QWEN25_3B_SHAPE, 128),
}
# The workarounds this bench's baseline variant switches off.
SPEED_WORKAROUNDS: tuple[str, ...] = ("kv-pool-conversions", "bf16-logits", "bf16-matmul-precision", "gpu-dot-merger")


@dataclasses.dataclass(frozen=True)
class Batch:
    prompts: int
    prompt_tokens: int
    n: int
    new_tokens: int
    label: str

    @property
    def rows(self) -> int:
        return self.prompts * self.n

    @property
    def decodes(self) -> bool:
        return self.new_tokens > 1


# "padded": the decode-heavy batch with 60 rows, which the engine pads to its 64-row decode
# batch, as it pads every batch once some of its rows have stopped (and every extend batch).
BATCHES = {
    "decode": Batch(16, 64, 4, 64, "decode-heavy"),
    "prefill": Batch(8, 512, 1, 1, "prefill-heavy"),
    "padded": Batch(15, 64, 4, 64, "decode-heavy, padded"),
    # Batch scaling: the decode-heavy batch at 16 and 256 rows.
    "decode16": Batch(4, 64, 4, 64, "decode-heavy, 16 rows"),
    "decode256": Batch(64, 64, 4, 64, "decode-heavy, 256 rows"),
}


@dataclasses.dataclass(frozen=True)
class GenerateBenchConfig:
    shapes: tuple[str, ...] = ("0.5b", "1.5b")
    layers: tuple[int, ...] = (6, 4)
    variants: tuple[str, ...] = ("new", "baseline")
    batches: tuple[str, ...] = ("decode", "prefill")
    repeats: int = 1
    max_total_tokens: int = 16384
    chunked_prefill_size: int = 2048
    torch_python: str | None = None
    # "eager": generate with its dynamic cache; "compiled": a static cache and torch.compile
    # (CUDA graphs on a GPU), the fastest PyTorch path.
    torch_modes: tuple[str, ...] = ("eager", "compiled")
    dummy_weights: bool = False
    decode_steps: int = 1  # a child's WorkerConfig.decode_steps (variant steps:K)
    trace: str | None = None  # a directory: one traced decode-heavy call per variant kept there


def model_dir(root: Path, shape: str, layers: int, weights: bool = True) -> Path:
    """The shape's config.json, and its random weights unless ``weights`` is false."""
    hf_shape, head_dim = SHAPES[shape]
    spec = TinyModelSpec(num_hidden_layers=layers, head_dim=head_dim, **{**hf_shape, "max_position_embeddings": 4096})
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(spec.hf_config() | {"torch_dtype": "bfloat16"}, indent=2))
    if weights:
        save_file(random_hf_weights(spec), str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def kv_bytes_per_step(shape: str, layers: int, batch: Batch) -> int:
    """The KV a decode step reads (keys and values of every row's context, bf16), at the
    batch's mean context over its decode steps."""
    hf, head_dim = SHAPES[shape]
    mean_context = batch.prompt_tokens + batch.new_tokens / 2
    return int(batch.rows * mean_context * layers * 2 * hf["num_key_value_heads"] * head_dim * 2)


_calls = itertools.count()


def prompts_for(batch: Batch, vocab: int) -> list[list[int]]:
    """Fresh random prompts for every call: a repeated prompt would be served from the
    engine's prefix cache and skip its prefill."""
    rng = np.random.default_rng(next(_calls))
    return rng.integers(1, vocab, (batch.prompts, batch.prompt_tokens)).tolist()


def timed_generate(worker, batch: Batch, vocab: int, new_tokens: int | None = None) -> float:
    new_tokens = new_tokens or batch.new_tokens
    prompts = prompts_for(batch, vocab)
    start = time.perf_counter()
    out = worker.generate(prompts, n=batch.n, temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    seconds = time.perf_counter() - start
    assert int(out.completion_mask.sum()) == batch.rows * new_tokens
    return seconds


# ---- the bound: plain jitted matmuls of the forward's shapes ----------------------------------


def layer_weights(shape: str, layers: int, key) -> tuple[list[dict], jax.Array]:
    """bf16 weights of the engine's shapes ([in, out] linears, [vocab, hidden] tied head)."""
    hf, head_dim = SHAPES[shape]
    h, inter = hf["hidden_size"], hf["intermediate_size"]
    q, kv = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim
    shapes = dict(q=(h, q), k=(h, kv), v=(h, kv), o=(q, h), gate=(h, inter), up=(h, inter), down=(inter, h))
    out = []
    for i in range(layers):
        keys = jax.random.split(jax.random.fold_in(key, i), len(shapes))
        out.append({n: jax.random.normal(k, s, jnp.bfloat16) for k, (n, s) in zip(keys, shapes.items())})
    head = jax.random.normal(jax.random.fold_in(key, layers), (hf["vocab_size"], h), jnp.bfloat16)
    return out, head


def _head(rows, head, float32_head):
    return table_logits(rows, head) if float32_head else rows @ head.T


# The bound's matmuls compile as the engine's forward does (programs.engine_compiler_options: on a
# GPU, sibling dots stay apart rather than concatenated every call where cuBLAS runs them).
BOUND_OPTIONS = engine_compiler_options(jax.default_backend())


@functools.partial(jax.jit, static_argnames=("logit_rows", "float32_head"), compiler_options=BOUND_OPTIONS)
def _ordered_matmuls(weights, head, x, logit_rows, float32_head):
    """Every matmul of one forward in the forward's order: each layer's q/k/v from its input,
    o from q (attention's place), gate and up from o, down from their product (the MLP's),
    the next layer from down, the head from the last layer. Independent ones (q, k, v; gate,
    up) may run side by side, as they may in the engine; dependent ones may not, except k and
    v, which feed nothing here (attention needs them in the forward) and may overlap later
    work: ~1.6% of a layer's matmul FLOPs at these shapes. The last layer's whole output is
    returned, so no rewrite can shrink it to the head's rows. The values overflow within a
    few layers; a dense matmul's time does not depend on them."""
    side = []
    for w in weights:
        q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
        side += [k, v]
        o = q @ w["o"]
        x = (o @ w["gate"] * (o @ w["up"])) @ w["down"]
    return _head(x[:logit_rows], head, float32_head), side, x


@functools.partial(jax.jit, static_argnames="float32_head", compiler_options=BOUND_OPTIONS)
def _unordered_matmuls(weights, head, x, attn, mlp, head_rows, float32_head):
    """Every matmul of one forward, each on its own input: XLA may run any of them side by
    side (in a profile on this 2-core VM the head's 46-49 ms dot ran on one core while the
    layers' dots ran on the other), which no forward can, its head needing its last layer."""
    outs = []
    for w in weights:
        outs += [x @ w["q"], x @ w["k"], x @ w["v"], attn @ w["o"], x @ w["gate"], x @ w["up"], mlp @ w["down"]]
    outs.append(_head(head_rows, head, float32_head))
    return outs


def matmul_seconds(weights, head, tokens: int, logit_rows: int, repeats: int, ordered: bool = True) -> float:
    """The faster of the two head outputs (bfloat16, float32) with the same linear layers."""
    return min(_matmul_seconds(weights, head, tokens, logit_rows, repeats, f32, ordered) for f32 in (False, True))


def _matmul_seconds(
    weights, head, tokens: int, logit_rows: int, repeats: int, float32_head: bool, ordered: bool
) -> float:
    h = head.shape[1]
    x = jnp.ones((tokens, h), jnp.bfloat16)
    if ordered:
        run = lambda: jax.block_until_ready(_ordered_matmuls(weights, head, x, logit_rows, float32_head))  # noqa: E731
    else:
        attn = jnp.ones((tokens, weights[0]["o"].shape[0]), jnp.bfloat16)
        mlp = jnp.ones((tokens, weights[0]["down"].shape[0]), jnp.bfloat16)
        rows = jnp.ones((logit_rows, h), jnp.bfloat16)
        run = lambda: jax.block_until_ready(_unordered_matmuls(weights, head, x, attn, mlp, rows, float32_head))  # noqa: E731
    run()
    return median_seconds(run, repeats)


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second of a jitted sum reading one float32 array of ``nbytes`` once: the
    device's read speed. A sum of bfloat16 measures XLA's conversions on some backends, and
    a sum per weight (hundreds of small reductions) read at 1.49 TB/s on an H200 where one copy
    of 55 MB ran at ~4 TB/s."""
    array = jnp.ones(nbytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    run = lambda: jax.block_until_ready(total(array))  # noqa: E731
    run()
    return nbytes / median_seconds(run, repeats)


def prefill_chunks(batch: Batch, chunk: int) -> list[tuple[int, int]]:
    """(tokens, requests ending in it) per prefill forward, as the engine runs them: each
    prompt once, packed into chunks; then, for n > 1, the last prompt token of every sample
    (the rest of its prompt is found in the prefix cache)."""
    tokens = batch.prompts * batch.prompt_tokens
    chunks = []
    done = 0
    while done < tokens:
        size = min(chunk, tokens - done)
        ends = (done + size) // batch.prompt_tokens - done // batch.prompt_tokens
        chunks.append((size, max(ends, 1)))
        done += size
    if batch.n > 1:
        chunks.append((batch.rows, batch.rows))
    return chunks


# ---- the decode step split: separately jitted pieces of the engine's shapes -------------------


def decode_split(shape: str, weights, head, batch: Batch, pool_slots: int, repeats: int) -> dict[str, float]:
    hf, head_dim = SHAPES[shape]
    rows, layers = batch.rows, len(weights)
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    seq = batch.prompt_tokens + batch.new_tokens // 2
    ids = jnp.arange(rows, dtype=jnp.int32) * 7 + 1
    x = jnp.ones((rows, head.shape[1]), jnp.bfloat16)
    pool = [jnp.zeros((pool_slots, 2 * kv_heads, head_dim), jnp.bfloat16) for _ in range(layers)]
    q = jnp.ones((rows, heads * head_dim), jnp.bfloat16)
    kv_new = jnp.ones((rows, 2 * kv_heads, head_dim), jnp.bfloat16)
    cache_loc = jnp.arange(1, rows * seq + 1, dtype=jnp.int32)
    out_loc = jnp.arange(rows, dtype=jnp.int32) * seq + seq
    seq_lens = jnp.full((rows,), seq, jnp.int32)
    view = workarounds.workaround_enabled("kv-pool-conversions") and attention.converts_16bit_rows(
        jax.default_backend()
    )
    head_major = attention.runs_head_major_dots(jax.default_backend(), "bfloat16")  # as the engine chooses

    def attend(pool, q, kv_new):
        outs, new_pool = [], []
        for layer in pool:
            layer = attention.set_rows(layer, out_loc, kv_new, view)
            new_pool.append(layer)
            outs.append(
                attention.paged_attention(
                    q,
                    layer,
                    cache_loc,
                    seq_lens,
                    num_heads=heads,
                    num_kv_heads=kv_heads,
                    scale=head_dim**-0.5,
                    integer_view=view,
                    head_major=head_major,
                )
            )
        return outs, new_pool

    # The weights are arguments: closed over, they would be compiled in as constants (GBs at 3B).
    def projections(weights, x, attn):
        return [(x @ w["q"], x @ w["k"], x @ w["v"], attn @ w["o"]) for w in weights]

    def mlp(weights, x):
        return [(jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"] for w in weights]

    logits = jax.random.normal(jax.random.key(0), (rows, hf["vocab_size"]), jnp.float32) * 4
    seeds = jnp.arange(rows, dtype=jnp.int32)
    positions = jnp.full((rows,), seq, jnp.int32)

    def sampler(logits, top_p):
        operands = (
            logits,
            jnp.ones(rows),
            jnp.full(rows, 2**30, jnp.int32),
            jnp.full(rows, top_p),
            jnp.zeros(rows),
            seeds,
            positions,
            jax.random.key(0),
        )
        return patches._draw_with_logprobs(operands)

    pieces = {
        "embedding": (jax.jit(lambda table, ids: jnp.take(table, ids, axis=0)), (head, ids)),
        "attention": (jax.jit(attend, donate_argnums=0), None),
        "projections": (jax.jit(projections, compiler_options=BOUND_OPTIONS), (weights, x, q)),
        "mlp": (jax.jit(mlp, compiler_options=BOUND_OPTIONS), (weights, x)),
        "lm_head": (jax.jit(table_logits), (x, head)),
        "sampler top-p 0.9": (jax.jit(lambda logits: sampler(logits, 0.9)), (logits,)),
    }
    split = {}
    for name, (fn, args) in pieces.items():
        if name == "attention":
            state = {"pool": pool}

            def run():
                outs, state["pool"] = fn(state["pool"], q, kv_new)
                jax.block_until_ready(outs)
        else:
            run = lambda fn=fn, args=args: jax.block_until_ready(fn(*args))  # noqa: E731
        run()
        split[name] = median_seconds(run, repeats)
    return split


# ---- one shape and variant, in its own process ------------------------------------------------


def bound_seconds(weights, head, batch: Batch, chunk: int, repeats: int, ordered: bool = True) -> tuple[float, float]:
    """(the batch's matmul bound, one decode step's matmuls), in seconds."""
    prefill = sum(matmul_seconds(weights, head, t, r, repeats, ordered) for t, r in prefill_chunks(batch, chunk))
    decode = matmul_seconds(weights, head, batch.rows, batch.rows, repeats, ordered) if batch.new_tokens > 1 else 0.0
    return prefill + (batch.new_tokens - 1) * decode, decode


def measure(shape: str, layers: int, config: GenerateBenchConfig) -> dict:
    hf, _ = SHAPES[shape]
    vocab = hf["vocab_size"]
    result: dict = {"uptime": os.getloadavg()}
    weights, head = layer_weights(shape, layers, jax.random.key(0))
    reps = max(3, config.repeats)
    batches = [BATCHES[name] for name in config.batches]
    rows = max(b.rows for b in batches)
    with tempfile.TemporaryDirectory() as tmp:
        directory = model_dir(Path(tmp), shape, layers, weights=not config.dummy_weights)
        worker_config = WorkerConfig(
            model_path=str(directory),
            dtype="bfloat16",
            load_format="dummy",
            # Room for the widest batch twice over (its prompts stay in the prefix cache).
            max_total_tokens=max(
                config.max_total_tokens, 2 * max(b.rows * (b.prompt_tokens + b.new_tokens) for b in batches)
            ),
            chunked_prefill_size=config.chunked_prefill_size,
            max_prefill_tokens=config.chunked_prefill_size,
            max_running_requests=max(64, rows),
            # What the batches need: static decode chunks (a GPU's) compile one program per KV
            # walk up to the context, so no more walks than the batches reach. 0.0.2 takes
            # prompts of up to context_length - 7 tokens, prompt + completion up to - 2.
            context_length=max(max(b.prompt_tokens + 7, b.prompt_tokens + b.new_tokens + 2) for b in batches)
            + config.decode_steps,
            decode_steps=config.decode_steps,
            # Every extend token bucket and the decode batch compiled at start-up, as a long RL
            # run has them after its first steps: the first extend of a call packs a varying
            # number of tokens, and one bucket compiled inside the timed call cost it ~2 s.
            precompile=True,
            # Each decode batch's width, but the padded batch's 60 rows, which pad to 64.
            precompile_bs_paddings=tuple(
                sorted({64} | {BATCHES[n].rows for n in config.batches if BATCHES[n].decodes and n != "padded"})
            ),
        )
        with PeakRss() as rss, RolloutWorker(worker_config) as worker:
            if not config.dummy_weights:
                worker.load_hf(directory)
            for name in config.batches:
                batch = BATCHES[name]
                # Warm-up at the same padded shapes (prefill chunks, decode rows): compiles.
                timed_generate(worker, batch, vocab, min(batch.new_tokens, 2))
                for ordered in (True, False):
                    bound_seconds(weights, head, batch, config.chunked_prefill_size, 1, ordered)
                # Each call's bound is measured right after it and the ratio taken per call: on
                # this 2-core VM the same matmuls ran 64-106 ms per step from one minute to the
                # next, while a bound measured once would be compared with every call.
                calls, bounds, decodes, unordered = [], [], [], []
                with counting_compiles() as compiles:
                    for _ in range(config.repeats):
                        calls.append(timed_generate(worker, batch, vocab))
                        bound, decode = bound_seconds(weights, head, batch, config.chunked_prefill_size, reps)
                        bounds.append(bound)
                        decodes.append(decode)
                        unordered.append(
                            bound_seconds(weights, head, batch, config.chunked_prefill_size, reps, ordered=False)[0]
                        )
                    with profile_steps() as times:
                        timed_generate(worker, batch, vocab)
                entry = {
                    "seconds": statistics.median(calls),
                    "bound": statistics.median(bounds),
                    "ratio": statistics.median(c / b for c, b in zip(calls, bounds)),
                    "unordered_bound": statistics.median(unordered),
                    "unordered_ratio": statistics.median(c / b for c, b in zip(calls, unordered)),
                    "decode_matmuls": statistics.median(decodes),
                    "compiles": compiles.value,
                }
                # None where no step of the mode had a next one (a prefill of one chunk).
                profiled = times.split("decode" if batch.decodes else "extend")
                entry["profile"] = None if profiled is None else dataclasses.asdict(profiled)
                if config.trace and name == "decode":
                    entry["traced_ops"] = traced_call(worker, batch, vocab, Path(config.trace))
                result[name] = entry
        result["peak_rss"] = rss.peak
    print(json.dumps(result), flush=True)  # the generate figures, should the split's part fail
    arrays = [w for layer in weights for w in layer.values()] + [head]
    if any(b.decodes for b in batches):
        weight_bytes = sum(x.nbytes for x in arrays)
        bandwidth = read_bandwidth(weight_bytes, reps)
        result["bandwidth"] = bandwidth
        for name in config.batches:
            if BATCHES[name].decodes:
                result[name]["bytes_step"] = weight_bytes / bandwidth
                result[name]["floor_step"] = (
                    weight_bytes + kv_bytes_per_step(shape, layers, BATCHES[name])
                ) / bandwidth
    if "decode" in config.batches:
        # 0.0.2 runs its forward under 'highest' on GPU (workaround bf16-matmul-precision): the
        # same matmuls under it, to see what that precision costs.
        with jax.default_matmul_precision("highest"):
            rows = BATCHES["decode"].rows
            result["decode"]["decode_matmuls_highest"] = matmul_seconds(weights, head, rows, rows, reps)
        result["decode"]["split"] = decode_split(
            shape, weights, head, BATCHES["decode"], config.max_total_tokens + 1, config.repeats
        )
    result["uptime_after"] = os.getloadavg()
    return result


TRACED_NEW_TOKENS = 17  # the prefill forwards, then 16 decode steps: one chunk of 16 with decode_steps=16


def traced_call(worker, batch: Batch, vocab: int, log_dir: Path) -> list | str:
    """One call of ``batch`` with TRACED_NEW_TOKENS new tokens, traced into a new folder under
    ``log_dir``: its operations of the largest self time (name, seconds, events), or why none
    were read."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with perfetto_trace(tempfile.mkdtemp(dir=log_dir)) as found:
        timed_generate(worker, batch, vocab, TRACED_NEW_TOKENS)
    try:
        return self_times(trace_events(found[0])).top(25)
    except (IndexError, OSError, ValueError, KeyError) as exc:  # the trace file stays for reading
        return f"the trace was not read: {exc!r}"


def run_child(shape: str, layers: int, variant: str, config: GenerateBenchConfig) -> dict:
    env = dict(os.environ)
    if variant == "baseline":
        env[workarounds.DISABLE_ENV] = ",".join(SPEED_WORKAROUNDS)
    elif variant.startswith("without:"):
        env[workarounds.DISABLE_ENV] = variant.removeprefix("without:")
    elif not variant.startswith("steps:") and variant != "new":
        raise ValueError(f"unknown variant {variant!r}: new, baseline, without:WORKAROUND or steps:K")
    args = [
        sys.executable,
        "-m",
        "bench.generate_bench",
        "--child",
        f"{shape}:{layers}",
        "--batches",
        ",".join(config.batches),
        "--repeats",
        str(config.repeats),
    ]
    args += ["--dummy-weights"] if config.dummy_weights else []
    args += ["--decode-steps", variant.removeprefix("steps:")] if variant.startswith("steps:") else []
    args += ["--trace", str(Path(config.trace) / variant.replace(":", "-"))] if config.trace else []
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{shape} {variant} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def torch_decode(shape: str, layers: int, config: GenerateBenchConfig, mode: str) -> dict:
    batch = BATCHES["decode"]
    with tempfile.TemporaryDirectory() as tmp:
        directory = model_dir(Path(tmp), shape, layers, weights=not config.dummy_weights)
        args = [
            config.torch_python,
            str(Path(__file__).with_name("torch_generate.py")),
            str(directory),
            "--prompts",
            str(batch.prompts),
            "--prompt-tokens",
            str(batch.prompt_tokens),
            "--n",
            str(batch.n),
            "--new-tokens",
            str(batch.new_tokens),
            "--repeats",
            str(config.repeats),
        ]
        args += ["--compile"] if mode == "compiled" else []
        done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"PyTorch reference ({mode}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(shape: str, layers: int, variant: str, r: dict) -> None:
    load = " ".join(f"{x:.1f}" for x in r["uptime"])
    print(
        f"\n{shape} shape, {layers} layers, bf16, {variant}: load average {load} "
        f"(after: {r['uptime_after'][0]:.1f}), peak RSS {gib(r['peak_rss'])}"
    )
    for name, b in BATCHES.items():
        if name not in r:
            continue
        e = r[name]
        counted = b.rows * b.new_tokens if b.decodes else b.rows * b.prompt_tokens
        what = "new tokens/s" if b.decodes else "prompt tokens/s"
        print(
            f"  {b.label} ({b.prompts} prompts x {b.prompt_tokens}, n={b.n}, {b.new_tokens} new): "
            f"{e['seconds']:.2f} s, {counted / e['seconds']:.1f} {what}; matmul bound {e['bound']:.2f} s "
            f"({counted / e['bound']:.1f} {what}): x{e['ratio']:.2f} the bound (median of the per-call ratios; "
            f"of the medians x{e['seconds'] / e['bound']:.2f}); the same matmuls unordered "
            f"{e['unordered_bound']:.2f} s: x{e['unordered_ratio']:.2f}"
            + (f"; {e['compiles']} XLA compilations in the timed calls" if e["compiles"] else "")
        )
        if e["profile"] is None:
            print(f"    engine profile per {name} step: no step was followed by another")
            continue
        profiled = StepSplit(**e["profile"])
        step, forward, sampler, host = profiled.wall_s, profiled.forward_s, profiled.sample_s, profiled.host_s
        print(
            f"    engine profile per {name} step ({profiled.steps} steps): {step * 1e3:.1f} ms: "
            f"forward {forward * 1e3:.1f} ms ({forward / step:.0%}), "
            f"sampler {sampler * 1e3:.1f} ms ({sampler / step:.0%}), host {host * 1e3:.1f} ms ({host / step:.0%})"
        )
        if b.decodes:
            print(
                f"    decode step matmuls {e['decode_matmuls'] * 1e3:.2f} ms "
                f"(measured step x{step / e['decode_matmuls']:.2f}), "
                f"weights' bytes / read bandwidth ({r['bandwidth'] / 1e9:.0f} GB/s) {e['bytes_step'] * 1e3:.2f} ms "
                f"(x{step / e['bytes_step']:.2f}); floor (weights + the step's mean KV) "
                f"{e['floor_step'] * 1e3:.2f} ms (x{step / e['floor_step']:.2f})"
            )
        if "decode_matmuls_highest" in e:
            print(
                f"    the decode step's matmuls under 'highest' precision {e['decode_matmuls_highest'] * 1e3:.2f} ms "
                f"(x{e['decode_matmuls_highest'] / e['decode_matmuls']:.2f} the default's)"
            )
        if isinstance(e.get("traced_ops"), str):
            print(f"    traced call: {e['traced_ops']}")
        elif e.get("traced_ops"):
            print(f"    traced call of {TRACED_NEW_TOKENS} new tokens, operations of the largest self time:")
            for op, seconds, count in e["traced_ops"]:
                print(f"      {seconds * 1e3:9.2f} ms {count:6d}x {op}")
        if name == "decode":
            split = e["split"]
            pieces = {k: v for k, v in split.items() if k != "sampler top-p 0.9"}
            glue = forward - sum(pieces.values())
            print(
                "    forward pieces (separately jitted): "
                + ", ".join(f"{k} {v * 1e3:.1f} ms ({v / step:.0%})" for k, v in pieces.items())
                + f", glue {glue * 1e3:.1f} ms ({glue / step:.0%}); "
                f"sampler at top-p 0.9: {split['sampler top-p 0.9'] * 1e3:.1f} ms"
            )


def main(config: GenerateBenchConfig) -> None:
    print(
        f"uptime: {os.getloadavg()}; JAX {jax.__version__}, {jax.devices()[0].platform}; "
        f"baseline = {workarounds.DISABLE_ENV}={','.join(SPEED_WORKAROUNDS) or '(none)'}"
    )
    for shape, layers in zip(config.shapes, config.layers):
        results = {}
        for variant in config.variants:
            results[variant] = run_child(shape, layers, variant, config)
            report(shape, layers, variant, results[variant])
        for mode in config.torch_modes if config.torch_python and "decode" in config.batches else ():
            try:
                reference = torch_decode(shape, layers, config, mode)
            except RuntimeError as exc:  # one mode failing leaves the other's figure
                print(f"  {exc}")
                continue
            torch_seconds, batch = reference["seconds"], BATCHES["decode"]
            print(
                f"  PyTorch {reference['torch']} on {reference['device']} (transformers {reference['transformers']} "
                f"generate, {reference['mode']}, bf16), decode-heavy: {torch_seconds:.2f} s, "
                f"{batch.rows * batch.new_tokens / torch_seconds:.1f} new tokens/s"
                + "".join(f"; {v} x{torch_seconds / r['decode']['seconds']:.2f} as fast" for v, r in results.items())
            )
        for other in sorted(results.keys() - {"new"}) if "new" in results else ():
            for name in config.batches:
                ratio = results[other][name]["seconds"] / results["new"][name]["seconds"]
                print(f"  {shape} {BATCHES[name].label}: {other} takes x{ratio:.2f} the time of new")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = GenerateBenchConfig()
    parser.add_argument("--shapes", default=",".join(d.shapes))
    parser.add_argument("--layers", default=",".join(map(str, d.layers)))
    parser.add_argument("--variants", default=",".join(d.variants))
    parser.add_argument("--batches", default=",".join(d.batches))
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--torch-python", help="a Python with torch and transformers: adds the PyTorch reference")
    parser.add_argument(
        "--torch-modes",
        default=",".join(d.torch_modes),
        help="eager (dynamic cache), compiled (static cache, torch.compile)",
    )
    parser.add_argument(
        "--dummy-weights",
        action="store_true",
        help="serve the engine's dummy initialisation instead of written random weights",
    )
    parser.add_argument("--trace", help="a directory: keep a profiler trace of one decode-heavy call per variant")
    parser.add_argument("--decode-steps", type=int, default=d.decode_steps, help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = GenerateBenchConfig(
        shapes=tuple(args.shapes.split(",")),
        layers=tuple(int(x) for x in args.layers.split(",")),
        variants=tuple(args.variants.split(",")),
        batches=tuple(args.batches.split(",")),
        repeats=args.repeats,
        torch_python=args.torch_python,
        torch_modes=tuple(args.torch_modes.split(",")),
        dummy_weights=args.dummy_weights,
        decode_steps=args.decode_steps,
        trace=args.trace,
    )
    return config, args.child


if __name__ == "__main__":
    config, child = parse_args()
    if child:
        shape, layers = child.split(":")
        print(json.dumps(measure(shape, int(layers), config)))
    else:
        main(config)
