"""Batch invariance of engine log-probs: one probe request's sampled-token log-probs when it
is generated alone against inside a batch of 64 rows, dense and MoE tiny models, float32 and
bfloat16 engines, tp 1 and 2.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python -m bench.batch_invariance_bench

The probe samples 16 tokens at temperature 1 as prompt 0 of each call with the same call seed,
so its row seed (derived from seed, prompt index, sample index) is the same alone and in a
batch and the draws only differ if its log-probs differ enough to flip one. Log-probs are
compared over the prefix where the tokens agree. ``sync_params`` with the same weights flushes
the prefix cache before every call, so the probe's prompt KV is always computed in its own
call's batch. A second table splits the difference into its sources by changing one shape at
a time: the decode batch (rows, padded to 1, 2, 4, ... 64) and the prefill token bucket (64,
128, ... tokens).

A third table runs the same probe on a second worker per configuration in a fixed-shape mode,
which makes the log-probs batch-invariant: every forward is padded to one shape. The engine
pads each decode batch to the smallest entry of ``precompile_bs_paddings`` that holds its rows,
and each prefill to the smallest entry of ``precompile_token_paddings`` that holds its tokens
(its batch dimension always to the largest bs entry), whether or not it precompiles (this
project starts engines with precompile off unless ``precompile=True``). It keeps the bs entries
up to ``max_running_requests`` and the token entries from there up to ``min(max_prefill_tokens,
chunked_prefill_size)``, and adds each bound when the list stops short of it. So one entry at
each bound leaves one decode shape and one prefill shape:

    WorkerConfig(..., max_running_requests=64, max_prefill_tokens=1024, chunked_prefill_size=1024,
                 precompile_bs_paddings=(64,), precompile_token_paddings=(1024,))

(``precompile=True`` compiles the two shapes at start-up instead of on the first call.) The
other rows then only change the values in the padded arrays, not the arithmetic done on the
probe's row: the dots run at one shape, and the MoE block's ``jax.lax.ragged_dot`` lowers on CPU
to a dense dot over a group-masked copy of the rows, where other rows' routing only moves the
probe's rows and changes which products are exact zeros. The table checks the probe as row 0
and as row 31 of the batch (alone with ``prompt_offset=31``: the same row seed). Its cost: every
call, one row or 64, runs 64 decode rows and 1024 prefill tokens. Measured on XLA CPU only: the
TPU/GPU ragged_dot kernels tile by group sizes and are not covered here.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench.common import tiny_worker_config
from models import TinyModelSpec, TinyMoeSpec, write_tiny_model
from rollout import RolloutWorker
from trainer_bridge import load_hf_params

PROBE = [250, 251, 252, 7, 9, 11]
NEW_TOKENS = 16
ROWS = 64
SEED = 1234
REPEATS = 3
# The fixed-shape mode's one prefill token count: the 64-row batch's prompts (838 tokens) fit
# one prefill forward.
FIXED_TOKENS = 1024
# Where the probe also goes in the fixed-shape mode's batch.
MIDDLE = 31

_rng = np.random.default_rng(0)
# Varied lengths (2..24 tokens): what a real rollout batch looks like.
VARIED = [_rng.integers(3, 300, int(n)).tolist() for n in _rng.integers(2, 25, ROWS - 1)]
# The probe's length: with 8 rows the prefill (48 tokens) stays in the probe's 64-token bucket.
SAME_LENGTH = [_rng.integers(3, 300, len(PROBE)).tolist() for _ in range(ROWS - 1)]

MODELS = {"dense": TinyModelSpec(), "moe": TinyMoeSpec()}


class Probe:
    """The probe row's tokens and log-probs from ``REPEATS`` calls on the same prompts."""

    def __init__(self, worker: RolloutWorker, params, prompts: list[list[int]], row: int = 0, offset: int = 0):
        times, rows = [], []
        for _ in range(REPEATS):
            worker.sync_params(params)  # flushes the prefix cache: no KV from another batch
            start = time.perf_counter()
            batch = worker.generate(
                prompts,
                n=1,
                seed=SEED,
                temperature=1.0,
                return_logprobs=True,
                ignore_eos=True,
                max_new_tokens=NEW_TOKENS,
                prompt_offset=offset,  # alone with offset k: the row seed of prompt k in a batch
            )
            times.append(time.perf_counter() - start)
            mask = batch.completion_mask[row]
            rows.append((int(batch.seeds[row]), batch.tokens[row][mask], batch.logprobs[row][mask]))
        self.seed, self.tokens, self.logprobs = rows[-1]
        # The first call compiles the call's shapes: the median of the others is the run time.
        self.seconds = statistics.median(times[1:])
        self.repeatable = all(np.array_equal(r[1], self.tokens) and np.array_equal(r[2], self.logprobs) for r in rows)


def compare(a: Probe, b: Probe) -> tuple[int, float, float]:
    """Tokens agreeing before the first difference, max |Δ log p| over them, and |Δ| of the first
    token alone (the prefill's)."""
    assert a.seed == b.seed, "the probe's row seed changed between calls"
    equal = int(np.argmin(a.tokens == b.tokens)) if (a.tokens != b.tokens).any() else NEW_TOKENS
    delta = np.abs(a.logprobs[:equal] - b.logprobs[:equal])
    return equal, float(delta.max(initial=0.0)), float(delta[0]) if equal else float("nan")


def main() -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu}; jax {jax.__version__}, {jax.default_backend()} backend, {jax.device_count()} devices")
    print(f"probe: {len(PROBE)}-token prompt, {NEW_TOKENS} tokens at temperature 1, seed {SEED}; prefix cache flushed")
    main_rows, split_rows, fixed_rows, unrepeatable = [], [], [], []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in MODELS.items():
            model_dir = write_tiny_model(Path(tmp) / name, spec, with_tokenizer=False)
            params = load_hf_params(model_dir)
            for dtype in ("float32", "bfloat16"):
                for tp in (1, 2):
                    # One prefill forward for the whole batch (about 850 prompt tokens).
                    config = tiny_worker_config(
                        model_dir,
                        dtype,
                        tp,
                        max_running_requests=ROWS,
                        max_prefill_tokens=2048,
                        chunked_prefill_size=2048,
                    )
                    # The fixed-shape mode: one decode batch size, one prefill token count.
                    fixed_config = dataclasses.replace(
                        config,
                        max_prefill_tokens=FIXED_TOKENS,
                        chunked_prefill_size=FIXED_TOKENS,
                        precompile_bs_paddings=(ROWS,),
                        precompile_token_paddings=(FIXED_TOKENS,),
                    )
                    with RolloutWorker(fixed_config) as worker:
                        worker.sync_params(params)
                        middle = [*VARIED[:MIDDLE], PROBE, *VARIED[MIDDLE:]]
                        fixed = {
                            "alone": Probe(worker, params, [PROBE]),
                            "batch": Probe(worker, params, [PROBE] + VARIED),
                            "alone 31": Probe(worker, params, [PROBE], offset=MIDDLE),
                            "batch 31": Probe(worker, params, middle, row=MIDDLE),
                        }
                    with RolloutWorker(config) as worker:
                        worker.sync_params(params)
                        runs = {
                            "alone": Probe(worker, params, [PROBE]),
                            "batch": Probe(worker, params, [PROBE] + VARIED),
                            "2 rows": Probe(worker, params, [PROBE] + SAME_LENGTH[:1]),
                            "8 rows": Probe(worker, params, [PROBE] + SAME_LENGTH[:7]),
                            "64 same": Probe(worker, params, [PROBE] + SAME_LENGTH),
                        }
                    label = (name, dtype, tp)
                    unrepeatable += [(*label, run) for run, probe in runs.items() if not probe.repeatable]
                    unrepeatable += [(*label, f"fixed {run}") for run, probe in fixed.items() if not probe.repeatable]
                    fixed_rows.append(
                        (
                            *label,
                            compare(fixed["alone"], fixed["batch"]),
                            compare(fixed["alone 31"], fixed["batch 31"]),
                            runs,
                            fixed,
                        )
                    )
                    main_rows.append((*label, *compare(runs["alone"], runs["batch"]), runs))
                    split_rows.append(
                        (
                            *label,
                            compare(runs["alone"], runs["2 rows"]),
                            compare(runs["2 rows"], runs["8 rows"]),
                            compare(runs["8 rows"], runs["64 same"]),
                            compare(runs["64 same"], runs["batch"]),
                        )
                    )

    print(f"\nalone vs row 0 of a {ROWS}-row batch (other prompts 2..24 tokens), median of {REPEATS - 1} timed calls")
    print(
        f"{'model':6s} {'dtype':9s} {'tp':>2s} {'tokens equal':>13s} {'max |Δ log p|':>14s} "
        f"{'|Δ| 1st token':>14s} {'alone s':>8s} {'batch s':>8s}"
    )
    for name, dtype, tp, equal, max_delta, first_delta, runs in main_rows:
        print(
            f"{name:6s} {dtype:9s} {tp:2d} {f'{equal}/{NEW_TOKENS}':>13s} {max_delta:14.2e} {first_delta:14.2e} "
            f"{runs['alone'].seconds:8.3f} {runs['batch'].seconds:8.3f}"
        )

    print("\nwhere it comes from: tokens equal, max |Δ log p| between two calls that change one shape")
    columns = (
        "2 rows vs alone",  # decode batch 1 -> 2; prefill bucket 64 both
        "8 rows vs 2 rows",  # decode batch 2 -> 8; prefill bucket 64 both
        "64 same vs 8",  # decode 8 -> 64; prefill bucket 64 -> 512
        "64 varied vs same",  # decode 64 both; prefill bucket 512 -> 1024
    )
    print(f"{'model':6s} {'dtype':9s} {'tp':>2s} " + " ".join(f"{c:>18s}" for c in columns))
    for name, dtype, tp, *cells in split_rows:
        text = " ".join(f"{f'{equal:2d}/{NEW_TOKENS} {delta:8.1e}':>18s}" for equal, delta, _ in cells)
        print(f"{name:6s} {dtype:9s} {tp:2d} {text}")
    print(
        f"\nfixed shapes: precompile_bs_paddings=({ROWS},), precompile_token_paddings=({FIXED_TOKENS},), "
        f"max_prefill_tokens=chunked_prefill_size={FIXED_TOKENS}"
    )
    print(f"alone vs in the {ROWS}-row batch, the probe as row 0 and as row {MIDDLE}; seconds default -> fixed")
    print(
        f"{'model':6s} {'dtype':9s} {'tp':>2s} {'row 0: equal, max |Δ|':>22s} {f'row {MIDDLE}: equal, max |Δ|':>23s} "
        f"{'alone s':>14s} {'batch s':>14s}"
    )
    for name, dtype, tp, first, middle, runs, fixed in fixed_rows:
        cells = [f"{f'{equal:2d}/{NEW_TOKENS} {delta:8.1e}':>22s}" for equal, delta, _ in (first, middle)]
        times = [f"{f'{runs[k].seconds:.3f} -> {fixed[k].seconds:.3f}':>14s}" for k in ("alone", "batch")]
        print(f"{name:6s} {dtype:9s} {tp:2d} {cells[0]} {cells[1]:>23s} {times[0]} {times[1]}")
    if unrepeatable:
        print("not bitwise repeatable across calls on the same prompts:", unrepeatable)
    else:
        print(f"every call repeated {REPEATS} times on the same prompts gave bitwise equal tokens and log-probs")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
