"""The service's side of the hang watchdog (``worker/tracking/progress.py``, case C18): a ``stalled`` engine event fires
the ``status`` rules that watch ``stalled`` (one webhook delivery per episode), and ``watchdog.on_stall`` stops or
restarts the run through the normal stop task and resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.alerts import alert_events, new_run
from tests.support.server import run_token_headers

REASON = (
    "no progress for 12 s: inference not answering: orchestrator waits, 4 request(s) in flight, the oldest "
    "(POST /v1/completions) for 11 s; its /health does not answer"
)


def stalled(t: float, on_stall: str = "event") -> dict[str, Any]:
    data = {"component": "inference", "waiting": "orchestrator", "quiet_s": 12.0, "no_progress_s": 8.0}
    return {
        "event": "stalled",
        "time": t,
        "reason": REASON,
        "process": "supervisor",
        "data": {**data, "on_stall": on_stall},
    }


def running_run(**overrides: Any) -> int:
    """A run moved to ``running`` by hand (no supervisor: the tests call the tasks' functions themselves)."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.models import RunStatus
    from server.services import runs

    run_id = new_run(**overrides)
    with Session(engine) as s:
        run = runs.get(s, run_id)
        runs.transition(s, run, RunStatus.starting)
        runs.transition(s, run, RunStatus.running)
        s.commit()
    return run_id


def events(client: Any, auth: dict[str, str], run_id: int, kind: str) -> list[dict[str, Any]]:
    return [e for e in client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"] if e["kind"] == kind]


@pytest.fixture
def enqueued(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    """The tasks the API and the stop task enqueue, recorded instead of sent (no worker runs here)."""
    import server.api.routes.runs as routes
    import server.jobs.tasks as tasks

    sent: list[tuple[str, tuple[int, ...]]] = []
    for module in (routes, tasks):
        monkeypatch.setattr(module, "enqueue", lambda task, *args: sent.append((task.value, args)))
    return sent


def test_a_stalled_event_fires_the_status_rule_and_one_webhook(client: Any, auth: dict[str, str]) -> None:  # C18
    from sqlmodel import Session, col, select

    from server.alerts.models import WebhookDelivery
    from server.core.db import engine

    hook = client.post(
        "/api/webhooks", json={"url": "http://127.0.0.1:9/hook", "events": ["status"]}, headers=auth
    ).json()
    run_id = running_run()
    rule = client.post(
        f"/api/runs/{run_id}/alerts/rules", json={"kind": "status", "statuses": ["stalled"]}, headers=auth
    )
    assert rule.status_code == 201, rule.text
    url, token = f"/api/runs/{run_id}/events", run_token_headers(run_id)
    assert client.post(url, json={"events": [stalled(1733220000.5)]}, headers=token).json() == {"recorded": 1}
    assert client.post(url, json={"events": [stalled(1733220000.5)]}, headers=token).json() == {"recorded": 0}
    assert alert_events(client, auth, run_id) == [("status", "fired", None)]  # the resend fired nothing
    (event,) = events(client, auth, run_id, "stalled")
    assert (event["reason"], event["data"]["component"], event["data"]["waiting"]) == (
        REASON,
        "inference",
        "orchestrator",
    )
    with Session(engine) as s:
        rows = s.exec(select(WebhookDelivery).where(col(WebhookDelivery.endpoint_id) == hook["id"])).all()
        bodies = [json.loads(r.body) for r in rows if json.loads(r.body)["run"]["id"] == run_id]
    assert [(b["event"], b["message"]) for b in bodies] == [
        ("status", f"run status stalled: run {run_id} is stalled ({REASON[:300]})")
    ]
    client.delete(f"/api/webhooks/{hook['id']}", headers=auth)


def test_on_stall_stop_asks_the_normal_stop_once(client: Any, auth: dict[str, str], enqueued: list[Any]) -> None:
    run_id = running_run(watchdog={"on_stall": "stop"})
    url, token = f"/api/runs/{run_id}/events", run_token_headers(run_id)
    assert client.post(url, json={"events": [stalled(4e9, "stop")]}, headers=token).json() == {"recorded": 1}
    assert client.post(url, json={"events": [stalled(4e9 + 60, "stop")]}, headers=token).json() == {"recorded": 1}
    (asked,) = events(client, auth, run_id, "stop_requested")  # the second stall asks nothing more
    assert asked["reason"] == f"stopped by watchdog: {REASON}"
    assert "restart" not in asked["data"]
    assert enqueued == [("asyncrl.stop_run", (run_id,))]
    # on_stall = "event" (the default) and a stall older than the run's last transition ask for nothing
    for other, event in (
        (running_run(), stalled(4e9, "stop")),
        (running_run(watchdog={"on_stall": "stop"}), stalled(1.0)),
    ):
        client.post(f"/api/runs/{other}/events", json={"events": [event]}, headers=run_token_headers(other))
        assert events(client, auth, other, "stop_requested") == []
    assert enqueued == [("asyncrl.stop_run", (run_id,))]


def test_on_stall_restart_stops_then_resumes_from_the_newest_checkpoint(
    client: Any, auth: dict[str, str], enqueued: list[Any]
) -> None:
    from server.jobs.tasks import stop

    run_id = running_run(watchdog={"on_stall": "restart"})
    token = run_token_headers(run_id)
    client.post(f"/api/runs/{run_id}/events", json={"events": [stalled(4e9, "restart")]}, headers=token)
    (asked,) = events(client, auth, run_id, "stop_requested")
    assert (asked["reason"], asked["data"]["restart"]) == (f"restarted by watchdog: {REASON}", True)
    run_dir = Path(client.get(f"/api/runs/{run_id}", headers=auth).json()["run_dir"])
    for step in (2, 4):
        for part in ("trainer", "orchestrator"):
            folder = run_dir / "checkpoints" / f"step_{step}" / part
            folder.mkdir(parents=True)
            (folder / ".complete").touch()
    assert stop(run_id, grace_s=1) == f"restarted: run {run_id} from checkpoint step 4"
    statuses = [(e["from_status"], e["to_status"]) for e in events(client, auth, run_id, "status")]
    assert statuses[-2:] == [("running", "cancelled"), ("cancelled", "queued")]
    (resumed,) = events(client, auth, run_id, "resumed")
    assert resumed["reason"] == "resumed by watchdog from checkpoint step 4"
    assert enqueued[-1] == ("asyncrl.launch_run", (run_id,))

    # no checkpoint: the run stays cancelled and says why
    bare = running_run(watchdog={"on_stall": "restart"})
    client.post(f"/api/runs/{bare}/events", json={"events": [stalled(4e9, "restart")]}, headers=run_token_headers(bare))
    assert stop(bare, grace_s=1) == f"stopped: run {bare}"
    assert client.get(f"/api/runs/{bare}", headers=auth).json()["status"] == "cancelled"
    (failed,) = events(client, auth, bare, "restart_failed")
    assert failed["reason"].startswith(f"watchdog restart: run {bare}: no complete checkpoint in ")


def checkpoint(run_dir: Path, step: int) -> None:
    """A complete checkpoint of ``step`` (both parts with their ``.complete`` marker)."""
    for part in ("trainer", "orchestrator"):
        folder = run_dir / "checkpoints" / f"step_{step}" / part
        folder.mkdir(parents=True)
        (folder / ".complete").touch()


def relaunched(run_id: int) -> None:
    """The launch of a resumed run, by hand: queued -> starting -> running."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.models import RunStatus
    from server.services import runs

    with Session(engine) as s:
        run = runs.get(s, run_id)
        runs.transition(s, run, RunStatus.starting)
        runs.transition(s, run, RunStatus.running)
        s.commit()


def test_a_forged_on_stall_in_the_event_does_nothing_beyond_the_spec(
    client: Any, auth: dict[str, str], enqueued: list[Any]
) -> None:
    """The run token may report a stall; what it does comes from the stored spec (stop/resume are the owner's)."""
    from server.jobs.tasks import stop

    quiet = running_run()  # on_stall = "event"
    token = run_token_headers(quiet)
    posted = client.post(f"/api/runs/{quiet}/events", json={"events": [stalled(4e9, "restart")]}, headers=token)
    assert posted.json() == {"recorded": 1}
    assert events(client, auth, quiet, "stop_requested") == []
    assert client.get(f"/api/runs/{quiet}", headers=auth).json()["status"] == "running"
    assert enqueued == []

    stopping = running_run(watchdog={"on_stall": "stop"})
    run_dir = Path(client.get(f"/api/runs/{stopping}", headers=auth).json()["run_dir"])
    checkpoint(run_dir, 2)
    token = run_token_headers(stopping)
    client.post(f"/api/runs/{stopping}/events", json={"events": [stalled(4e9, "restart")]}, headers=token)
    (asked,) = events(client, auth, stopping, "stop_requested")
    assert (asked["reason"], "restart" in asked["data"]) == (f"stopped by watchdog: {REASON}", False)
    assert enqueued == [("asyncrl.stop_run", (stopping,))]
    assert stop(stopping, grace_s=1) == f"stopped: run {stopping}"  # a stop, not a restart
    assert client.get(f"/api/runs/{stopping}", headers=auth).json()["status"] == "cancelled"
    assert events(client, auth, stopping, "resumed") == []
    assert enqueued == [("asyncrl.stop_run", (stopping,))]


def test_a_watchdog_restart_needs_a_newer_checkpoint_and_stops_after_the_cap(
    client: Any, auth: dict[str, str], enqueued: list[Any]
) -> None:
    """No restart loop: a stall before a new checkpoint, or past ``MAX_WATCHDOG_RESTARTS`` restarts, leaves the run
    cancelled with a ``restart_failed`` event naming why."""
    from server.jobs.tasks import stop

    def stall_and_stop(run_id: int, t: float) -> str:
        client.post(
            f"/api/runs/{run_id}/events", json={"events": [stalled(t, "restart")]}, headers=run_token_headers(run_id)
        )
        return stop(run_id, grace_s=1)

    # the same checkpoint twice: restarted once, then refused
    same = running_run(watchdog={"on_stall": "restart"})
    checkpoint(Path(client.get(f"/api/runs/{same}", headers=auth).json()["run_dir"]), 2)
    assert stall_and_stop(same, 4e9) == f"restarted: run {same} from checkpoint step 2"
    relaunched(same)
    assert stall_and_stop(same, 4e9 + 60) == f"stopped: run {same}"
    assert client.get(f"/api/runs/{same}", headers=auth).json()["status"] == "cancelled"
    (failed,) = events(client, auth, same, "restart_failed")
    assert failed["reason"] == (
        f"watchdog restart: run {same}: its newest checkpoint is step 2, as at the last watchdog restart (from step "
        "2); restarting from it again would stall again"
    )
    assert len(events(client, auth, same, "resumed")) == 1

    # a new checkpoint before each stall: 3 restarts, the 4th refused
    capped = running_run(watchdog={"on_stall": "restart"})
    run_dir = Path(client.get(f"/api/runs/{capped}", headers=auth).json()["run_dir"])
    for n, step in enumerate((2, 4, 6)):
        checkpoint(run_dir, step)
        assert stall_and_stop(capped, 4e9 + 60 * n) == f"restarted: run {capped} from checkpoint step {step}"
        relaunched(capped)
    checkpoint(run_dir, 8)
    assert stall_and_stop(capped, 4e9 + 600) == f"stopped: run {capped}"
    (failed,) = events(client, auth, capped, "restart_failed")
    assert (
        failed["reason"]
        == f"watchdog restart: run {capped} was restarted by the watchdog 3 times, the most it does per run"
    )
    assert [e["data"]["step"] for e in events(client, auth, capped, "resumed")] == [2, 4, 6]
    assert client.get(f"/api/runs/{capped}", headers=auth).json()["status"] == "cancelled"
    launches = [args for task, args in enqueued if task == "asyncrl.launch_run"]
    assert launches == [(same,), (capped,), (capped,), (capped,)]  # a refused restart launches nothing
    from server.services.runs import MAX_WATCHDOG_RESTARTS

    assert MAX_WATCHDOG_RESTARTS == 3  # the number the README states
