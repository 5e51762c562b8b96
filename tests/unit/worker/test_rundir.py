"""``worker.rundir``: the JSON-lines tail reader shared by the supervisor, the worker and live config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.rundir import read_jsonl_after


def test_tail_reader_takes_complete_lines_after_the_offset(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "events.jsonl"
    assert read_jsonl_after(path, 7) == ([], 7)  # no file yet
    first = json.dumps({"step": 1}) + "\n"
    path.write_text(first + "not json\n" + '{"step": 2}\n' + '{"step": 3, "lo')  # a bad line, a torn one
    rows, offset = read_jsonl_after(path, 0)
    assert rows == [{"step": 1}, {"step": 2}] and "skipped a line that is not JSON" in caplog.text
    assert offset == path.stat().st_size - len('{"step": 3, "lo')
    with path.open("a") as f:
        f.write('ss": 0.5}\n')
    assert read_jsonl_after(path, offset) == ([{"step": 3, "loss": 0.5}], path.stat().st_size)
    assert read_jsonl_after(path, len(first)) == ([{"step": 2}, {"step": 3, "loss": 0.5}], path.stat().st_size)

    path.write_text(first)  # replaced by a shorter file (a pruned resume): read again from the start
    assert read_jsonl_after(path, offset) == ([{"step": 1}], len(first))
