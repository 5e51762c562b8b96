"""``worker/launchers/local.py``: the run summary; the failure reason of a process that met a full disk (real processes,
a real tmpfs) and the cleanup at the end of a run."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from tests.support.tmpfs import fill
from worker.checkpoint import remove_incomplete, write_part
from worker.launchers.local import _follow, summarize
from worker.procs import kill_group, spawn
from worker.rundir import RunDir, read_jsonl
from worker.spec import RLSpec, validate_spec


def test_summary_mismatch_kl_leaves_out_steps_that_trained_nothing(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    for step, kl in enumerate([1e-6, 2e-6, 4e-6, math.nan, math.nan], start=1):  # steps 4, 5: every rollout dropped
        run.log_metrics("trainer", step, {"mismatch_kl": kl, "mismatch_kl_on_policy": kl})
    summary = summarize(run, 12.0, "completed")
    assert summary["mismatch_kl"] == (1e-6 + 2e-6 + 4e-6) / 3
    assert summary["mismatch_kl_on_policy"] == (1e-6 + 2e-6 + 4e-6) / 3 and summary["mismatch_kl_on_policy_steps"] == 3
    assert summary["steps"] == 5


# ----------------------------------------------------------------------------- a full disk (a real tmpfs)

_DIES_OF_A_FULL_DISK = """
import sys
from pathlib import Path
from tests.support.tmpfs import fill
from worker.rundir import RunDir, atomic_write_text, run_process

run = RunDir(sys.argv[1])

def main():
    fill(run.root, leave=64 * 1024)
    atomic_write_text(run.batch(3), "x" * 2**20)
    return 0

sys.exit(run_process("orchestrator", main, ["--run-dir", str(run.root)]))
"""


def _procs(run: RunDir, **code: str) -> dict[str, subprocess.Popen[bytes]]:
    repo = str(Path(__file__).resolve().parents[4])
    env = {**os.environ, "PYTHONPATH": repo}
    return {
        name: spawn([sys.executable, "-c", c, str(run.root)], run.logs / f"{name}.log", env) for name, c in code.items()
    }


def test_the_process_that_met_a_full_disk_gives_the_failure_reason(disk: Path) -> None:
    spec = validate_spec("rl", {"name": "full", "max_steps": 4, "model": {"name": "m"}, "output_dir": str(disk)})
    assert isinstance(spec, RLSpec)
    run = RunDir(spec.run_dir)
    run.create()
    run.log_event("running")
    procs = _procs(run, trainer="import time; time.sleep(60)", orchestrator=_DIES_OF_A_FULL_DISK)
    try:
        status, reason = _follow(spec, run, procs, lambda _: None, 0)
    finally:
        for proc in procs.values():
            kill_group(proc)
    assert status == "failed"
    assert reason == (
        f"orchestrator exited with code 1: disk full while writing step_3.json at {run.batch(3)} (free 0 B of 4.0 MiB)"
        f" (log: {run.logs / 'orchestrator.log'})"
    )
    assert read_jsonl(run.events)[-1]["event"] == "disk_full"

    # the trainer dies next, without an event (none fits any more): the full disk is found and named all the same
    fill(disk)
    events_size = run.events.stat().st_size
    procs = _procs(run, trainer="import sys; sys.exit(3)", orchestrator="import time; time.sleep(60)")
    try:
        status, reason = _follow(spec, run, procs, lambda _: None, 0)
    finally:
        for proc in procs.values():
            kill_group(proc)
    assert run.events.stat().st_size == events_size
    assert (status, reason) == (
        "failed",
        f"trainer exited with code 3: disk full at {run.root} (free 0 B of 4.0 MiB) (log: {run.logs / 'trainer.log'})",
    )


def test_the_end_of_a_run_removes_what_failed_writes_left(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    for step in (2, 4):
        write_part(run, step, "trainer", lambda folder: (folder / "meta.json").write_text("{}"))
    write_part(run, 2, "orchestrator", lambda folder: (folder / "state.json").write_text("{}"))
    (run.weight_dir(4) / ".model.safetensors.tmp-7").parent.mkdir(parents=True)
    leftovers = [
        run.weights / ".step_5.tmp-7",
        run.weight_dir(4) / ".model.safetensors.tmp-7",
        run.batches / ".step_5.json.tmp-7",
        run.root / ".final.tmp-7",
        run.checkpoint_dir(2) / ".trainer.tmp-7",
    ]
    for path in leftovers:
        path.mkdir() if path.name.startswith((".step_5.tmp", ".final", ".trainer")) else path.write_text("half")
    assert remove_incomplete(run) == 2
    assert sorted(run.remove_temporaries()) == sorted(leftovers[:4])
    assert not any(p.exists() for p in leftovers)
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_2"]
    assert sorted(p.name for p in run.checkpoint_dir(2).iterdir()) == ["orchestrator", "trainer"]


def test_replica_gpus_split_evenly_or_shared() -> None:
    from worker.launchers.local import replica_gpus

    assert replica_gpus([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert replica_gpus([4, 5, 6, 7], 4) == [[4], [5], [6], [7]]
    assert replica_gpus([0, 1, 2], 2) == [[0, 1, 2], [0, 1, 2]]  # 3 GPUs do not split in 2: both see all
    assert replica_gpus([], 3) == [[], [], []]  # CPU
