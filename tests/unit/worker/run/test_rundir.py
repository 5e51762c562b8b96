"""``worker.run.rundir``: the JSON-lines tail reader shared by the supervisor, the worker and live config; writes on a
full disk (a real tmpfs): ``DiskFull``, no half-written file, the ``disk_full`` event, the free-space check of a
launch."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from tests.support.tmpfs import fill, mounted
from worker.run.rundir import (
    DiskFull,
    RunDir,
    SupervisorHome,
    append_jsonl,
    append_jsonl_rows,
    atomic_write_text,
    describe_os_error,
    human_bytes,
    is_disk_full,
    launch_space,
    read_jsonl,
    read_jsonl_after,
    read_offset,
    run_process,
    space_refusal,
)


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


# ----------------------------------------------------------------------------- a full disk (a real tmpfs)


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 4 * 2**20, 3 * 2**30, 5 * 2**40)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "4.0 MiB",
        "3.0 GiB",
        "5.0 TiB",
    ]


def test_atomic_write_on_a_full_disk_raises_disk_full_and_keeps_the_old_file(disk: Path) -> None:
    path = disk / "config.json"
    atomic_write_text(path, "old")
    filler = fill(disk)
    with pytest.raises(DiskFull) as info:
        atomic_write_text(path, "x" * 10_000)
    assert str(info.value) == f"disk full while writing config.json at {path} (free 0 B of 4.0 MiB)"
    assert (info.value.errno, info.value.what, info.value.path, info.value.free) == (
        errno.ENOSPC,
        "config.json",
        path,
        0,
    )
    assert path.read_text() == "old"
    assert sorted(p.name for p in disk.iterdir()) == [".filler", "config.json"]  # no temporary file left
    filler.unlink()
    atomic_write_text(path, "x" * 10_000)
    assert path.read_text() == "x" * 10_000


def test_append_jsonl_cut_short_by_a_full_disk_leaves_no_torn_line(
    disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = disk / "events.jsonl"
    append_jsonl(path, {"event": "starting", "pad": "p" * (4096 - 10 - len('{"event": "starting", "pad": ""}\n'))})
    assert path.stat().st_size == 4086  # 10 bytes left in the file's page: the next line's start fits there
    filler = fill(disk)
    with pytest.raises(DiskFull) as info:
        append_jsonl(path, {"event": "disk_full", "reason": "r" * 200})
    assert str(info.value) == f"disk full while writing events.jsonl at {path} (free 0 B of 4.0 MiB)"
    assert path.stat().st_size == 4086  # the 10 bytes that went in were taken back
    filler.unlink()
    append_jsonl(path, {"event": "running"})
    rows, _ = read_jsonl_after(path, 0)
    assert [r["event"] for r in rows] == ["starting", "running"] and "not JSON" not in caplog.text


def test_describe_os_error_names_the_cause_and_the_path(disk: Path, tmp_path: Path) -> None:
    home = SupervisorHome(disk / "runs" / "7")
    filler = fill(disk)
    with pytest.raises(DiskFull) as full:
        home.write_spec({"name": "x" * 10_000})
    spec = disk / "runs" / "7" / "spec.json"
    assert describe_os_error(full.value) == f"disk full while writing the run's spec at {spec} (free 0 B of 4.0 MiB)"
    assert not spec.exists() and os.listdir(home.root) == []
    raw = OSError(errno.ENOSPC, "No space left on device", str(spec))  # as open() raises it
    assert describe_os_error(raw) == f"disk full: no space left on device writing {spec} (free 0 B of 4.0 MiB)"
    filler.unlink()
    with mounted(tmp_path / "ro", "1m", read_only=True) as ro:
        with pytest.raises(OSError) as err:
            SupervisorHome(ro / "runs" / "7").write_spec({})
        assert describe_os_error(err.value) == f"read-only file system writing {ro / 'runs'}"


def test_space_refusal_counts_the_model_weights(disk: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * (3 * 2**20 + 2**19))
    (model / "tokenizer.json").write_text("{}")
    home = disk / "runs" / "3"
    assert launch_space(str(model)) == (9 * 2**19, f"the 3.5 MiB of {model} weights for its final model, plus 1.0 MiB")
    assert space_refusal(home, str(model)) == (
        f"disk full: 4.0 MiB free of 4.0 MiB at {home}; the run needs at least 4.5 MiB "
        f"(the 3.5 MiB of {model} weights for its final model, plus 1.0 MiB)"
    )
    assert space_refusal(home, "Qwen/Qwen3-0.6B") is None  # a hub name: the minimum only
    fill(disk)
    assert space_refusal(home, "Qwen/Qwen3-0.6B") == (
        f"disk full: 0 B free of 4.0 MiB at {home}; the run needs at least 1.0 MiB "
        "(1.0 MiB for its spec, config and logs)"
    )


def test_run_process_turns_disk_full_into_an_event_and_exit_code_1(disk: Path) -> None:
    run = RunDir(disk / "run")
    run.create()
    run.log_event("running")

    def main() -> int:
        fill(disk, leave=64 * 1024)
        atomic_write_text(run.batch(3), "x" * 2**20)  # does not fit; its half-written file is removed
        return 0

    assert run_process("orchestrator", main, ["--run-dir", str(run.root), "--resume-step", "2"]) == 1
    event = read_jsonl(run.events)[-1]
    path = run.batch(3)
    assert event == {
        "time": event["time"],
        "event": "disk_full",
        "process": "orchestrator",
        "reason": f"disk full while writing step_3.json at {path} (free 0 B of 4.0 MiB)",
        "what": "step_3.json",
        "path": str(path),
        "free": 0,
        "total": 4 * 2**20,
    }
    assert os.listdir(run.batches) == []
    with pytest.raises(ValueError, match="not disk"):  # any other error is the process's own
        run_process("orchestrator", lambda: int("not disk"), ["--run-dir", str(run.root)])


def test_read_offset_of_a_cut_short_file_starts_over(tmp_path: Path) -> None:
    path = tmp_path / "forwarded.offset"
    assert read_offset(path) == 0
    path.write_text("")  # truncated, then the write failed
    assert read_offset(path) == 0
    path.write_text("4096")
    assert read_offset(path) == 4096


def test_is_disk_full_believes_the_kernel_then_the_message_then_the_free_space(disk: Path, tmp_path: Path) -> None:
    fill(disk)
    with mounted(tmp_path / "ro", "1m", read_only=True) as ro:
        with pytest.raises(OSError) as read_only:
            (ro / "x").write_text("x")
    assert read_only.value.errno == errno.EROFS and not is_disk_full(read_only.value, disk)  # even on a full disk
    with pytest.raises(OSError) as no_space:
        (disk / "x").write_text("x" * 10_000)
    assert no_space.value.errno == errno.ENOSPC and is_disk_full(no_space.value, tmp_path)
    saved = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")  # safetensors
    assert is_disk_full(saved, tmp_path)
    torch_save = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert is_disk_full(torch_save, disk) and not is_disk_full(torch_save, tmp_path)  # the free space decides
    assert not is_disk_full(KeyboardInterrupt(), disk)


def test_append_jsonl_rows_appends_every_row_as_one_line(tmp_path: Path) -> None:
    path = tmp_path / "rollouts" / "step_2.jsonl"
    path.parent.mkdir()
    append_jsonl(path, {"step": 1})
    append_jsonl_rows(path, [{"step": 2, "reward": 0.5}, {"step": 2, "reward": float("nan")}, {"step": 2}])
    append_jsonl_rows(path, [])
    lines = path.read_text().splitlines()
    assert lines == ['{"step": 1}', '{"step": 2, "reward": 0.5}', '{"step": 2, "reward": NaN}', '{"step": 2}']
