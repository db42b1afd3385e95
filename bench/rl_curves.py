"""GRPO and PPO tiny reward curves over wall-clock seconds, one plot, same machine, same run.

    JAX_PLATFORMS=cpu python -m bench.rl_curves [--steps-grpo 60] [--steps-ppo 40] [--target-kl 0.1]

Runs, one after the other, each in a fresh process with one CPU device: the tiny GRPO preset,
the same with ``--target-kl`` (the approx-KL early stop), and the tiny PPO preset. Prints each
run's first and final reward (means of the first and last five steps), its seconds (from the
loop's first step to its last, so start-up and model load are out; the first steps include
compiling), and the approx-KL spikes of the two GRPO runs; writes ``<out>/rl_curves.png``
(reward over seconds; approx KL per step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def run(module: str, output_dir: Path, *args: str) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    metrics = output_dir / "metrics.jsonl"
    if metrics.exists():
        raise SystemExit(f"{output_dir} holds an earlier run: pass another --out")
    command = [sys.executable, "-m", module, "--output-dir", str(output_dir), "--no-progress", "--no-plot", *args]
    subprocess.run(command, env=env, check=True)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def describe(name: str, records: list[dict]) -> str:
    rewards = [r["reward"] for r in records]
    kl = np.array([r["approx_kl"] for r in records])
    return (
        f"{name:<22} reward {np.mean(rewards[:5]):.3f} -> {np.mean(rewards[-5:]):.3f} in {len(records)} steps, "
        f"{records[-1]['elapsed_s']:.0f} s; approx_kl median {np.median(kl):.3f}, max {kl.max():.1f}, "
        f"steps > 1: {int((kl > 1).sum())}"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-grpo", type=int, default=60)
    parser.add_argument("--steps-ppo", type=int, default=40)
    parser.add_argument("--target-kl", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=Path("runs/rl-curves"))
    args = parser.parse_args(argv)
    runs = {
        "grpo": run("examples.grpo", args.out / "grpo", "--steps", str(args.steps_grpo)),
        f"grpo target_kl={args.target_kl}": run(
            "examples.grpo",
            args.out / "grpo-target-kl",
            "--steps",
            str(args.steps_grpo),
            "--target-kl",
            str(args.target_kl),
        ),
        "ppo": run("examples.ppo", args.out / "ppo", "--steps", str(args.steps_ppo)),
    }
    for name, records in runs.items():
        print(describe(name, records))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward_ax, kl_ax) = plt.subplots(2, 1, figsize=(7, 7))
    for name, records in runs.items():
        reward_ax.plot([r["elapsed_s"] for r in records], [r["reward"] for r in records], label=name)
        if name.startswith("grpo"):
            kl_ax.plot([r["step"] for r in records], [r["approx_kl"] for r in records], label=name)
    reward_ax.set(
        xlabel="seconds since the loop started (start-up excluded)", ylabel="mean reward", title="tiny preset, a+b="
    )
    kl_ax.set(xlabel="step", ylabel="approx KL (last train step)", yscale="log")
    reward_ax.legend()
    kl_ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "rl_curves.png")
    print(f"wrote {args.out / 'rl_curves.png'}")


if __name__ == "__main__":
    main()
