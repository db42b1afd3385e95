"""The output dir of an RL run: what binds a resume to it (``run.json``), its lock, its metrics
file and its checkpoints (orbax, of everything the algorithm trains, and the step)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from examples.rl_update import place_fresh_leaves

if TYPE_CHECKING:
    from examples.rl_loop import RLConfig

logger = logging.getLogger(__name__)


class RunDirError(ValueError):
    """An output dir a run cannot use, or resume from, as it is: the message names the file and
    what to do."""


@dataclasses.dataclass
class TrainState:
    trees: dict[str, Any]
    step: int


# What a resume in the same output dir must share with the run that wrote its checkpoints: the
# initial model (the tiny presets build theirs from the seed), the prompts (drawn from (seed,
# step)), the task and its rewards (the tiny presets' operand range and near-miss credit) and
# what its checkpoints hold (the algorithm's trees: PPO's critic, separate or shared; the
# optimizer's state, whose structure the learning rate's warm-up and decay decide).
RUN_IDENTITY = (
    "algorithm",
    "preset",
    "model",
    "dataset",
    "seed",
    "max_operand",
    "near_credit",
    "lora_rank",
    "lora_alpha",
    "warm_start_steps",
    "warmup_updates",
    "lr_decay",
    "critic",
)
# What a run that did not record a name (or whose algorithm has no such field) had.
_IDENTITY_DEFAULTS = {"lora_rank": 0, "lora_alpha": None, "warm_start_steps": 0, "critic": None}
# Recorded since after the first run.json files were written: not compared where absent.
_RECORDED_LATER = ("algorithm", "critic", "near_credit", "warmup_updates", "lr_decay")
# Settings that do not change what a run learns (where it runs, how long, how it reports): a
# resume changes them unremarked. A resume that changes any other setting (the learning rate,
# the temperature, the group size, ...) is allowed and warned of: the steps after the
# checkpoint then learn under other settings than those before it, in one metrics file.
_NOT_LEARNING = (
    "output_dir",
    "steps",
    "kv_tokens",
    "tp_size",
    "dp_size",
    "checkpoint_every",
    "progress",
    "plot",
    "wandb_project",
    "check_consistency_every",
    "consistency_atol",
    "eval_every",
    "eval_prompts",
    "decode_steps",
    "local_processes",
    "return_logprobs",  # logged beside the trainer's (tis_cap is what trains on them)
    "lora_unmerged",  # how the engine serves the adapters, not what they learn
)


def effective_lora_alpha(rank: int, alpha: float | None) -> float | None:
    """The adapters' alpha: ``alpha``, by default 2 x ``rank``; None without adapters (rank 0)."""
    if not rank:
        return None
    return 2.0 * rank if alpha is None else alpha


def _run_identity(get: Callable[[str, Any], Any]) -> dict:
    """The values of RUN_IDENTITY from ``get(name, default)``; LoRA's alpha as the scale it
    gives (``--lora-alpha 8`` at rank 4 is the default's run)."""
    identity = {name: get(name, _IDENTITY_DEFAULTS.get(name)) for name in RUN_IDENTITY}
    identity["lora_alpha"] = effective_lora_alpha(identity["lora_rank"], identity["lora_alpha"])
    return identity


def _learning_settings(config: RLConfig) -> dict:
    """The config's settings that change what a run learns, other than RUN_IDENTITY's."""
    skipped = set(RUN_IDENTITY) | set(_NOT_LEARNING)
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in skipped}
    return {name: value for name, value in settings.items() if isinstance(value, (bool, int, float, str, type(None)))}


def latest_checkpoint_step(output_dir: Path) -> int | None:
    """The step of the latest finished checkpoint in ``output_dir/checkpoints`` (a dir named by
    its step: orbax writes ``<step>.orbax-checkpoint-tmp...`` and renames it when done), or None."""
    checkpoints = output_dir / "checkpoints"
    if not checkpoints.is_dir():
        return None
    return max((int(p.name) for p in checkpoints.iterdir() if p.name.isdigit() and p.is_dir()), default=None)


def claim_output_dir(config: RLConfig, output_dir: Path) -> int | None:
    """Records in ``output_dir/run.json`` what decides a run's initial model and prompts, and the
    steps it is planned for; once the dir holds a checkpoint, checks a rerun against it: a
    resume with another seed would restore one run's weights and go on with another run's
    prompts, KL reference and metrics file. (A run that failed before its first checkpoint
    binds nothing: its rerun may fix any setting.) Returns the latest checkpoint's step (None:
    none yet)."""
    path = output_dir / "run.json"
    identity = _run_identity(lambda name, default: _local_path_resolved(getattr(config, name, default)))
    planned = config.steps
    settings = _learning_settings(config)
    latest = latest_checkpoint_step(output_dir)
    if latest is not None:
        if not path.exists():
            raise RunDirError(
                f"{output_dir}: this output dir holds checkpoints but no run.json, so whether this "
                f"run is theirs ({', '.join(RUN_IDENTITY)}) cannot be checked: use another output dir"
            )
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise RunDirError(f"{path}: not a run record ({error}): restore it, or use another output dir") from None
        if not isinstance(record, dict):
            raise RunDirError(f"{path}: not a run record (a JSON object): restore it, or use another output dir")
        unrecorded = {name for name in _RECORDED_LATER if name not in record}
        recorded = _run_identity(record.get)
        changed = [name for name in RUN_IDENTITY if recorded[name] != identity[name] and name not in unrecorded]
        if changed:
            raise RunDirError(
                f"{path}: this output dir holds checkpoints of a run with "
                + ", ".join(f"{name}={recorded[name]!r}" for name in changed)
                + "; this one has "
                + ", ".join(f"{name}={identity[name]!r}" for name in changed)
                + ": resume with the same settings, or use another output dir"
            )
        recorded_steps = record.get("steps")
        if not isinstance(recorded_steps, int) or isinstance(recorded_steps, bool):
            recorded_steps = None  # not a plan this file can tell
        if config.steps <= latest:  # nothing trains: the recorded plan and settings stand
            planned = recorded_steps if recorded_steps is not None else config.steps
            settings = record.get("settings", settings)
        elif getattr(config, "lr_decay", False) and recorded_steps is not None and recorded_steps != config.steps:
            # Allowed (a run resumed for longer), but the cosine decay spans the steps.
            logger.warning(
                "%s: resuming a run of %d steps as one of %d: the learning rate's decay spans the "
                "steps, so its schedule changes from the checkpoint on",
                output_dir,
                recorded_steps,
                config.steps,
            )
        if config.steps > latest and isinstance(record.get("settings"), dict):
            before = record["settings"]
            moved = [name for name, value in settings.items() if name in before and before[name] != value]
            if moved:
                logger.warning(
                    "%s: resuming from step %d with settings changed since: %s; the steps after it "
                    "learn under the new ones (metrics.jsonl holds both)",
                    output_dir,
                    latest,
                    ", ".join(f"{name} {before[name]!r} -> {settings[name]!r}" for name in moved),
                )
    if jax.process_index() == 0:  # the steps this run is planned for, as resumed
        staged = path.with_suffix(".tmp")
        staged.write_text(json.dumps({**identity, "steps": planned, "settings": settings}))
        os.replace(staged, path)  # other processes of the job never read half a file
    return latest


@contextlib.contextmanager
def output_dir_lock(output_dir: Path):
    """Holds an exclusive lock on ``output_dir`` (``output_dir/run.lock``) while the block runs:
    a second run on the same dir would interleave its metrics and checkpoints with this one's.
    The lock goes with the process, so a killed run leaves none behind."""
    path = output_dir / "run.lock"
    with path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(
                f"{output_dir}: another run is using this output dir ({path} is locked): "
                "wait for it to end, or use another output dir"
            ) from None
        yield


def read_metrics(path: Path) -> list[dict]:
    """The records of ``path`` (metrics.jsonl), none if it does not exist. A last line that does
    not parse is a record a killed run was writing: left out."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise RunDirError(
                    f"{path}: line {number} is not a JSON record (a record a killed run cut short, with the "
                    "next one written onto it): repair or delete that line, then resume"
                ) from None
    return records


def keep_metrics_through(path: Path, step: int) -> None:
    """Rewrites ``path`` (metrics.jsonl) to the records of steps 1..``step`` (the checkpoint a run
    resumes from; 0: none): the steps after it run again and append their records. Of a step
    logged twice (a dir written before this rewrite existed), the later record is kept: the
    run that went on to the checkpoint wrote it. Atomic: a kill leaves the old file or the new."""
    kept = {r["step"]: r for r in read_metrics(path) if r["step"] <= step}
    missing = sorted(set(range(1, step + 1)) - set(kept))
    if missing:  # lost after their checkpoint was (records are flushed, not synced): not run again
        logger.warning(
            "%s: no record of step(s) %s, which the checkpoint of step %d trained: the run resumes after them, "
            "and its metrics and summary go without them",
            path,
            _ranges(missing),
            step,
        )
    staged = path.with_suffix(".tmp")
    staged.write_text("".join(json.dumps(kept[s]) + "\n" for s in sorted(kept)), encoding="utf-8")
    os.replace(staged, path)


def logged_elapsed_s(path: Path) -> float:
    """The run's wall-clock seconds at the last record of ``path`` (metrics.jsonl, cut back to the
    checkpoint a run resumes from): a resumed run's ``elapsed_s`` counts on from it. 0 without
    one (a fresh run, or a last record without ``elapsed_s``)."""
    records = read_metrics(path)
    return float(records[-1].get("elapsed_s", 0.0)) if records else 0.0


def _ranges(steps: list[int]) -> str:
    """Sorted steps as ranges: ``1-3, 7``."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_writable(directory: Path) -> None:
    """RunDirError unless a file can be made in ``directory``: checkpoints of a run that cannot
    write them fail after their step has trained (orbax's waited 5 minutes, then timed out)."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise RunDirError(f"{directory}: cannot write there ({error.strerror}): use another output dir") from None


def _local_path_resolved(value):
    """A model or dataset given as a local path, made absolute (``./m`` and ``/abs/m`` are one run)."""
    return str(Path(value).resolve()) if isinstance(value, str) and Path(value).exists() else value


def checkpoint_manager(output_dir: Path):
    import orbax.checkpoint as ocp

    checkpoints = output_dir / "checkpoints"
    if checkpoints.is_dir():
        check_writable(checkpoints)
    return ocp.CheckpointManager(
        (output_dir / "checkpoints").resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=2)
    )


def restore_or_init(manager, trees: dict[str, Any]) -> TrainState:
    """The latest checkpoint restored onto the placements of ``trees``, or ``trees`` at step 0."""
    import orbax.checkpoint as ocp

    latest = manager.latest_step()
    # Placed as the train step places them: a fresh step count restored where it was made (one
    # device) would sit apart from params on several.
    trees = place_fresh_leaves(trees)
    if latest is None:
        return TrainState(trees, 0)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=getattr(x, "sharding", None)),
        {**trees, "step": 0},
    )
    try:
        restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
    except Exception as exc:  # orbax's own error names no file (a JSONDecodeError of a damaged one)
        earlier = sorted(step for step in manager.all_steps() if step < latest)
        advice = f"move it away to resume from step {earlier[-1]}" if earlier else "move it away to start over"
        raise RunDirError(
            f"{Path(manager.directory) / str(latest)}: the latest checkpoint cannot be restored "
            f"({type(exc).__name__}: {exc}); {advice}"
        ) from exc
    logger.info("resumed from step %d", latest)
    step = int(restored.pop("step"))
    return TrainState(restored, step)


def save_train_state(manager, state: TrainState) -> None:
    import orbax.checkpoint as ocp

    manager.save(state.step, args=ocp.args.StandardSave({**state.trees, "step": state.step}))
