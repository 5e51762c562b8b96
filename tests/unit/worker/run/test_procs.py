"""``worker.run.procs.spawn``: what a started process of a run inherits from the one that starts it."""

from __future__ import annotations

import time
from pathlib import Path

from worker.run.procs import OOM_SCORE_ADJ, kill_group, spawn


def _adj(pid: int | str) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


def test_a_started_process_is_the_oom_killers_choice_before_its_starter(tmp_path: Path) -> None:
    """A run's memory limit reached: the kernel kills a worker of the run, never first the supervisor that must
    report it (its RSS is the size of a worker's): each spawned process's OOM score is raised by 500, capped at
    1000, and its own children (vLLM's engine core) inherit it."""
    proc = spawn(["sh", "-c", "sleep 30 & wait"], tmp_path / "log")
    try:
        deadline = time.monotonic() + 10
        children: list[str] = []
        while not children and time.monotonic() < deadline:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            time.sleep(0.05)
        assert children, "the started shell's child"
        expected = min(1000, _adj("self") + OOM_SCORE_ADJ)
        assert OOM_SCORE_ADJ == 500
        assert (_adj(proc.pid), _adj(children[0])) == (expected, expected)
    finally:
        kill_group(proc)


def test_groups_that_ignore_sigterm_are_killed_after_one_grace_not_one_each(tmp_path: Path) -> None:
    """``kill_groups``: three process groups whose leader and child ignore SIGTERM are all gone (and reaped) one
    grace after the call, not three graces; a leader that already exited has its group's leftovers killed too."""
    from worker.run.procs import alive, kill_groups

    stubborn = "trap '' TERM; sleep 60 & wait; wait"
    procs = [spawn(["sh", "-c", stubborn], tmp_path / f"log{i}") for i in range(3)]
    done = spawn(["sh", "-c", "sleep 60 & exit 0"], tmp_path / "done")
    done.wait(timeout=10)
    time.sleep(0.3)  # the shells have set their traps
    t0 = time.monotonic()
    kill_groups([*procs, done], grace_s=1.0)
    took = time.monotonic() - t0
    assert 1.0 <= took < 2.5, took
    assert [p.returncode for p in procs] == [-9, -9, -9] and done.returncode == 0
    for p in [*procs, done]:  # no live member left in any group (a killed child is a zombie until init reaps it)
        members = [
            d.name
            for d in Path("/proc").iterdir()
            if d.name.isdigit() and _stat(d) is not None and _stat(d)[1] == p.pid and _stat(d)[0] != "Z"
        ]
        assert members == [] and not alive(p.pid)


def _stat(d: Path) -> tuple[str, int] | None:
    """(state, process group) of the process at ``/proc/<pid>``, or None if it is gone."""
    try:
        fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[2])
