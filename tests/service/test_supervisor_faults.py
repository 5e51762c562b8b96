"""Supervisor faults, with real supervisors, the real API (uvicorn on 127.0.0.1) and the real Postgres:

- the server is down when the supervisor ends: the final report gives up after ``ASYNCRL_REPORT_TIMEOUT_S`` and the
  status spooled in ``<home>/final.json`` is delivered by ``reconcile`` (not "supervisor gone"), with the metric
  points still unsent in ``metrics.jsonl``;
- a resumed run's supervisor does not report ``running`` from the ``running`` event of the earlier attempt;
- a launch redelivered after its supervisor already ran the whole run adopts the finished run (its spooled status)
  instead of starting it again into an existing run directory;
- a resumed run's supervisor prunes the run directory to the checkpoint before it sends anything, then sends the
  pruned ``metrics.jsonl`` from its start: nothing the killed attempt wrote after the checkpoint is stored.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import free_port, run_token_headers, stored, wait_for
from worker.run.procs import alive
from worker.run.rundir import RunDir, SupervisorHome, read_jsonl


def status_events(client: Any, auth: dict[str, str], run_id: int) -> list[tuple[str | None, str | None]]:
    data = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    return [(e["from_status"], e["to_status"]) for e in data if e["kind"] == "status"]


def run_of(client: Any, auth: dict[str, str], run_id: int) -> dict[str, Any]:
    return dict(client.get(f"/api/runs/{run_id}", headers=auth).json())


def stored_points(run_id: int) -> dict[tuple[str, int, str], float]:
    from sqlmodel import Session, select

    from server.core.db import engine
    from server.models import Metric

    with Session(engine) as s:
        rows = s.exec(select(Metric.source, Metric.step, Metric.name, Metric.value).where(Metric.run_id == run_id))
        return {(source, int(step), name): value for source, step, name, value in rows.all()}


@pytest.fixture
def supervisors() -> Iterator[list[int]]:
    """Pids of supervisors a test started; any still alive at the end is killed (its own process group)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)


def test_server_down_final_report_is_bounded_and_reconcile_delivers_the_spool(
    client: Any, auth: dict[str, str], make_run: Any, monkeypatch: pytest.MonkeyPatch, supervisors: list[int]
) -> None:
    from server.core.config import settings
    from server.jobs.tasks import reconcile

    monkeypatch.setattr(settings, "ASYNCRL_SERVER_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.setenv("ASYNCRL_REPORT_TIMEOUT_S", "3")
    from server.jobs.tasks import launch

    run = make_run()
    home = Path(run["run_dir"]).parent
    t0 = time.monotonic()
    result = launch(run["id"])
    pid = int(result.rsplit(" ", 1)[1])
    supervisors.append(pid)
    wait_for(lambda: not alive(pid), 60, "the supervisor gave up reporting to the unreachable server")
    took = time.monotonic() - t0
    print(f"supervisor ended {took:.1f}s after launch with the server down (report timeout 3 s)")  # noqa: T201 - the measurement (-s shows it)
    final = json.loads((home / "final.json").read_text())
    assert (final["status"], final["delivered"], final["pid"]) == ("failed", False, pid)
    assert final["reason"].startswith("preflight: model.name")
    assert "could not report failed to the server within 3s" in (home / "supervisor.log").read_text()
    assert run_of(client, auth, run["id"])["status"] == "starting"  # the server never heard of the end

    rd = RunDir(run["run_dir"])  # points the run's processes wrote while the server was down (none here: preflight)
    rd.create()
    rd.log_metrics("trainer", 1, {"loss": 0.5, "lr": 1e-4})
    rd.log_metrics("orchestrator", 1, {"reward_mean": 0.25})
    assert run["id"] not in reconcile()  # not "supervisor gone": the spooled status is delivered
    assert stored(run["id"]) == 3  # with the points the supervisor could not send
    done = run_of(client, auth, run["id"])
    assert done["status"] == "failed" and done["status_reason"] == final["reason"]
    assert status_events(client, auth, run["id"])[-1] == ("starting", "failed")
    assert reconcile() == [] and run_of(client, auth, run["id"])["status_reason"] == final["reason"]


def test_a_spool_of_an_earlier_attempt_is_not_delivered(client: Any, auth: dict[str, str], make_run: Any) -> None:
    """A crashed supervisor of the current attempt leaves no spool; the earlier attempt's must not stand in. The engine
    events it had not forwarded are recorded by reconcile (once; an invalid line is skipped)."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.jobs.tasks import current_attempt
    from server.models import RunStatus
    from server.services import runs

    proc = subprocess.Popen(["sleep", "60"])
    proc.kill()
    proc.wait()
    gone = proc.pid
    run = make_run()
    run_id, home = run["id"], Path(run["run_dir"]).parent
    home.mkdir(parents=True, exist_ok=True)
    with Session(engine) as s:
        row = runs.get(s, run_id, lock=True)
        row.launcher, row.launcher_handle = "local", str(gone)
        runs.transition(s, row, RunStatus.starting, reason="test")
        attempt = current_attempt(s, run_id)
        s.commit()
    assert isinstance(attempt, int)
    (home / "final.json").write_text(
        json.dumps(
            {
                "status": "cancelled",
                "reason": "old attempt",
                "attempt": attempt - 1,
                "pid": gone,
                "time": 0,
                "delivered": True,
            }
        )
    )
    rd = RunDir(run["run_dir"])  # the run's last words, written after the supervisor's last send: one engine event
    rd.create()
    rd.log_event("disk_full", process="trainer", step=3, path="checkpoints/step_3", reason="disk full at step 3")
    rd.log_event("running", reason="not an engine event")
    with rd.events.open("a") as f:
        f.write('{"event": "truncated", "time": 1.0, "process": "not a name"}\n')  # invalid: skipped, not fatal
    from server.jobs.tasks import reconcile

    assert run_id in reconcile()
    assert run_of(client, auth, run_id)["status_reason"].startswith(f"supervisor {gone} is gone")
    events = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    assert [(e["kind"], e["reason"], e["data"]["step"]) for e in events if e["kind"] == "disk_full"] == [
        ("disk_full", "disk full at step 3", 3)
    ]
    assert not [e for e in events if e["kind"] == "truncated"]
    reconcile()  # the run has ended: nothing is recorded twice
    again = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    assert len([e for e in again if e["kind"] == "disk_full"]) == 1


def test_resumed_supervisor_reports_running_only_for_this_attempt(
    client: Any, auth: dict[str, str], make_run: Any, live_server: str
) -> None:
    """events.jsonl keeps the earlier attempt's ``running``: the reporter of the new attempt must wait for its own."""
    import httpx

    from worker.launchers.reporter import Reporter

    run = make_run()
    rd = RunDir(run["run_dir"])
    rd.create()
    for event in ("starting", "running", "cancelled"):  # the first attempt, as launch_rl logs it
        rd.log_event(event)
    for status in ("starting",):  # the resumed attempt was launched; its processes are not up yet
        resp = client.post(
            f"/api/runs/{run['id']}/status", json={"status": status}, headers=run_token_headers(run["id"])
        )
        assert resp.status_code == 200, resp.text
    with httpx.Client(base_url=live_server, headers=run_token_headers(run["id"]), timeout=10) as http:
        reporter = Reporter(http, run["id"], rd.root, SupervisorHome(Path(run["run_dir"]).parent), interval_s=0.1)
        reporter.start()  # as the resumed run's supervisor does, before its launcher starts
        try:
            rd.log_event("starting", resume_step=2)
            time.sleep(1.5)  # ~15 ticks
            assert run_of(client, auth, run["id"])["status"] == "starting"
            rd.log_event("running", pids={})  # this attempt's processes are up
            wait_for(lambda: run_of(client, auth, run["id"])["status"] == "running", 10, "running reported")
        finally:
            reporter.finish(None, "")
    assert status_events(client, auth, run["id"])[-2:] == [("queued", "starting"), ("starting", "running")]


def test_a_resumed_supervisor_sends_the_pruned_metrics_and_nothing_the_killed_attempt_left_unsent(
    client: Any, auth: dict[str, str], make_run: Any, live_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first supervisor was killed (SIGKILL: no final flush) with points in ``metrics.jsonl`` it had not sent,
    some of steps up to the checkpoint (they must be stored) and some after it (the server deleted those steps at
    resume: sent late, they would be stored instead of the resumed run's new measurements)."""
    from server.core.config import settings
    from server.jobs.tasks import launch
    from worker.launchers.reporter import rows_to_points
    from worker.run.checkpoint import write_part

    monkeypatch.setattr(settings, "ASYNCRL_SERVER_URL", live_server)
    run = make_run()
    rd, home = RunDir(run["run_dir"]), SupervisorHome(Path(run["run_dir"]).parent)
    rd.create()
    rd.config.write_text(json.dumps(run["spec"]))
    for step in (2, 4):
        for part in ("trainer", "orchestrator"):
            write_part(rd, step, part, lambda d: (d / "state.bin").write_bytes(b"state"))
    token = run_token_headers(run["id"])
    for status in ("starting", "running"):
        assert client.post(f"/api/runs/{run['id']}/status", json={"status": status}, headers=token).status_code == 200

    def orchestrator(step: int) -> None:
        rd.log_metrics("orchestrator", step, {"reward_mean": step / 10})

    def trainer(step: int) -> None:
        rd.log_metrics("trainer", step, {"loss": 1 / step, "lr": 1e-4, "grad_norm": 0.5, "mismatch_kl": 1e-6 * step})

    orchestrator(1)  # one step ahead of the trainer (max_async_level 1), as a real run writes them
    for step in (1, 2, 3):
        orchestrator(step + 1)
        trainer(step)
    sent = rows_to_points(read_jsonl(rd.metrics))
    resp = client.post(f"/api/runs/{run['id']}/metrics", json={"points": sent}, headers=token)
    assert resp.status_code == 200, resp.text
    home.forwarded_offset.write_text(str(rd.metrics.stat().st_size))  # what the first supervisor had sent
    trainer(4)  # unsent when it was killed: before the checkpoint...
    orchestrator(5)  # ... and after it
    trainer(5)
    assert client.post(f"/api/runs/{run['id']}/status", json={"status": "failed"}, headers=token).status_code == 200
    assert stored(run["id"]) == 16 == len(sent)

    resp = client.post(f"/api/runs/{run['id']}/resume", headers=auth)
    assert resp.status_code == 200, resp.text
    assert stored(run["id"]) == 16  # nothing after the checkpoint had reached the server
    pid = int(launch(run["id"]).rsplit(" ", 1)[1])
    try:
        done = wait_for(
            lambda: (r := run_of(client, auth, run["id"]))["status"] == "failed" and r, 60, "resumed run ended"
        )
    finally:
        wait_for(lambda: not alive(pid), 30, "the resumed supervisor exited")
    assert done["status_reason"].startswith("preflight: model.name"), done["status_reason"]  # after the resume check
    kept = {(p["source"], p["step"], p["name"]): p["value"] for p in rows_to_points(read_jsonl(rd.metrics))}
    assert {k[1] for k in kept} == {1, 2, 3, 4}  # pruned to the checkpoint
    assert stored_points(run["id"]) == kept  # trainer step 4 arrived; nothing of step 5
    assert len(kept) == 20
