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
