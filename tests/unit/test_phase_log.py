import errno
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


def test_a_record_cut_short_is_taken_back_and_the_next_starts_a_line_of_its_own(tmp_path, monkeypatch):
    """A full disk can take part of a write: that part continued by the next record was one
    line that no JSON reader could parse, losing both records."""
    path = tmp_path / "phases.jsonl"
    log = PhaseLog(str(path), lambda: MemoryReport(1, 2, {"cpu:0": 3}, ()))
    log.record("engine_ready", 1.0)

    class HalfWritten:
        """The file, whose first write takes half the bytes and whose next fails: a disk filling."""

        def __init__(self, file):
            self.file, self.writes = file, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def seek(self, *args):
            return self.file.seek(*args)

        def truncate(self, size):
            return self.file.truncate(size)

        def write(self, data):
            self.writes += 1
            if self.writes > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(data[: len(data) // 2])

    real_open = open
    monkeypatch.setattr("rollout.phase_log.open", lambda *a, **k: HalfWritten(real_open(*a, **k)), raising=False)
    log.record("weights_synced", 0.5, version=1)
    monkeypatch.undo()
    log.record("generate", 0.25, rows=4)
    assert [json.loads(line)["phase"] for line in path.read_text().splitlines()] == ["engine_ready", "generate"]
