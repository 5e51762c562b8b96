"""Checkpoints and run directory (``worker/run/checkpoint.py``, ``worker/run/rundir.py``): cases C4, C5, a full disk,
pruning, JSONL."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.tmpfs import fill, free_bytes
from worker.run.checkpoint import (
    complete_steps,
    due,
    end_of_leg,
    is_complete,
    prune,
    remove_incomplete,
    request,
    resume_step,
    write_part,
)
from worker.run.rundir import COMPLETE_MARKER, STABLE_MARKER, DiskFull, RunDir, append_jsonl, read_jsonl

REPO = Path(__file__).resolve().parents[4]


def _write_files(files: dict[str, str]):  # noqa: ANN202 - a write callback
    def write(folder: Path) -> None:
        for name, text in files.items():
            (folder / name).write_text(text)

    return write


def _complete(run: RunDir, step: int) -> None:
    write_part(run, step, "trainer", _write_files({"meta.json": json.dumps({"step": step})}))
    write_part(run, step, "orchestrator", _write_files({"state.json": json.dumps({"data_cursor": step * 4})}))


# ----------------------------------------------------------------------------- C4


def test_c4_resume_skips_half_written_step(run: RunDir, caplog: pytest.LogCaptureFixture) -> None:
    _complete(run, 4)
    write_part(run, 6, "trainer", _write_files({"meta.json": '{"step": 6}'}))
    step4, step6 = run.checkpoint_dir(4), run.checkpoint_dir(6)
    assert sorted(p.name for p in step4.iterdir()) == ["orchestrator", "trainer"]
    assert (step4 / "trainer" / COMPLETE_MARKER).read_text() == "4"
    assert is_complete(step4)
    assert not is_complete(step6)
    assert complete_steps(run) == [4]

    with caplog.at_level(logging.WARNING, logger="worker.run.checkpoint"):
        assert resume_step(run) == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "step_6" in warnings[0].getMessage()
    assert "incomplete" in warnings[0].getMessage()
    assert not step6.exists()
    assert json.loads((step4 / "orchestrator" / "state.json").read_text()) == {"data_cursor": 16}
    # a second resume is quiet and gives the same answer
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="worker.run.checkpoint"):
        assert resume_step(run) == 4
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_resume_without_complete_checkpoint(run: RunDir) -> None:
    assert resume_step(run) is None
    write_part(run, 2, "orchestrator", _write_files({}))
    assert resume_step(run) is None
    assert not run.checkpoint_dir(2).exists()


def test_write_part_replaces_an_existing_part(run: RunDir) -> None:
    write_part(run, 3, "trainer", _write_files({"a.txt": "old", "stale.txt": "x"}))
    final = write_part(run, 3, "trainer", _write_files({"a.txt": "new"}))
    assert final == run.checkpoint_dir(3) / "trainer"
    assert sorted(p.name for p in final.iterdir()) == [COMPLETE_MARKER, "a.txt"]
    assert (final / "a.txt").read_text() == "new"
    assert [p.name for p in run.checkpoint_dir(3).iterdir()] == ["trainer"]  # no temp folder left


# ----------------------------------------------------------------------------- a full disk (a real tmpfs)


def test_write_part_on_a_full_disk_removes_its_half_written_folder_and_keeps_the_previous_checkpoint(
    disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = RunDir(disk / "run")
    run.create()
    _complete(run, 2)
    write_part(run, 4, "orchestrator", _write_files({"state.json": json.dumps({"data_cursor": 16})}))
    fill(disk, leave=64 * 1024)
    free = free_bytes(disk)
    step4 = run.checkpoint_dir(4)
    with pytest.raises(DiskFull) as info:
        write_part(run, 4, "trainer", _write_files({"meta.json": "{}", "model.safetensors": "w" * 2**20}))
    assert str(info.value) == (
        f"disk full while writing checkpoint step 4 (trainer part) at {step4 / 'trainer'} (free 0 B of 4.0 MiB)"
    )
    assert sorted(p.name for p in step4.iterdir()) == ["orchestrator"]  # the trainer's temporary folder is gone
    assert free_bytes(disk) == free  # and its space is back
    assert complete_steps(run) == [2]
    with caplog.at_level(logging.WARNING, logger="worker.run.checkpoint"):
        assert remove_incomplete(run) == 2  # what the launcher does when the run has ended
    assert "checkpoint step_4 is incomplete (parts: ['orchestrator'])" in caplog.text
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_2"]
    assert json.loads((run.checkpoint_dir(2) / "orchestrator" / "state.json").read_text()) == {"data_cursor": 8}
    assert resume_step(run) == 2

    # a step folder the failed write made itself is removed with its temporary folder
    with pytest.raises(DiskFull):
        write_part(run, 6, "trainer", _write_files({"model.safetensors": "w" * 2**20}))
    assert not run.checkpoint_dir(6).exists()


# ----------------------------------------------------------------------------- C5

_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np
    from safetensors.numpy import save_file
    from worker.run.checkpoint import write_part
    from worker.run.rundir import RunDir

    run = RunDir(sys.argv[1])
    run.create()

    def tensors(step):
        return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) * step, "b": np.full(5, step, dtype=np.int64)}

    def trainer(step, block):
        def write(folder):
            save_file(tensors(step), str(folder / "model.safetensors"))
            if block:  # half the files written, then the kill comes
                print("IN_WRITE", folder, flush=True)
                time.sleep(60)
            (folder / "meta.json").write_text('{"step": %d}' % step)
        return write

    def orchestrator(step):
        def write(folder):
            (folder / "state.json").write_text('{"step": %d, "data_cursor": %d}' % (step, step * 4))
        return write

    write_part(run, 2, "trainer", trainer(2, False))
    write_part(run, 2, "orchestrator", orchestrator(2))
    write_part(run, 4, "orchestrator", orchestrator(4))
    write_part(run, 4, "trainer", trainer(4, True))
    print("NOT_KILLED", flush=True)
""")


def test_c5_kill_during_checkpoint_write(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("IN_WRITE"), f"writer did not reach the write: {line!r} {proc.stderr.read()!r}"  # type: ignore[union-attr]
        tmp_folder = Path(line.split(maxsplit=1)[1].strip())
        assert tmp_folder.parent == root / "checkpoints" / "step_4"
        assert tmp_folder.name.startswith(".trainer.tmp-")
        assert (tmp_folder / "model.safetensors").exists()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    run = RunDir(root)
    step2, step4 = run.checkpoint_dir(2), run.checkpoint_dir(4)
    # the kill left step 4 half written: orchestrator done, trainer only in its temp folder
    assert is_complete(step2)
    assert not is_complete(step4)
    assert not (step4 / "trainer").exists()
    assert tmp_folder.exists()

    weights = load_file(step2 / "trainer" / "model.safetensors")
    assert set(weights) == {"w", "b"}
    assert torch.equal(weights["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4) * 2)
    assert torch.equal(weights["b"], torch.full((5,), 2, dtype=torch.int64))
    assert json.loads((step2 / "trainer" / "meta.json").read_text()) == {"step": 2}
    assert json.loads((step2 / "orchestrator" / "state.json").read_text()) == {"step": 2, "data_cursor": 8}

    with caplog.at_level(logging.WARNING, logger="worker.run.checkpoint"):
        assert resume_step(run) == 2
    assert any("step_4" in r.getMessage() for r in caplog.records)
    assert not step4.exists()
    assert not tmp_folder.exists()
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_2"]
    assert is_complete(step2)


def test_resume_removes_temp_folders_inside_complete_steps(run: RunDir) -> None:
    _complete(run, 2)
    leftover = run.checkpoint_dir(2) / ".trainer.tmp-99999"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    assert resume_step(run) == 2
    assert not leftover.exists()
    assert sorted(p.name for p in run.checkpoint_dir(2).iterdir()) == ["orchestrator", "trainer"]


# ----------------------------------------------------------------------------- prune


def test_prune_keeps_newest_complete(run: RunDir) -> None:
    for step in (2, 4, 6, 8):
        _complete(run, step)
    write_part(run, 10, "trainer", _write_files({}))  # incomplete, newer: kept
    prune(run, keep=2)
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_10", "step_6", "step_8"]
    assert complete_steps(run) == [6, 8]
    prune(run, keep=1)
    assert complete_steps(run) == [8]
    assert run.checkpoint_dir(10).exists()
    prune(run, keep=5)
    assert complete_steps(run) == [8]


def test_prune_after(run: RunDir) -> None:
    for n in range(1, 6):
        (run.batch(n)).write_text(json.dumps({"step": n}))
        (run.rollout_file(n)).write_text(json.dumps({"step": n}) + "\n")
        run.weight_dir(n).mkdir()
        (run.weight_dir(n) / STABLE_MARKER).write_text(str(n))
    run.weight_dir(0).mkdir()
    for n in range(0, 6):
        run.log_metrics("trainer", n, {"loss": float(n)})
        run.log_metrics("orchestrator", n, {"reward_mean": n / 10})
    run.log_event("starting")
    append_jsonl(run.metrics, {"source": "eval", "note": "no step"})

    run.prune_after(3)

    assert sorted(p.name for p in run.batches.iterdir()) == ["step_1.json", "step_2.json", "step_3.json"]
    assert sorted(p.name for p in run.rollouts.iterdir()) == ["step_1.jsonl", "step_2.jsonl", "step_3.jsonl"]
    assert sorted(p.name for p in run.weights.iterdir()) == ["step_0", "step_1", "step_2", "step_3"]
    rows = read_jsonl(run.metrics)
    assert [(r["source"], r.get("step")) for r in rows] == [
        (src, n) for n in range(4) for src in ("trainer", "orchestrator")
    ] + [("eval", None)]
    assert rows[6] == {**rows[6], "loss": 3.0}
    assert json.loads(run.batch(3).read_text()) == {"step": 3}
    assert len(read_jsonl(run.events)) == 1  # events are history, not pruned


# ----------------------------------------------------------------------------- jsonl


def _append_many(path: str, writer: int, n: int, barrier: mp.synchronize.Barrier) -> None:  # type: ignore[name-defined]
    barrier.wait()
    pad = chr(ord("a") + writer) * 3000  # long lines: a torn write would show
    for i in range(n):
        append_jsonl(Path(path), {"w": writer, "i": i, "pad": pad})


def test_append_jsonl_concurrent_writers(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_append_many, args=(str(path), w, 2000, barrier)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    lines = path.read_text().splitlines()
    assert len(lines) == 4000
    rows = [json.loads(line) for line in lines]  # every line is whole JSON
    for w in range(2):
        mine = [r for r in rows if r["w"] == w]
        assert [r["i"] for r in mine] == list(range(2000))  # each writer's lines in its order
        assert all(r["pad"] == chr(ord("a") + w) * 3000 for r in mine)


def test_read_jsonl_skips_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    assert read_jsonl(path) == []
    append_jsonl(path, {"step": 1, "x": 0.5})
    append_jsonl(path, {"step": 2, "x": float("nan")})
    with open(path, "a") as f:
        f.write('{"step": 3, "x": 0.')
    rows = read_jsonl(path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["x"] == 0.5
    assert rows[1]["x"] != rows[1]["x"]  # NaN survives


# ----------------------------------------------------------------------------- weights


def test_latest_stable_weights_ignores_unmarked(run: RunDir) -> None:
    assert run.latest_stable_weights() is None
    for n in (1, 3):
        run.weight_dir(n).mkdir()
        (run.weight_dir(n) / "model.safetensors").write_bytes(b"x")
        (run.weight_dir(n) / STABLE_MARKER).write_text(str(n))
    run.weight_dir(5).mkdir()  # being written: no STABLE yet
    (run.weight_dir(5) / "model.safetensors").write_bytes(b"x")
    (run.weights / ".step_7.tmp-1").mkdir()
    assert run.latest_stable_weights() == (3, run.weight_dir(3))
    (run.weight_dir(5) / STABLE_MARKER).write_text("5")
    assert run.latest_stable_weights() == (5, run.weight_dir(5))


def test_a_hold_step_ends_the_leg_and_is_checkpointed(run: RunDir) -> None:
    """``ckpt.hold_at = [2, 6]`` of a 10-step run: a fresh start runs to 2, a resume from 2 to 6, one from 6 to 10;
    every hold step is checkpointed besides ``interval``'s (4, 8) and a requested step (7)."""
    assert [end_of_leg(start, 10, [2, 6]) for start in (0, 1, 2, 5, 6, 9)] == [2, 2, 6, 6, 10, 10]
    assert end_of_leg(0, 10, []) == 10
    request(run, 7)
    assert [s for s in range(1, 11) if due(run, s, 4, [2, 6])] == [2, 4, 6, 7, 8]
    assert [s for s in range(1, 11) if due(run, s, 0, [2, 6])] == [2, 6, 7]
