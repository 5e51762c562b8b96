"""``worker/launchers/local.py``: the run summary; the failure reason of a process that met a full disk (real processes,
a real tmpfs), the cleanup at the end of a run and the `interrupted` event of an attempt killed with its launcher."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tmpfs import fill
from worker.launchers.local import _follow, summarize
from worker.run.checkpoint import remove_incomplete, write_part
from worker.run.procs import kill_group, spawn
from worker.run.rundir import RunDir, read_jsonl
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
from worker.run.rundir import RunDir, atomic_write_text, run_process

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


@pytest.mark.parametrize(
    ("device", "trainer_gpus", "inference_gpus", "shares"),
    [
        ("cpu", [], [], False),  # CPU: the trainer and orchestrator load while vLLM boots
        ("cuda", [], [], True),  # both see every GPU
        ("cuda", [0], [0], True),  # colocated (cuda_ipc)
        ("cuda", [0, 1], [1], True),
        ("cuda", [0], [], True),  # vLLM sees every GPU
        ("cuda", [0], [1], False),  # disjoint: no wait
    ],
)
def test_the_trainer_waits_for_vllm_only_where_they_may_share_a_gpu(
    device: str, trainer_gpus: list[int], inference_gpus: list[int], shares: bool
) -> None:
    from worker.launchers.local import shares_gpu

    spec = validate_spec(
        "rl",
        {
            "name": "g",
            "model": {"name": "m"},
            "trainer": {"device": device},
            "launcher": {"local": {"trainer_gpus": trainer_gpus, "inference_gpus": inference_gpus}},
        },
    )
    assert isinstance(spec, RLSpec) and shares_gpu(spec) is shares


# ----------------------------------------------------------------------------- an attempt killed with its launcher


def _spec(tmp_path: Path) -> RLSpec:
    spec = validate_spec("rl", {"name": "k", "max_steps": 10, "model": {"name": "m"}, "output_dir": str(tmp_path)})
    assert isinstance(spec, RLSpec)
    return spec


def _first_attempt(spec: RLSpec, *, end: str | None) -> tuple[RunDir, float]:
    """Events, metrics and a step-2 checkpoint as the first attempt leaves them: ``end`` None is a ``kill -9`` of the
    whole process tree after step 5 (no final event), else the final status its launcher wrote. Returns the run
    directory and the time of the attempt's ``starting`` event."""
    from worker.launchers.local import prepare_run_dir

    run, start = prepare_run_dir(spec, resume=False, overwrite=True)
    assert start is None
    run.log_event("starting", resume_step=None)
    started = read_jsonl(run.events)[-1]["time"]
    run.log_event("running", inference_url="http://127.0.0.1:1", pids={"trainer": 1, "orchestrator": 2})
    for step in range(1, 6):
        run.log_metrics("trainer", step, {"loss": 0.1})
        run.log_metrics("orchestrator", step + 1, {"reward_mean": 0.5})  # the orchestrator runs a step ahead
    for part in ("trainer", "orchestrator"):
        write_part(run, 2, part, lambda folder: (folder / "state.json").write_text("{}"))
    if end is not None:
        run.log_event(end, reason="")
    return run, started


def _resume(how: str, spec: RLSpec) -> RunDir:
    """The resume paths up to the new attempt's ``starting``: ``asyncrl rl --resume`` (the local launcher), a
    service resume (the supervisor prunes first, then its launcher) and a requeued Slurm attempt (the same)."""
    from worker.launchers.local import prepare_run_dir
    from worker.launchers.slurm_job import prepare_requeued
    from worker.launchers.supervisor import prepare_resume
    from worker.run.rundir import SupervisorHome

    home = SupervisorHome(Path(spec.run_dir).parent)
    if how == "service":
        assert prepare_resume(spec.run_dir, home) == 2
    elif how == "slurm-requeue":
        assert prepare_requeued(spec.run_dir, home) == 2
    run, start = prepare_run_dir(spec, resume=True, overwrite=False)
    assert start == 2
    run.log_event("starting", resume_step=start)  # as launch_rl does next
    return run


@pytest.mark.parametrize("how", ["cli", "service", "slurm-requeue"])
def test_a_resume_after_a_kill_records_the_killed_attempts_end_once(tmp_path: Path, how: str) -> None:
    spec = _spec(tmp_path)
    _, started = _first_attempt(spec, end=None)
    run = _resume(how, spec)
    events = read_jsonl(run.events)
    assert [e["event"] for e in events] == ["starting", "running", "interrupted", "starting"]
    interrupted = events[2]
    assert interrupted["step"] == 5  # the step the trainer reached, read before the resume pruned steps 3-5
    assert interrupted["attempt_started"] == started
    assert interrupted["reason"] == "the previous attempt ended without a final state (killed?); it reached step 5"
    assert [r["step"] for r in read_jsonl(run.metrics) if r["source"] == "trainer"] == [1, 2]  # pruned after it

    # the resumed attempt is killed too, before its trainer logs a step: its own end is recorded once more
    run.log_event("running", pids={})
    _resume("cli", spec)
    events = read_jsonl(run.events)
    assert [e["event"] for e in events][4:] == ["running", "interrupted", "starting"]
    assert (events[5]["step"], events[5]["attempt_started"]) == (2, events[3]["time"])


@pytest.mark.parametrize("end", ["completed", "failed", "cancelled"])
def test_a_resume_after_a_recorded_end_adds_no_interrupted_event(tmp_path: Path, end: str) -> None:
    spec = _spec(tmp_path)
    _first_attempt(spec, end=end)
    run = _resume("service", spec)
    assert [e["event"] for e in read_jsonl(run.events)] == ["starting", "running", end, "starting"]


def test_a_fresh_run_has_no_interrupted_event(tmp_path: Path) -> None:
    from worker.launchers.local import prepare_run_dir

    spec = _spec(tmp_path)
    run, _ = prepare_run_dir(spec, resume=False, overwrite=False)
    assert run.record_interrupted() is None
    assert not run.events.exists()
    _first_attempt(spec, end=None)  # killed; then started over with --overwrite: a fresh directory again
    run, _ = prepare_run_dir(spec, resume=False, overwrite=True)
    assert not run.events.exists()
    assert run.record_interrupted() is None
