"""examples/rl_loop.py, run_dir.py and reporting.py: an output dir is bound to one run (and locked
while it runs); its metrics across resumes; config checks; the fixed evaluation; the worker a run
starts."""

import dataclasses
import json
import re
import sys
import types

import jax
import numpy as np
import pytest

from examples import ppo, reporting, rl_loop
from examples.async_rl import run_async, split_devices
from examples.grpo import GRPO, PRESETS, GRPOConfig, parse_args
from examples.ppo import PPOConfig
from examples.reporting import check_plotting, summarize
from examples.rl_loop import EVAL_STREAM, Task, UsageError, _evaluate, cli, set_up, step_seed, worker_config
from examples.run_dir import (
    RunDirError,
    TrainState,
    check_writable,
    checkpoint_manager,
    claim_output_dir,
    keep_metrics_through,
    output_dir_lock,
    read_metrics,
    restore_or_init,
    save_train_state,
)
from rollout.launch import PROCESS_ID_ENV, ProcessResult


def test_a_resume_in_an_output_dir_must_be_the_same_run(tmp_path, chat_dir, monkeypatch):
    """A resume with another seed would restore one run's weights and go on with another run's
    prompts and KL reference: refused before anything starts, naming the file and both values.
    Before a first checkpoint nothing is bound (a rerun may fix a start-up error)."""
    config = dataclasses.replace(PRESETS["tiny"], seed=2)
    claim_output_dir(config, tmp_path)
    claim_output_dir(dataclasses.replace(config, seed=0), tmp_path)  # no checkpoint yet: rebinds
    assert json.loads((tmp_path / "run.json").read_text())["seed"] == 0
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    claim_output_dir(dataclasses.replace(config, seed=0, steps=90), tmp_path)  # the same run, resumed for longer
    with pytest.raises(
        ValueError, match=r"run\.json: this output dir holds checkpoints of a run with seed=0; this one has seed=2"
    ):
        claim_output_dir(config, tmp_path)
    # A local model dir named by another path is the same run.
    other = tmp_path / "other"
    other.mkdir()
    local = dataclasses.replace(PRESETS["qwen2.5-3b"], model=str(chat_dir), seed=2)
    claim_output_dir(local, other)
    (other / "checkpoints" / "1").mkdir(parents=True)
    monkeypatch.chdir(chat_dir.parent)
    claim_output_dir(dataclasses.replace(local, model=chat_dir.name), other)


@pytest.mark.parametrize(
    "name,other",
    [
        ("near_credit", lambda value: 0.25 if value != 0.25 else 0.0),  # the rewards
        # The optimizer state's structure: its restore had failed as if the checkpoint were damaged.
        ("warmup_updates", lambda value: value + 5),
        ("lr_decay", lambda value: not value),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_a_resume_with_other_rewards_or_another_learning_rate_schedule_is_refused(tmp_path, name, other):
    config = PRESETS["tiny"]
    changed = dataclasses.replace(config, **{name: other(getattr(config, name))})
    claim_output_dir(config, tmp_path)
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    value = getattr(changed, name)
    with pytest.raises(RunDirError, match=rf"holds checkpoints of a run with {name}=.*; this one has {name}={value!r}"):
        claim_output_dir(changed, tmp_path)
    # A run.json written before these were recorded binds only what it holds.
    recorded = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "run.json").write_text(json.dumps({k: v for k, v in recorded.items() if k != name}))
    claim_output_dir(changed, tmp_path)


def test_an_output_dir_that_cannot_be_written_is_refused_naming_it(tmp_path):
    """A read-only checkpoints dir let the steps train, then orbax waited 5 minutes for its save
    (as root, a read-only mode stops no write: a file stands in for the dir here). The command
    ends with the message, not a traceback."""
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(RunDirError, match=rf"{afile}: cannot write there"):
        check_writable(afile)
    check_writable(tmp_path)
    config = dataclasses.replace(PRESETS["tiny"], output_dir=str(afile), plot=False)
    with pytest.raises(RunDirError, match=rf"{afile}: the output dir is a file"):
        with rl_loop.set_up(config, GRPO):
            pass

    def refused(_):
        raise RunDirError(f"{afile}: the output dir is a file: use another output dir")

    with pytest.raises(SystemExit, match=rf"^grpo: {afile}: the output dir is a file"):
        cli("grpo", refused, config)


def test_an_interrupted_command_says_how_to_resume_and_exits_130(tmp_path, capsys):
    config = dataclasses.replace(PRESETS["tiny"], output_dir=str(tmp_path / "run"), plot=False)

    def interrupted(_):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exited:
        cli("grpo", interrupted, config)
    assert exited.value.code == 130
    assert "grpo: interrupted before its first checkpoint: the same command starts over" in capsys.readouterr().err
    (tmp_path / "run" / "checkpoints" / "20").mkdir(parents=True)
    with pytest.raises(SystemExit) as exited:
        cli("grpo", interrupted, config)
    assert exited.value.code == 130
    err = capsys.readouterr().err
    assert f"grpo: interrupted; the same command resumes from step 20, the latest checkpoint in {tmp_path}/run" in err
    assert "Traceback" not in err


def test_a_resume_for_more_steps_warns_that_the_decay_changes(tmp_path, caplog):
    """A run resumed for longer is the same run, but a cosine decay spans the planned steps:
    the learning rate jumps at the checkpoint. The new plan is recorded: warned once."""
    config = dataclasses.replace(PRESETS["tiny"], lr_decay=True, steps=80)
    claim_output_dir(config, tmp_path)
    (tmp_path / "checkpoints" / "80").mkdir(parents=True)

    def warned():  # the examples' own: garbage of other code may log while this runs
        return [r.getMessage() for r in caplog.records if r.name.startswith("examples")]

    with caplog.at_level("WARNING"):
        claim_output_dir(config, tmp_path)
        assert not warned()
        claim_output_dir(dataclasses.replace(config, steps=160), tmp_path)
        assert any("resuming a run of 80 steps as one of 160" in m for m in warned())
        caplog.clear()
        claim_output_dir(dataclasses.replace(config, steps=160), tmp_path)
        assert not warned()


def test_a_resume_with_other_learning_settings_names_them(tmp_path, caplog):
    """The learning rate or temperature of a resume may differ (unlike its seed), but the steps
    after the checkpoint then learn under other settings in the same metrics file: warned,
    naming each, and recorded, so the next resume compares with them."""
    config = dataclasses.replace(PRESETS["tiny"], steps=40)
    claim_output_dir(config, tmp_path)
    (tmp_path / "checkpoints" / "20").mkdir(parents=True)

    def warned():
        return [r.getMessage() for r in caplog.records if r.name.startswith("examples")]

    with caplog.at_level("WARNING"):
        claim_output_dir(dataclasses.replace(config, progress=False, decode_steps=4, checkpoint_every=5), tmp_path)
        assert not warned()
        changed = dataclasses.replace(config, learning_rate=1e-2, temperature=0.5)
        claim_output_dir(changed, tmp_path)
        (message,) = warned()
        assert "resuming from step 20 with settings changed since: temperature 1.0 -> 0.5, learning_rate" in message
        assert "0.0006 -> 0.01" in message
        caplog.clear()
        claim_output_dir(changed, tmp_path)
        assert not warned()


def test_a_rerun_with_no_steps_left_keeps_the_runs_plan(tmp_path, caplog):
    """--steps at or below the checkpoint trains nothing: it had recorded its smaller plan, and
    the next resume warned of a schedule change that never happened. A plan that is no number
    is not one (it had printed a logging error)."""
    config = dataclasses.replace(PRESETS["tiny"], lr_decay=True, steps=4)
    claim_output_dir(config, tmp_path)
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)

    def warned():
        return [r.getMessage() for r in caplog.records if r.name.startswith("examples")]

    with caplog.at_level("WARNING"):
        claim_output_dir(dataclasses.replace(config, steps=2), tmp_path)
        assert json.loads((tmp_path / "run.json").read_text())["steps"] == 4
        claim_output_dir(config, tmp_path)
        assert not warned()
        record = json.loads((tmp_path / "run.json").read_text())
        (tmp_path / "run.json").write_text(json.dumps({**record, "steps": "four"}))
        claim_output_dir(dataclasses.replace(config, steps=6), tmp_path)
        assert not warned()
    assert json.loads((tmp_path / "run.json").read_text())["steps"] == 6


def test_decode_steps_reach_the_worker_and_are_not_part_of_a_runs_identity(tmp_path):
    """--decode-steps is how the engines run, not what they sample: a resume may change it."""
    config = dataclasses.replace(PRESETS["tiny"], decode_steps=8)
    assert worker_config(config, tmp_path).decode_steps == 8
    assert worker_config(PRESETS["tiny"], tmp_path).decode_steps == 1
    claim_output_dir(config, tmp_path)
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    claim_output_dir(dataclasses.replace(config, decode_steps=1), tmp_path)
    with pytest.raises(ValueError, match="decode_steps must be >= 1, got 0"):
        dataclasses.replace(config, decode_steps=0)


def test_a_runs_engines_take_every_device_unless_told(tmp_path):
    """``python -m examples.grpo`` on a host of 4 devices (this suite's) starts 4 engines; it
    started one and the worker refused the other 3 devices. ``--dp-size N`` takes the first
    N x tp_size devices: the worker was given all 4 and refused them."""
    devices = jax.local_devices()
    assert len(devices) == 4

    def groups(**settings):
        return worker_config(dataclasses.replace(PRESETS["tiny"], **settings), tmp_path).device_groups()

    assert groups() == [(d,) for d in devices]
    assert groups(tp_size=2) == [tuple(devices[:2]), tuple(devices[2:])]
    assert groups(dp_size=1) == [(devices[0],)]
    assert groups(dp_size=1, tp_size=2) == [tuple(devices[:2])]
    assert groups(tp_size=3) == [tuple(devices[:3])]
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        dataclasses.replace(PRESETS["tiny"], dp_size=0)


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(dp_size=3, tp_size=2), "--dp-size 3 x --tp-size 2 needs 6 devices, but this process has 4"),
        (dict(tp_size=8), "--tp-size 8 needs 8 devices, but this process has 4"),
        (
            dict(async_rollout=True, tis_cap=2.0, tp_size=3),
            "--async-rollout puts the trainer and the engines on separate halves of the local devices: 4 "
            "device(s) cannot give the engines a multiple of --tp-size 3 "
            "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=4)",
        ),
    ],
)
def test_more_devices_than_the_process_has_is_a_usage_error_naming_the_flags(tmp_path, capsys, settings, message):
    """It was the worker's traceback, saying ``set devices=`` (no flag), in every process."""
    config = dataclasses.replace(PRESETS["tiny"], plot=False, **settings)

    def start(config):  # what set_up asks of the devices, once the job is joined
        _, engine_devices = split_devices(config.tp_size) if config.async_rollout else (None, None)
        return worker_config(config, tmp_path, engine_devices)

    with pytest.raises(SystemExit) as exited:
        cli("grpo", start, config)
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"grpo: error: {message}\n"


def test_lr_decay_spans_the_train_steps_after_the_warm_up():
    config = dataclasses.replace(
        PRESETS["tiny"], steps=10, ppo_epochs=2, minibatches=4, warmup_updates=20, lr_decay=False
    )
    assert config.decay_updates == 0
    assert dataclasses.replace(config, lr_decay=True).decay_updates == 10 * 2 * 4 - 20
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        dataclasses.replace(config, scale_rewards="std")


def test_the_warm_start_is_part_of_a_runs_identity(tmp_path):
    """The warm-started policy is the KL reference and the start of the run: a resume with
    another warm start would train against another reference."""
    config = PRESETS["tiny-tools"]
    claim_output_dir(config, tmp_path)
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)
    claim_output_dir(dataclasses.replace(config, steps=90), tmp_path)
    with pytest.raises(ValueError, match=r"warm_start_steps=100; this one has warm_start_steps=5"):
        claim_output_dir(dataclasses.replace(config, warm_start_steps=5), tmp_path)


def test_the_evaluation_rolls_out_the_same_problems_with_the_same_seeds_every_time():
    """--eval-every: one fixed set of problems and one call seed, whatever the step, the seed no
    training step's; the eval figures are their rewards."""
    config = dataclasses.replace(PRESETS["tiny"], eval_every=5, eval_prompts=4, return_logprobs=True)
    task = Task(config, tokenizer=None)
    calls = []

    class AnswersEveryOther:
        def generate(self, prompts, *, n, seed, return_logprobs, return_routing, **_):
            assert not return_logprobs and not return_routing  # what only the update reads
            calls.append((prompts, seed))
            answers = [p.answer for p in task.sample(config.eval_prompts, EVAL_STREAM)]
            index = np.repeat(np.arange(len(prompts)), n)
            texts = [answers[i] if row % 2 == 0 else "x" for row, i in enumerate(index)]
            return types.SimpleNamespace(completion_texts=texts, prompt_index=index)

    first, again = (_evaluate(config, AnswersEveryOther(), task) for _ in range(2))
    for figures in (first, again):
        assert figures["eval_s"] >= 0
        assert {k: v for k, v in figures.items() if k != "eval_s"} == {"eval_reward": 0.5, "eval_solved": 0.5}
    assert calls[0] == calls[1] and len(calls[0][0]) == 4
    assert calls[0][1] not in {step_seed(config.seed, step) for step in range(config.steps)}
    with pytest.raises(ValueError, match="eval_every must be >= 0"):
        dataclasses.replace(config, eval_every=-1)


def test_a_half_written_checkpoint_binds_nothing(tmp_path):
    """A kill during the first checkpoint's write leaves only orbax's temporary dir: no
    checkpoint, so a rerun may fix any setting."""
    config = dataclasses.replace(PRESETS["tiny"], seed=2)
    claim_output_dir(config, tmp_path)
    (tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp").mkdir(parents=True)
    claim_output_dir(dataclasses.replace(config, seed=0), tmp_path)
    assert json.loads((tmp_path / "run.json").read_text())["seed"] == 0
    (tmp_path / "checkpoints" / "4").mkdir()
    with pytest.raises(ValueError, match="seed=0; this one has seed=2"):
        claim_output_dir(config, tmp_path)


def test_a_damaged_latest_checkpoint_is_named_with_the_step_to_resume_from(tmp_path):
    """It failed with orbax's JSONDecodeError, naming no file."""
    trees = {"params": {"w": jax.numpy.arange(4.0)}}
    manager = checkpoint_manager(tmp_path)
    for step in (1, 2):
        save_train_state(manager, TrainState(trees, step))
    manager.wait_until_finished()
    for file in (tmp_path / "checkpoints" / "2").rglob("*"):
        if file.is_file() and file.suffix in ("", ".json") and file.stat().st_size:
            file.write_text("{not json")  # every metadata file, whichever orbax reads first
    with pytest.raises(
        ValueError, match=r"checkpoints/2: the latest checkpoint cannot be restored .*resume from step 1"
    ):
        restore_or_init(checkpoint_manager(tmp_path), trees)


def test_a_damaged_or_missing_run_record_is_refused_naming_the_file(tmp_path):
    """Next to checkpoints, run.json is what says whose they are: without it (or unreadable)
    the run's identity cannot be checked, so any seed would resume."""
    config = PRESETS["tiny"]
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    with pytest.raises(ValueError, match=rf"{tmp_path}: this output dir holds checkpoints but no run\.json"):
        claim_output_dir(config, tmp_path)
    (tmp_path / "run.json").write_text("")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'run.json'}: not a run record"):
        claim_output_dir(config, tmp_path)
    (tmp_path / "run.json").write_text("[]")
    with pytest.raises(ValueError, match=r"run\.json: not a run record \(a JSON object\)"):
        claim_output_dir(config, tmp_path)


def test_a_resume_compares_the_lora_alpha_a_run_trains_with(tmp_path):
    """--lora-alpha 8 at rank 4 is the default's scale (2 x rank): the same run, also against a
    run.json that recorded the default as null."""
    config = GRPOConfig(lora_rank=4)
    claim_output_dir(config, tmp_path)
    assert json.loads((tmp_path / "run.json").read_text())["lora_alpha"] == 8.0
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    claim_output_dir(dataclasses.replace(config, lora_alpha=8.0), tmp_path)
    record = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "run.json").write_text(json.dumps({**record, "lora_alpha": None}))
    claim_output_dir(dataclasses.replace(config, lora_alpha=8.0), tmp_path)
    with pytest.raises(ValueError, match=r"lora_alpha=8\.0; this one has lora_alpha=4\.0"):
        claim_output_dir(dataclasses.replace(config, lora_alpha=4.0), tmp_path)


def test_an_output_dir_takes_one_run_at_a_time(tmp_path, monkeypatch):
    """A second run on a dir in use fails at once, naming the dir, before it writes anything
    (here the set-up would otherwise go on to start an engine, which this layer refuses)."""
    config = dataclasses.replace(PRESETS["tiny"], output_dir=str(tmp_path))
    with output_dir_lock(tmp_path):
        with pytest.raises(RunDirError, match=rf"{tmp_path}: another run is using this output dir"):
            with output_dir_lock(tmp_path):
                pass
        with pytest.raises(RunDirError, match="another run is using this output dir"):
            with set_up(config, GRPO):
                pass
        assert not (tmp_path / "run.json").exists()
        # Refused before joining a job: a process that joined would wait at its exit for its peers.
        monkeypatch.setenv(PROCESS_ID_ENV, "0")
        monkeypatch.setattr(rl_loop, "join", lambda: joined.append(True))
        joined = []
        with pytest.raises(RunDirError, match="another run is using this output dir"):
            with set_up(config, GRPO):
                pass
        assert not joined
    with output_dir_lock(tmp_path):  # released with its run
        pass


def record(step, reward=0.0):
    return {"step": step, "reward": reward, "sync_s": 1.0, "generate_s": 2.0, "train_s": 3.0}


def write_records(path, steps, tail=""):
    path.write_text("".join(json.dumps(record(s, reward=s / 10)) + "\n" for s in steps) + tail)


def test_a_resume_keeps_the_metrics_of_the_steps_its_checkpoint_holds(tmp_path):
    """Killed after step 3's record (and half-way through step 4's) with a checkpoint at step 2:
    the resume runs steps 3 and 4 again, so the file keeps steps 1-2 only, and what it then
    appends reads back as one record a line."""
    path = tmp_path / "metrics.jsonl"
    write_records(path, [1, 2, 3], tail='{"step": 4, "rew')
    # What appending after such a line gave: a line that is no record, in the middle of the file.
    glued = tmp_path / "glued.jsonl"
    write_records(
        glued, [1, 2, 3], tail='{"step": 4, "rew' + json.dumps(record(3)) + "\n" + json.dumps(record(4)) + "\n"
    )
    with pytest.raises(ValueError, match=rf"{glued}: line 4 is not a JSON record"):
        read_metrics(glued)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    keep_metrics_through(path, 2)
    with path.open("a") as file:
        file.write(json.dumps(record(3)) + "\n")
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["glued.jsonl", "metrics.jsonl"]
    # No checkpoint (killed during the first one's write): nothing is kept.
    keep_metrics_through(path, 0)
    assert path.read_text() == ""
    # A dir logged before the cut existed: a step logged twice keeps the later record, the
    # resumed run's.
    path.write_text("".join(json.dumps(record(s, reward=r)) + "\n" for s, r in [(1, 0), (2, 0), (1, 1), (2, 1)]))
    keep_metrics_through(path, 5)
    assert [(r["step"], r["reward"]) for r in read_metrics(path)] == [(1, 1), (2, 1)]
    keep_metrics_through(tmp_path / "none.jsonl", 3)  # no metrics yet: an empty file
    assert (tmp_path / "none.jsonl").read_text() == ""


def test_steps_a_checkpoint_trained_without_a_record_are_named(tmp_path, caplog):
    """Records are flushed, not synced: a crash can lose lines behind a checkpoint. The resume
    runs after them, so they never come back; it had gone on without a word."""
    path = tmp_path / "metrics.jsonl"
    write_records(path, [1, 2, 5])
    with caplog.at_level("WARNING", logger="examples"):
        keep_metrics_through(path, 6)
    (warning,) = [r.getMessage() for r in caplog.records if r.name.startswith("examples")]
    assert f"{path}: no record of step(s) 3-4, 6, which the checkpoint of step 6 trained" in warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="examples"):
        keep_metrics_through(path, 2)
    assert not [r for r in caplog.records if r.name.startswith("examples")]


def test_a_resumed_run_counts_its_elapsed_time_on(tmp_path, monkeypatch):
    """elapsed_s is the run's wall clock: a resume from step 2 counts on from step 2's record
    (the time of step 3, which the killed run logged and the resume runs again, not counted);
    it had restarted from 0, and a plot of reward against wall time jumped back."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({**record(s), "elapsed_s": 10.0 * s}) + "\n" for s in (1, 2, 3)))
    keep_metrics_through(path, 2)  # as set_up cuts it for the checkpoint of step 2
    monkeypatch.setattr(rl_loop, "_step", lambda config, worker, algorithm, state, task: record(state.step + 1))
    monkeypatch.setattr(rl_loop, "save_train_state", lambda manager, state: None)
    # This process's clock: the loop starts at 100 s, steps 3 and 4 end at 104 s and 109 s.
    monkeypatch.setattr(rl_loop, "time", types.SimpleNamespace(perf_counter=iter([100.0, 104.0, 109.0]).__next__))
    config = dataclasses.replace(PRESETS["tiny"], steps=4, output_dir=str(tmp_path), progress=False, plot=False)
    manager = types.SimpleNamespace(wait_until_finished=lambda: None)
    rl_loop._train(config, rl_loop.Setup(tmp_path, None, GRPO, manager, TrainState({}, 2), None, None))
    assert [(r["step"], r["elapsed_s"]) for r in read_metrics(path)] == [(1, 10.0), (2, 20.0), (3, 24.0), (4, 29.0)]


def test_the_summary_and_the_plot_cover_the_whole_run(tmp_path, monkeypatch, capsys):
    """After a resume, the closing "reward a -> b" and reward.png are the run's (all of
    metrics.jsonl), not only the steps this process ran; the times are this process's. The
    summary is the command's result: on stdout (it was logged to stderr, with the progress bar
    and warnings, and a user piping stdout got nothing)."""
    write_records(tmp_path / "metrics.jsonl", range(1, 9))
    plotted = []
    monkeypatch.setattr(reporting, "plot", lambda path, records, panels: plotted.append(records))
    config = dataclasses.replace(PRESETS["tiny"], plot=True)
    resumed = [record(7, 0.7), record(8, 0.8)]
    summary = summarize(config, tmp_path, resumed, GRPO)
    assert summary["first_reward"] == pytest.approx(0.15) and summary["last_reward"] == pytest.approx(0.75)
    assert summary["steps"] == 8 and summary["steps_run"] == 2 and summary["train_s"] == 6.0
    assert [[r["step"] for r in records] for records in plotted] == [list(range(1, 9))]
    summary = summarize(dataclasses.replace(config, plot=False), tmp_path, resumed, GRPO, wall_s=7.5)
    assert summary["wall_s"] == 7.5
    assert capsys.readouterr() == (
        "reward 0.150 -> 0.750 (mean of the first and last 2 of 8 steps); this run's 2 steps: sync 2.0s, "
        "generate 4.0s, train 6.0s\n" * 2 + "async rollout: 2 steps in 7.5 s wall-clock\n",
        "",
    )


def test_a_metric_equal_to_another_is_one_line_under_both_labels(tmp_path, monkeypatch):
    """With near_credit 0 the reward is the solved fraction: two lines drawn one over the other
    looked like one line missing. (matplotlib is the examples' extra: the oldest end has it.)"""
    Figure = pytest.importorskip("matplotlib.figure").Figure

    labels = []
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, path: labels.append([line.get_label() for line in fig.axes[0].lines])
    )
    same = [{**record(step, step / 10), "solved": step / 10} for step in range(1, 5)]
    reporting.plot(tmp_path / "reward.png", same, [])
    differ = [{**record(step, step / 10), "solved": step / 20} for step in range(1, 5)]
    reporting.plot(tmp_path / "reward.png", differ, [])
    assert labels == [["mean reward = solved fraction"], ["mean reward", "solved fraction"]]


def test_a_missing_matplotlib_is_refused_at_start_up(monkeypatch):
    """--plot (the default) draws reward.png after the last step: without matplotlib the
    command stops before its first step, saying what to do."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    started = []
    with pytest.raises(ValueError, match=r"needs matplotlib .*--no-plot, or install the examples extra"):
        cli("grpo", started.append, PRESETS["tiny"])
    assert not started
    check_plotting(dataclasses.replace(PRESETS["tiny"], plot=False))


@pytest.mark.parametrize(
    "make",
    [
        lambda: GRPOConfig(learning_rate=float("nan")),
        lambda: GRPOConfig(kl_beta=float("nan")),
        lambda: GRPOConfig(lora_rank=8, lora_alpha=float("inf")),
        lambda: GRPOConfig(target_kl=float("nan")),
        lambda: GRPOConfig(tis_cap=float("inf")),
        lambda: PPOConfig(critic_learning_rate=float("nan")),
        lambda: PPOConfig(value_clip=float("inf")),
    ],
)
def test_float_settings_must_be_finite(make):
    """NaN passes every range check (all its comparisons are false): --learning-rate nan would
    log NaN metrics and save NaN checkpoints, --kl-beta nan switch the KL off."""
    with pytest.raises(ValueError, match=r"\w+ must be a finite number, got (nan|inf|-inf)"):
        make()


def refused(flags, capsys) -> str:
    """The command line's error: a usage error (exit 2) whose last line says what is wrong."""
    with pytest.raises(SystemExit) as exited:
        parse_args(flags)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m examples.grpo ") and "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_a_setting_the_config_refuses_is_a_usage_error_not_a_traceback(capsys):
    """Named by its flag, as the user typed it; the config's own message names the field."""
    assert re.search(
        r"error: --learning-rate must be a finite number, got nan$", refused(["--learning-rate", "nan"], capsys)
    )


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--model", "/my/model"], "preset 'tiny' builds its own model and task: --model is for"),
        (["--preset", "tiny-moe", "--model", "m", "--dataset", "d.jsonl"], "--model and --dataset are for the qwen"),
        (["--preset", "tiny-moe", "--max-turns", "3"], "--max-turns > 1 .* needs a model with a chat template"),
        (["--max-turns", "2"], "preset 'tiny' has none"),
        # Both failed with a traceback once the engine started.
        (["--preset", "tiny-moe", "--routing-replay", "--decode-steps", "2"], "--routing-replay needs --decode-steps"),
        (["--routing-replay"], "preset 'tiny'.s model has no experts"),
        # Both failed with a traceback after the run dir was made.
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--dtype", "foo"], "--dtype must be one of .*, got 'foo'"),
        (["--output-dir", ""], "--output-dir must not be empty"),
        (["--temperature", "-1"], "--temperature must be > 0, got -1.0"),
        (["--learning-rate", "0"], "--learning-rate must be > 0, got 0.0"),
    ],
)
def test_flags_a_tiny_preset_cannot_use_are_refused_before_anything_starts(flags, words, capsys):
    """--model and --dataset were ignored (the tiny model trained, run.json recorded the other);
    --max-turns failed at the first episode, after the engine started."""
    assert re.search(words, refused(flags, capsys))
    parse_args(["--preset", "tiny-tools", "--max-turns", "2"])
    parse_args(["--preset", "tiny-moe", "--routing-replay"])


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--tis-cap", "2"], "--tis-cap runs in one process only, not with --local-processes 2$"),
        (
            ["--return-logprobs", "--check-consistency-every", "1"],
            "--return-logprobs and --check-consistency-every run in one process only",
        ),
        (["--prompts-per-step", "7"], "--prompts-per-step 7 does not split over --local-processes 2"),
        (["--async-rollout", "--tis-cap", "2"], "--async-rollout runs in one process"),
    ],
)
def test_settings_one_process_runs_are_refused_before_the_processes_start(flags, words, capsys):
    """They were a traceback in every process, after the job joined, naming config fields."""
    assert re.search(words, refused([*flags, "--local-processes", "2"], capsys))
    parse_args([*flags, "--local-processes", "1"])


def test_ppos_engine_old_logprobs_are_refused_over_processes_naming_the_flag(capsys):
    """They are what asks for the engine's log-probs; the message named return_logprobs and tis_cap."""
    with pytest.raises(SystemExit) as exited:
        ppo.parse_args(["--old-logprobs", "engine", "--local-processes", "2"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("error: --old-logprobs engine runs in one process only, not with --local-processes 2")
    ppo.parse_args(["--old-logprobs", "engine"])


@pytest.mark.parametrize(
    "flags,words",
    [
        ([], "--async-rollout trains on tokens of older weights: set --tis-cap$"),
        (["--tis-cap", "2", "--eval-every", "5"], "--eval-every runs in the synchronous loop, not with --async"),
    ],
)
def test_async_settings_are_refused_before_anything_starts(flags, words, capsys):
    """They were a traceback from the loop."""
    assert re.search(words, refused(["--async-rollout", *flags], capsys))


USAGE_ERROR = "grpo: error: --tp-size 2 needs 2 devices, but this process has 1\n"


@pytest.mark.parametrize(
    "ends,status",
    [([(None, ""), (2, USAGE_ERROR)], 2), ([(2, USAGE_ERROR), (1, "Traceback ...\n")], 1)],
    ids=["usage-error", "another-failure-first"],
)
def test_a_usage_error_in_the_local_processes_is_the_commands(monkeypatch, capsys, ends, status):
    """Each process says it in one line (exit status 2), and so does the launching command;
    process 0, stopped by the launcher once process 1 failed, says nothing."""
    monkeypatch.delenv(PROCESS_ID_ENV, raising=False)
    # Process 1 ended first: the command's status is its (rollout.launch.exit_status).
    results = [
        ProcessResult(i, code, log, "" if code else "process 1 failed first", seconds=2.0 - i)
        for i, (code, log) in enumerate(ends)
    ]
    monkeypatch.setattr(rl_loop, "launch_local", lambda argv, processes: results)
    with pytest.raises(SystemExit) as exited:
        cli("grpo", None, dataclasses.replace(PRESETS["tiny"], plot=False, local_processes=2))
    assert exited.value.code == status
    assert USAGE_ERROR in capsys.readouterr().out


@pytest.mark.parametrize(
    "preset,setting,name", [("tiny", {"tis_cap": 2.0}, "tis_cap"), ("tiny-tools", {}, "max_turns")]
)
def test_a_pods_processes_are_checked_once_joined(tmp_path, monkeypatch, preset, setting, name):
    """A pod's processes come from JAX_NUM_PROCESSES, not --local-processes: set_up refuses
    what they cannot run, before any engine starts, as a usage error."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    config = dataclasses.replace(PRESETS[preset], output_dir=str(tmp_path), **setting)
    with pytest.raises(UsageError, match=f"^{name} runs in one process only, not with JAX_NUM_PROCESSES 2$"):
        with set_up(config, GRPO):
            pass


def test_the_help_gives_each_flag_its_value_under_each_preset(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help = " ".join(capsys.readouterr().out.split())
    tiny, llama, big = PRESETS["tiny"], PRESETS["tiny-llama"], PRESETS["qwen2.5-3b"]
    assert f"--steps STEPS default: {tiny.steps} (tiny-llama: {llama.steps}," in help
    assert f"qwen2.5-3b: {big.steps}," in help
    assert f"--temperature TEMPERATURE default: {tiny.temperature} --" in help  # the same in every preset


def test_routing_replay_on_a_local_dense_model_is_refused(qwen2_dir, capsys):
    flags = ["--preset", "qwen2.5-3b", "--model", str(qwen2_dir), "--dataset", "d.jsonl", "--routing-replay"]
    words = r"--routing-replay: .*config.json is a qwen2 model, which routes no tokens"
    assert re.search(words, refused(flags, capsys))


def test_checkpoint_every_must_be_at_least_one():
    """0 would divide by zero after the first step (the last step is always checkpointed)."""
    with pytest.raises(ValueError, match="checkpoint_every must be >= 1, got 0"):
        dataclasses.replace(PRESETS["tiny"], checkpoint_every=0)


def test_a_resume_must_be_of_the_same_algorithm_and_critic(tmp_path):
    """PPO restoring GRPO's checkpoints (or a shared critic a separate one's) would fail deep in
    orbax with a tree-structure dump; it is refused up front, naming both. A run.json written
    before these were recorded binds neither."""
    grpo, ppo = PRESETS["tiny"], dataclasses.replace(PPOConfig(), seed=PRESETS["tiny"].seed)
    claim_output_dir(grpo, tmp_path)
    assert json.loads((tmp_path / "run.json").read_text())["algorithm"] == "grpo"
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"a run with algorithm='grpo'.*; this one has algorithm='ppo'"):
        claim_output_dir(ppo, tmp_path)
    other = tmp_path / "ppo"
    other.mkdir()
    claim_output_dir(ppo, other)
    (other / "checkpoints" / "2").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"critic='separate'; this one has critic='shared'"):
        claim_output_dir(dataclasses.replace(ppo, critic="shared"), other)
    record = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({k: v for k, v in record.items() if k not in ("algorithm", "critic")}))
    claim_output_dir(dataclasses.replace(ppo, critic="shared"), other)


@pytest.mark.parametrize("loop", [rl_loop.run, run_async], ids=["sync", "async"])
def test_a_run_already_trained_says_so_and_starts_nothing(tmp_path, caplog, monkeypatch, loop):
    """A rerun whose --steps is at or below the latest checkpoint had started the engines (minutes
    for a real model) and restored the checkpoint before saying there was nothing to train (the
    unit layer refuses to boot an engine). It returns the recorded run's summary, the metrics
    cut back to the checkpoint as a resume cuts them, and draws the plot of those."""
    config = dataclasses.replace(PRESETS["tiny"], steps=4, output_dir=str(tmp_path), tis_cap=2.0, eval_every=0)
    claim_output_dir(config, tmp_path)
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    write_records(tmp_path / "metrics.jsonl", range(1, 6))  # step 5 logged, its checkpoint never written
    plotted = []
    monkeypatch.setattr(reporting, "plot", lambda path, records, panels: plotted.append((records, panels)))
    with caplog.at_level("WARNING", logger="examples"):
        summary = loop(dataclasses.replace(config, steps=3), GRPO)
    (warning,) = [r.getMessage() for r in caplog.records if r.name.startswith("examples")]
    assert "the checkpoint is at step 4 and --steps is 3: nothing to train" in warning
    assert summary["steps"] == 4 and summary["steps_run"] == 0 and summary["last_reward"] == pytest.approx(0.4)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [([r["step"] for r in records], panels) for records, panels in plotted] == [([1, 2, 3, 4], GRPO.plot_panels)]
    assert json.loads((tmp_path / "run.json").read_text())["steps"] == 4  # the recorded plan stands
