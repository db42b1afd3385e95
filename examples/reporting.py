"""What an RL run reports: each step's record (metrics.jsonl, W&B, the progress bar), the summary
of its rewards and ``reward.png``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from examples.run_dir import read_metrics

if TYPE_CHECKING:
    from examples.rl_loop import Algorithm, RLConfig

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def step_log(config: RLConfig, output_dir: Path, algorithm: Algorithm, first_step: int) -> Iterator[Callable]:
    """``log(record)`` for the block's life: each step's record appended to
    ``output_dir/metrics.jsonl`` (flushed), sent to W&B (``config.wandb_project``) and shown on
    the progress bar (``config.progress``) that starts at ``first_step``."""
    metrics_file = (output_dir / "metrics.jsonl").open("a", encoding="utf-8")
    wandb_run = start_wandb(config)
    progress = progress_bar(config, algorithm.name, first_step)

    def log(record: dict) -> None:
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        if wandb_run is not None:
            wandb_run.log(record, step=record["step"])
        if progress is not None:
            progress.update(1)
            progress.set_postfix(postfix(record, algorithm))

    try:
        yield log
    finally:
        metrics_file.close()
        if progress is not None:
            progress.close()
        if wandb_run is not None:
            wandb_run.finish()


def postfix(record: dict, algorithm: Algorithm) -> dict[str, str]:
    fields = (
        ("reward", "reward", "{:.3f}"),
        ("solved", "solved", "{:.2f}"),
        ("ent", "entropy", "{:.2f}"),
        ("kl", "approx_kl", "{:.4f}"),
        ("clip", "clip_fraction", "{:.3f}"),
        *algorithm.progress_fields,
        ("sync", "sync_s", "{:.2f}s"),
        ("gen", "generate_s", "{:.2f}s"),
        ("dlogp", "mismatch_mean", "{:.1e}"),
    )
    return {label: template.format(record[key]) for label, key, template in fields if key in record}


def progress_bar(config: RLConfig, name: str, initial: int):
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=config.steps, initial=initial, desc=name, unit="step")


def start_wandb(config: RLConfig):
    if config.wandb_project is None:
        return None
    try:
        import wandb
    except ImportError:
        logger.warning("wandb_project is set but wandb is not installed: not logging to W&B")
        return None
    return wandb.init(project=config.wandb_project, config=dataclasses.asdict(config))


def summarize(
    config: RLConfig, output_dir: Path, history: list[dict], algorithm: Algorithm, wall_s: float | None = None
) -> dict:
    """The run's figures, printed and plotted: its rewards over the whole run (metrics.jsonl, the
    steps before a resume included), the time of the steps this process ran (``history``) and,
    given, their wall-clock seconds (``wall_s``: the asynchronous loop's, whose phases overlap).
    Printed on stdout: they are the command's result, its logs and progress bar go to stderr."""
    records = read_metrics(output_dir / "metrics.jsonl")
    if not records:
        return {}
    window = max(1, min(5, len(records) // 4))
    first = float(np.mean([r["reward"] for r in records[:window]]))
    last = float(np.mean([r["reward"] for r in records[-window:]]))
    times = {k: float(sum(r[k] for r in history)) for k in ("sync_s", "generate_s", "train_s")}
    summary = {"first_reward": first, "last_reward": last, "steps": len(records), "steps_run": len(history), **times}
    print(
        f"reward {first:.3f} -> {last:.3f} (mean of the first and last {window} of {len(records)} steps); "
        f"this run's {len(history)} steps: sync {times['sync_s']:.1f}s, generate {times['generate_s']:.1f}s, "
        f"train {times['train_s']:.1f}s",
        flush=True,  # in order with the logs where both go to one file (--local-processes)
    )
    evaluations = [r["eval_reward"] for r in records if "eval_reward" in r]
    if evaluations:
        summary.update(first_eval_reward=evaluations[0], last_eval_reward=evaluations[-1])
        print(
            f"eval reward {' -> '.join(f'{x:.3f}' for x in evaluations)} (every {config.eval_every} steps)", flush=True
        )
    if wall_s is not None:
        summary["wall_s"] = wall_s
        print(f"async rollout: {len(history)} steps in {wall_s:.1f} s wall-clock", flush=True)
    if config.plot:
        plot(output_dir / "reward.png", records, algorithm.plot_panels)
    return summary


def plot(path: Path, history: list[dict], extra_panels) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    rewards = (("reward", "mean reward"), ("solved", "solved fraction"), ("eval_reward", "eval reward"))
    panels = [("", rewards, "linear")]
    panels += [(title, lines, "linear") for title, lines in extra_panels]
    if "mismatch_mean" in history[-1]:
        lines = (("mismatch_mean", "mean |Δ log p|"), ("mismatch_max", "max |Δ log p|"), ("mismatch_kl", "KL estimate"))
        panels.append(("train-inference mismatch (engine vs trainer log-probs)", lines, "log"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(6, 0.5 + 2.75 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, lines, scale) in zip(axes[:, 0], panels):
        drawn = {}  # points -> the panel's line through them
        for key, label in lines:
            # A metric of some steps only (the evaluation's) is drawn at those steps.
            points = tuple((r["step"], r[key]) for r in history if key in r)
            if not points:
                continue
            if points in drawn:  # one line under both labels (reward is solved where near misses earn 0)
                drawn[points].set_label(f"{drawn[points].get_label()} = {label}")
                continue
            x, values = zip(*points)
            marker = "o" if len(x) < len(steps) else None
            (drawn[points],) = ax.plot(x, np.abs(values) if scale == "log" else values, label=label, marker=marker)
        ax.set_yscale(scale)
        if title:
            ax.set_title(title, fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def check_plotting(config: RLConfig) -> None:
    """Refuses ``plot`` without matplotlib at start-up: the plot is drawn after the last step."""
    if not config.plot:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ValueError(
            f"plot (reward.png, the default) needs matplotlib ({error}): pass --no-plot, or install "
            "the examples extra (pip install -e '.[examples]')"
        ) from None
