"""Engine against trainer on the tiny Qwen3-MoE (8 experts, top-2, one dense layer): greedy
tokens and the log-prob mismatch of sampled tokens, float32 and bfloat16 engines, tp 1 and 2.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python -m bench.moe_parity_bench

The trainer is the float32 Flax model (``models/qwen3_moe_flax.py``) on the HF weights; each
engine starts with dummy weights and gets them by ``sync_params``. Mismatch over 8 prompts x
n=4 x 6 tokens sampled at temperature 1 (192 tokens), as docs/benchmarks.md's table for Qwen2/Qwen3.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import jax

from models import TinyMoeSpec, flax_model_for, greedy_decode, write_tiny_model
from rollout import RolloutWorker, WorkerConfig
from trainer_bridge import load_hf_params

PROMPTS = [[5, 17, 42, 8], [100, 3], [250, 251, 252, 7, 9, 11], [1], [64, 65, 66], [300, 2, 4], [9] * 7, [12, 34]]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp), TinyMoeSpec(), with_tokenizer=False)
        params = load_hf_params(model_dir)
        model = flax_model_for(json.loads((model_dir / "config.json").read_text()))
        reference = greedy_decode(model, params, PROMPTS, 16)
        print(
            f"{'engine':18s} {'greedy tokens equal':>20s} {'mean |Δ log p|':>15s} "
            f"{'max |Δ log p|':>14s} {'KL estimate':>12s}"
        )
        for dtype in ("float32", "bfloat16"):
            for tp in (1, 2):
                config = WorkerConfig(
                    model_path=str(model_dir),
                    dtype=dtype,
                    load_format="dummy",
                    tp_size=tp,
                    devices=tuple(jax.devices()[:tp]),
                    max_total_tokens=2048,
                    context_length=256,
                    max_running_requests=32,
                    max_prefill_tokens=512,
                    chunked_prefill_size=512,
                )
                with RolloutWorker(config) as worker:
                    worker.sync_params(params)
                    greedy = worker.generate(PROMPTS, temperature=0.0, max_new_tokens=16, ignore_eos=True).completions
                    equal = sum(a == b for g, r in zip(greedy, reference) for a, b in zip(g, r))
                    report = worker.check_consistency(params, PROMPTS, n=4, max_new_tokens=6, atol=10.0)
                print(
                    f"{dtype + ' tp=' + str(tp):18s} {f'{equal}/{16 * len(PROMPTS)}':>20s} "
                    f"{report.mean_abs_diff:15.2e} {report.max_abs_diff:14.2e} {report.kl:12.1e}"
                )


if __name__ == "__main__":
    main()
