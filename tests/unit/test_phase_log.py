import json
import logging
import shutil

from rollout.kv import MemoryReport
from rollout.phase_log import PhaseLog


def test_a_record_that_cannot_be_written_is_logged_once_not_raised_and_writing_resumes(tmp_path, caplog):
    """The record follows its phase's change (a sync's weights already serve): raising would tell
    the caller the change failed."""
    directory = tmp_path / "logs"
    directory.mkdir()
    path = directory / "phases.jsonl"
    log = PhaseLog(str(path), lambda: MemoryReport(1, 2, {"cpu:0": 3}, ()))
    caplog.set_level(logging.WARNING, logger="rollout.phase_log")
    log.record("engine_ready", 1.0)
    shutil.rmtree(directory)  # rotated away, a full disk, a lost mount
    log.record("weights_synced", 0.5, version=1)
    log.record("generate", 0.25, rows=4)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "'weights_synced'" in errors[0].getMessage() and str(path) in errors[0].getMessage()
    directory.mkdir()
    log.record("kv_dropped", 0.1, bytes=8)
    assert "writing again" in caplog.records[-1].getMessage()
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert record["phase"] == "kv_dropped" and record["bytes"] == 8 and record["kv_bytes"] == 2
