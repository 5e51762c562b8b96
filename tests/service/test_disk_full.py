"""A full disk through the service (real Postgres, Redis, Celery worker; a real tmpfs as the output folder): a launch
onto a full or read-only disk fails the run with the reason and an event, at once, never leaving it queued; the run
processes' ``disk_full`` and ``truncated`` events reach the run's events once, whatever the supervisor resends."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import run_token_headers, start_celery_worker, stop_process_group, wait_for
from tests.support.tmpfs import fill, mounted
from worker.launchers.reporter import EventsForwarder
from worker.run.rundir import RunDir, SupervisorHome


def events_of(client: Any, auth: dict[str, str], run_id: int) -> list[dict[str, Any]]:
    return list(client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"])


def statuses(events: list[dict[str, Any]]) -> list[tuple[str | None, str | None]]:
    return [(e["from_status"], e["to_status"]) for e in events if e["kind"] == "status"]


@pytest.fixture
def full_output_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``ASYNCRL_OUTPUT_DIR`` on a 1 MiB tmpfs with no byte free."""
    from server.core.config import settings

    with mounted(tmp_path / "outputs", "1m") as out:
        fill(out)
        monkeypatch.setattr(settings, "ASYNCRL_OUTPUT_DIR", out)
        yield out


def test_launch_onto_a_full_disk_fails_the_run_with_the_reason_and_writes_nothing(
    client: Any, auth: dict[str, str], make_run: Any, full_output_dir: Path
) -> None:
    from server.jobs.tasks import launch

    run = make_run()
    home = full_output_dir / "runs" / str(run["id"])
    assert Path(run["run_dir"]).parent == home
    reason = (
        f"disk full: 0 B free of 1.0 MiB at {home}; the run needs at least 1.0 MiB "
        "(1.0 MiB for its spec, config and logs)"
    )
    assert launch(run["id"]) == f"failed: run {run['id']}: {reason}"
    done = client.get(f"/api/runs/{run['id']}", headers=auth).json()
    assert (done["status"], done["status_reason"], done["launcher_handle"]) == ("failed", reason, None)
    events = events_of(client, auth, run["id"])
    assert statuses(events) == [(None, "queued"), ("queued", "failed")]
    assert events[-1]["reason"] == reason
    assert not home.exists()


def test_launch_into_a_read_only_output_folder_fails_the_run_naming_the_folder(
    client: Any, auth: dict[str, str], make_run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.core.config import settings
    from server.jobs.tasks import launch

    with mounted(tmp_path / "outputs", "4m", read_only=True) as out:
        monkeypatch.setattr(settings, "ASYNCRL_OUTPUT_DIR", out)
        run = make_run()
        reason = f"launch: read-only file system writing {out / 'runs'}"
        assert launch(run["id"]) == f"failed: run {run['id']}: {reason}"
    done = client.get(f"/api/runs/{run['id']}", headers=auth).json()
    assert (done["status"], done["status_reason"]) == ("failed", reason)
    assert statuses(events_of(client, auth, run["id"])) == [(None, "queued"), ("queued", "failed")]


def test_a_run_submitted_onto_a_full_disk_fails_within_seconds_through_a_real_worker(
    client: Any, auth: dict[str, str], make_run: Any, full_output_dir: Path, live_server: str, tmp_path: Path
) -> None:
    from server.jobs.celery_app import app

    app.control.purge()
    worker = start_celery_worker(live_server, tmp_path / "worker.log")
    try:
        submitted = time.monotonic()
        run = make_run()  # POST /api/runs enqueues the launch
        done = wait_for(
            lambda: (r := client.get(f"/api/runs/{run['id']}", headers=auth).json())["status"] != "queued" and r,
            30,
            "the launch",
        )
        took = time.monotonic() - submitted
    finally:
        stop_process_group(worker)
    home = full_output_dir / "runs" / str(run["id"])
    assert done["status"] == "failed" and done["status_reason"].startswith(f"disk full: 0 B free of 1.0 MiB at {home};")
    assert statuses(events_of(client, auth, run["id"])) == [(None, "queued"), ("queued", "failed")]
    assert took < 30
    print(f"full disk at launch: run failed {took:.1f}s after the submit")


# ----------------------------------------------------------------------------- engine events


def _event(kind: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"event": kind, "time": t, "reason": f"{kind} at {t}", "process": "trainer", "data": fields}


def test_engine_events_are_recorded_once_and_only_by_the_run_or_its_owner(
    client: Any, auth: dict[str, str], make_run: Any
) -> None:
    from tests.support.server import new_token

    run = make_run()
    url, token = f"/api/runs/{run['id']}/events", run_token_headers(run["id"])
    body = {"events": [_event("disk_full", 1733220000.25, path="/x/weights/step_3", free=0), _event("truncated", 5.5)]}
    assert client.post(url, json=body, headers=token).json() == {"recorded": 2}
    assert client.post(url, json=body, headers=token).json() == {"recorded": 0}  # a resend adds nothing
    assert client.post(url, json=body, headers=auth).json() == {"recorded": 0}  # the owner may report them too
    engine = [e for e in events_of(client, auth, run["id"]) if e["kind"] != "status"]
    assert [(e["kind"], e["reason"], e["data"]) for e in engine] == [
        (
            "disk_full",
            "disk_full at 1733220000.25",
            {"path": "/x/weights/step_3", "free": 0, "time": 1733220000.25, "process": "trainer"},
        ),
        ("truncated", "truncated at 5.5", {"time": 5.5, "process": "trainer"}),
    ]
    assert engine[0]["time"].startswith("2024-12-03T10:00:00.25")  # when the process wrote it

    for bad, field in (
        ({"events": [_event("status", 1.0)]}, "event"),
        ({"events": [{**_event("truncated", 1.0), "data": {"fraction": math.nan}}]}, "data"),
        ({"events": [_event("truncated", -1.0)]}, "time"),
    ):
        resp = client.post(url, content=json.dumps(body | bad), headers={**token, "Content-Type": "application/json"})
        assert resp.status_code == 422 and field in resp.text, (bad, resp.text)
    other = {"Authorization": f"Bearer {new_token('someone-else', role='member')}"}
    assert client.post(url, json=body, headers=other).status_code == 403
    assert (
        client.post(f"/api/runs/{run['id']}/events", json=body, headers=run_token_headers(make_run()["id"])).status_code
        == 403
    )
    assert client.post(f"/api/runs/{run['id']}/stop", headers=auth).json()["status"] == "cancelled"
    assert client.post(url, json=body, headers=token).status_code == 401  # an ended run's token no longer writes
    assert len([e for e in events_of(client, auth, run["id"]) if e["kind"] != "status"]) == 2


def test_the_forwarder_sends_engine_events_once_across_supervisor_restarts(
    client: Any, auth: dict[str, str], make_run: Any, live_server: str, tmp_path: Path
) -> None:
    run = make_run()
    rundir, home = RunDir(tmp_path / "run"), SupervisorHome(tmp_path)
    rundir.create()
    rundir.log_event("starting", resume_step=None)
    rundir.log_event("running", inference_url="http://x", pids={})
    rundir.log_event("truncated", step=3, fraction=0.9, max_tokens=16, reason="step 3: 90% of the rollouts stopped")
    rundir.log_event("disk_full", process="trainer", reason="disk full while writing x", free=0, total=2**20)
    rundir.log_event("failed", reason="trainer exited with code 1")
    headers = run_token_headers(run["id"])
    with httpx.Client(base_url=live_server, headers=headers, timeout=30) as http:
        first = EventsForwarder(http, run["id"], rundir.events, home.events_offset)
        assert first.send_once() == 2 and first.send_once() == 0
        assert int(home.events_offset.read_text()) == rundir.events.stat().st_size
        assert EventsForwarder(http, run["id"], rundir.events, home.events_offset).send_once() == 0  # a restart
        home.events_offset.unlink()  # a restart that lost its offset sends all again: the server keeps one of each
        assert EventsForwarder(http, run["id"], rundir.events, home.events_offset).send_once() == 2
    engine = [e for e in events_of(client, auth, run["id"]) if e["kind"] != "status"]
    assert [(e["kind"], e["reason"], e["data"].get("process")) for e in engine] == [
        ("truncated", "step 3: 90% of the rollouts stopped", None),
        ("disk_full", "disk full while writing x", "trainer"),
    ]
    assert engine[0]["data"] == {
        "step": 3,
        "fraction": 0.9,
        "max_tokens": 16,
        "time": engine[0]["data"]["time"],
        "process": None,
    }


# ----------------------------------------------------------------------------- the database's disk full


def test_a_commit_onto_a_full_sqlite_disk_is_503_and_healthz_degraded_until_a_commit_succeeds(
    client: Any, tmp_path: Path
) -> None:
    """The API's requests on an SQLite database on a 4 MiB tmpfs (the app's session swapped, as the embedded mode's
    database): with no byte free the commit of a submit fails, the answer is 503 with one line and ``/healthz``
    says degraded; with the space back the next submit commits and ``/healthz`` is ok again."""
    import sqlite3

    from sqlmodel import Session

    from server.core.db import get_session, make_engine
    from server.jobs import heartbeat
    from server.main import app
    from server.services import tokens
    from tests.support.server import migrate, spec

    with mounted(tmp_path / "db", "4m") as folder:
        url = f"sqlite:///{folder / 'asyncrl.db'}"
        migrate(url)
        with sqlite3.connect(folder / "asyncrl.db") as conn:  # an empty WAL: the next commit must grow it
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        eng = make_engine(url)
        with Session(eng) as s:
            _, plain = tokens.create(s, name="sqlite-user", scope="write", role="admin")
            s.commit()
        auth = {"Authorization": f"Bearer {plain}"}

        def sqlite_session() -> Iterator[Session]:
            with Session(eng) as s:
                yield s

        app.dependency_overrides[get_session] = sqlite_session
        heartbeat.beat("test")  # a worker answered (30 s): the database is the only part this test changes
        try:
            assert client.get("/healthz").json()["status"] == "ok"
            filler = fill(folder)
            resp = client.post("/api/runs", json=spec(name="onto-a-full-disk"), headers=auth)
            line = "database: the request was not stored: database or disk is full"
            assert (resp.status_code, resp.json()) == (503, {"detail": line})
            health = client.get("/healthz")
            assert (health.status_code, health.json()) == (
                503,
                {"status": "degraded", "database": "postgresql", "broker": "redis", "worker": "ok", "reason": line},
            )
            filler.unlink()
            resp = client.post("/api/runs", json=spec(name="space-back"), headers=auth)
            assert resp.status_code == 201, resp.text
            health = client.get("/healthz")
            ok = {"status": "ok", "database": "postgresql", "broker": "redis", "worker": "ok"}
            assert (health.status_code, health.json()) == (200, ok)
            names = [r["name"] for r in client.get("/api/runs", headers=auth).json()["data"]]
            assert names == ["space-back"]
        finally:
            app.dependency_overrides.pop(get_session, None)
            eng.dispose()
