"""A run's processes as one unit (``worker/run/cgroups.py``) through the service: the launch says which unit a run got
(its cgroup, or the supervisor's session with ``RUN_CGROUPS`` off), nothing of a run is left when it ends, and
``reconcile`` kills what an ended run left behind — not a live run's processes, nor a later session that reuses an
ended run's supervisor pid. Real processes, real cgroups (the tests run as root), the real Postgres.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import wait_for
from worker.run import cgroups
from worker.run.procs import session_members


def events_of(client: Any, auth: dict[str, str], run_id: int, kind: str) -> list[dict[str, Any]]:
    data = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    return [e for e in data if e["kind"] == kind]


def run_of(client: Any, auth: dict[str, str], run_id: int) -> dict[str, Any]:
    return dict(client.get(f"/api/runs/{run_id}", headers=auth).json())


@pytest.fixture
def server_url(live_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    from server.core.config import settings

    monkeypatch.setattr(settings, "ASYNCRL_SERVER_URL", live_server)
    return live_server


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Session leaders a test started: their sessions are killed at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        for pid in session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def session_of_three(started: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """A shell leading a new session with two ``sleep`` children: 3 processes, as a supervisor and two of its own."""
    proc = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    started.append(proc)
    wait_for(lambda: len(session_members(proc.pid)) == 3, 10, "a session of 3")
    return proc


def sleep_in(cg: cgroups.RunCgroup, started: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """One ``sleep`` in ``cg``, in a session of its own (it left the supervisor's session: only the cgroup holds it)."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True, preexec_fn=cg.join)
    started.append(proc)
    wait_for(lambda: proc.pid in cg.pids(), 10, "the sleep in the cgroup")
    return proc


def record_launch(run_id: int, pid: int, to: list[str]) -> None:
    """Record a local launch of ``run_id`` by this worker with supervisor ``pid``, then move it through ``to``."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.models import RunStatus
    from server.services import capacity, runs

    with Session(engine) as s:
        run = runs.get(s, run_id, lock=True)
        run.launcher, run.launcher_handle, run.worker = "local", str(pid), capacity.worker_name()
        for status in to:
            runs.transition(s, run, RunStatus(status), reason="test")
        s.commit()


@pytest.mark.usefixtures("server_url")
@pytest.mark.parametrize(("cgroups_on", "limit"), [(True, None), (True, 1.5), (False, 1.5)])
def test_launch_says_which_unit_and_nothing_of_the_run_is_left_when_it_ends(
    client: Any,
    auth: dict[str, str],
    make_run: Any,
    monkeypatch: pytest.MonkeyPatch,
    cgroups_on: bool,
    limit: float | None,
) -> None:
    """The supervisor fails in preflight (no model): when the run is ``failed`` its cgroup is gone and no process of
    its session is left, within 5 s."""
    from server.core.config import settings
    from server.jobs.tasks import launch

    monkeypatch.setattr(settings, "RUN_CGROUPS", cgroups_on)
    run = make_run(**({"launcher": {"memory_limit_gib": limit}} if limit else {}))
    unit = cgroups.for_run(run["id"], Path(run["run_dir"]).parent)
    assert launch(run["id"]).startswith(f"launched: run {run['id']} pid")
    if not cgroups_on:
        line = "session of the supervisor (RUN_CGROUPS is off); launcher.memory_limit_gib 1.5 is not enforced"
    else:
        line = f"cgroup {unit.name} (" + ("memory limit 1.5 GiB)" if limit else "no memory limit)")
    assert [e["reason"] for e in events_of(client, auth, run["id"], "processes")] == [f"processes in the {line}"]
    done = wait_for(lambda: (r := run_of(client, auth, run["id"]))["status"] == "failed" and r, 60, "run failed")
    assert done["status_reason"].startswith("preflight: model.name:"), done["status_reason"]
    sid = int(done["launcher_handle"])
    wait_for(lambda: not session_members(sid) and not unit.exists(), 5, "no process of the run left")
    assert unit.pids() == set()


@pytest.mark.usefixtures("server_url")
def test_a_launch_whose_cgroup_the_previous_stop_removed_tries_again(
    client: Any, auth: dict[str, str], make_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume launched while the stop of the run's previous attempt is still ending it: that stop removes the
    cgroup of the same name between the launch's ``prepare`` and the new supervisor's join (seen in the pipeline e2e:
    the resumed RL stage failed with 'cannot start the supervisor in cgroup'). The launch prepares it again."""
    from server.jobs import tasks
    from worker.launchers import supervisor

    run = make_run()
    real_start, calls = supervisor.start, []

    def start_after_the_stop_removed_it(*args: Any, **kwargs: Any) -> int:
        calls.append(kwargs["cgroup"].name)
        if len(calls) == 1:
            kwargs["cgroup"].remove()  # what the previous attempt's supervisor.terminate does at its end
        return real_start(*args, **kwargs)

    monkeypatch.setattr(supervisor, "start", start_after_the_stop_removed_it)
    assert tasks.launch(run["id"]).startswith(f"launched: run {run['id']} pid")
    assert len(calls) == 2 and calls[0] == calls[1]  # prepared again, under the same name
    done = wait_for(lambda: (r := run_of(client, auth, run["id"]))["status"] == "failed" and r, 60, "run ended")
    assert done["status_reason"].startswith("preflight: model.name:"), done["status_reason"]  # it really ran


@pytest.mark.usefixtures("server_url")
def test_stop_kills_what_left_the_supervisor_session_and_removes_the_cgroup(
    make_run: Any, started: list[subprocess.Popen[bytes]]
) -> None:
    """A process of the run that left the supervisor's session (``setsid``) is still in the run's cgroup: ``stop``
    kills it too."""
    from server.jobs.tasks import stop

    run = make_run()
    leader = session_of_three(started)  # stands for a supervisor that is slow to die
    record_launch(run["id"], leader.pid, ["starting", "running"])
    unit, _ = cgroups.prepare(run["id"], Path(run["run_dir"]).parent, None)
    assert unit is not None
    unit.join(leader.pid)
    escaped = sleep_in(unit, started)
    assert len(unit.pids()) == 2
    assert stop(run["id"], grace_s=2) == f"stopped: run {run['id']}"
    assert session_members(leader.pid) == set()
    assert escaped.wait(timeout=5) == -signal.SIGKILL
    assert not unit.exists()


def test_a_run_that_just_ended_is_left_to_exit_by_itself_then_its_leftovers_are_killed(
    client: Any, auth: dict[str, str], make_run: Any, started: list[subprocess.Popen[bytes]], monkeypatch: Any
) -> None:
    from server.jobs import tasks

    assert tasks.EXIT_GRACE_S == 10.0
    run = make_run()
    leader = session_of_three(started)  # its supervisor, still exiting, and two processes of its session
    record_launch(run["id"], leader.pid, ["starting", "running", "completed"])
    assert tasks.reconcile() == [] and tasks.kill_leftovers() == {}  # ended just now: left alone
    assert len(session_members(leader.pid)) == 3 and events_of(client, auth, run["id"], "leftovers") == []
    monkeypatch.setattr(tasks, "EXIT_GRACE_S", 0.0)  # as if the grace had passed: what is left is a leftover
    assert tasks.kill_leftovers() == {run["id"]: 3} and session_members(leader.pid) == set()
    (event,) = events_of(client, auth, run["id"], "leftovers")
    assert event["data"]["supervisor"] == leader.pid


def test_reconcile_kills_the_leftovers_of_an_ended_run_only(
    client: Any, auth: dict[str, str], make_run: Any, started: list[subprocess.Popen[bytes]], monkeypatch: Any
) -> None:
    from server.jobs import tasks
    from server.jobs.tasks import LEFTOVER_SLACK_S, reconcile

    monkeypatch.setattr(tasks, "EXIT_GRACE_S", 0.0)  # the runs below ended just now (the grace: the test above)

    # Ended run: its supervisor's session (3 processes) and one process in its cgroup that left that session.
    ended = make_run()
    ended_leader = session_of_three(started)
    ended_cg, _ = cgroups.prepare(ended["id"], Path(ended["run_dir"]).parent, None)
    assert ended_cg is not None
    sleep_in(ended_cg, started)
    record_launch(ended["id"], ended_leader.pid, ["starting", "running", "failed"])
    planted = session_members(ended_leader.pid) | ended_cg.pids()
    assert len(planted) == 4

    # Live run: the same layout; its supervisor (the leader) is alive.
    live = make_run()
    live_leader = session_of_three(started)
    live_cg, _ = cgroups.prepare(live["id"], Path(live["run_dir"]).parent, None)
    assert live_cg is not None
    sleep_in(live_cg, started)
    record_launch(live["id"], live_leader.pid, ["starting", "running"])

    # Ended run whose recorded supervisor pid now leads a later session (pid reuse): started after the run ended.
    reused = make_run()
    record_launch(reused["id"], 0, ["starting", "failed"])
    time.sleep(LEFTOVER_SLACK_S + 0.2)
    later = session_of_three(started)
    record_launch(reused["id"], later.pid, [])

    try:
        t0 = time.monotonic()
        assert reconcile() == []  # no live run lost its supervisor
        took = time.monotonic() - t0
        assert session_members(ended_leader.pid) == set() and ended_cg.pids() == set()
        assert not ended_cg.exists()
        (event,) = events_of(client, auth, ended["id"], "leftovers")
        assert event["reason"] == (  # the supervisor (session leader) that had not exited is named, not counted
            f"killed 3 leftover processes of the run (run ended); its supervisor {ended_leader.pid} had not exited"
        )
        assert event["data"] == {
            "pids": sorted(planted - {ended_leader.pid}),
            "supervisor": ended_leader.pid,
            "by": "reconcile",
        }

        assert len(session_members(live_leader.pid)) == 3 and len(live_cg.pids()) == 1  # the live run: untouched
        assert len(session_members(later.pid)) == 3  # the later session: untouched
        assert events_of(client, auth, live["id"], "leftovers") == []
        assert events_of(client, auth, reused["id"], "leftovers") == []
        assert run_of(client, auth, live["id"])["status"] == "running"

        assert reconcile() == [] and len(events_of(client, auth, ended["id"], "leftovers")) == 1  # nothing left
        assert took < 5.0, took
        print(f"reconcile killed {len(planted)} leftovers of an ended run in {took:.2f}s")
    finally:
        cgroups.end_run(live_cg, None, started_before=None)
        record_launch(live["id"], live_leader.pid, ["cancelled"])  # not left for later tests' reconcile


def test_reconcile_of_a_vanished_supervisor_kills_its_run_and_names_an_oom_kill(
    client: Any, auth: dict[str, str], make_run: Any, started: list[subprocess.Popen[bytes]]
) -> None:
    """The supervisor is gone (the kernel killed it, say): its run's processes in the cgroup are killed, the cgroup
    removed, and the failure reason says out of memory."""
    from server.jobs.tasks import reconcile

    run = make_run()
    unit, _ = cgroups.prepare(run["id"], Path(run["run_dir"]).parent, 0.25)
    assert unit is not None
    hog = subprocess.Popen([sys.executable, "-c", "x = bytearray(512 * 2**20)"], preexec_fn=unit.join)
    assert hog.wait(timeout=60) == -signal.SIGKILL  # stands for the supervisor, killed by the OOM killer
    left = sleep_in(unit, started)
    record_launch(run["id"], hog.pid, ["starting", "running"])
    assert reconcile() == [run["id"]]
    assert left.wait(timeout=5) == -signal.SIGKILL
    assert not unit.exists()
    done = run_of(client, auth, run["id"])
    assert done["status"] == "failed"
    assert done["status_reason"] == (
        f"out of memory: the kernel killed a process of the run (limit 0.25 GiB); supervisor {hog.pid} is gone"
    )
    (event,) = events_of(client, auth, run["id"], "leftovers")
    assert event["reason"] == "killed 1 leftover process of the run (supervisor gone)"
