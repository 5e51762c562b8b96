"""Who stopped a run, on every stop surface: ``asyncrl runs stop`` (CLI), ``POST /api/runs/{id}/stop`` (API), the run
page's Stop button (dashboard) and ``asyncrl pipeline stop``. The ``stop_requested`` event says ``stopped by <user>
via <surface>``, and so does the ``cancelled`` status whoever reports the end: the supervisor's ``interrupted`` (the
SIGINT of the stop; once stored as the reason, fresh user) and the stop task's ``stopped`` are kept as ``reported``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.service.test_lifecycle import launched_run, set_status
from tests.service.test_pipelines import body, show
from tests.support.server import run_token_headers
from tests.support.webui import login


def events_of(client: Any, auth: dict[str, str], run_id: int, kind: str) -> list[dict[str, Any]]:
    data = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    return [e for e in data if e["kind"] == kind]


def supervisor_reports(client: Any, run_id: int, reason: str) -> None:
    resp = client.post(
        f"/api/runs/{run_id}/status", json={"status": "cancelled", "reason": reason}, headers=run_token_headers(run_id)
    )
    assert resp.status_code == 200, resp.text


def test_cli_stop_is_recorded_as_the_user_via_cli(
    capsys: pytest.CaptureFixture[str],
    live_server: str,
    client: Any,
    auth: dict[str, str],
    make_run: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.cli import main

    run_id = launched_run(make_run, "running", 999_999)
    owner = client.get(f"/api/runs/{run_id}", headers=auth).json()["owner"]
    monkeypatch.setenv("ASYNCRL_URL", live_server)
    monkeypatch.setenv("ASYNCRL_TOKEN", auth["Authorization"].split()[1])
    assert main(["runs", "stop", str(run_id)]) == 0, capsys.readouterr().err
    [asked] = events_of(client, auth, run_id, "stop_requested")
    assert asked["reason"] == f"stopped by {owner} via CLI"

    supervisor_reports(client, run_id, "interrupted")  # what the local launcher reports on the stop's SIGINT
    run = client.get(f"/api/runs/{run_id}", headers=auth).json()
    assert (run["status"], run["status_reason"]) == ("cancelled", f"stopped by {owner} via CLI")
    ended = events_of(client, auth, run_id, "status")[-1]
    assert (ended["to_status"], ended["reason"], ended["data"]["reported"]) == (
        "cancelled",
        f"stopped by {owner} via CLI",
        "interrupted",
    )


@pytest.mark.parametrize("surface", ["API", "dashboard"])
def test_api_and_dashboard_stops_name_their_surface_whoever_reports_the_end(
    surface: str, client: Any, auth: dict[str, str], make_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.jobs import tasks

    run_id = launched_run(make_run, "running", 999_999)
    owner = client.get(f"/api/runs/{run_id}", headers=auth).json()["owner"]
    monkeypatch.setattr("server.services.runs.enqueue", lambda *a: None)  # no worker here: the stop task runs below
    if surface == "API":
        assert client.post(f"/api/runs/{run_id}/stop", headers=auth).status_code == 200
    else:
        csrf = login(client, auth["Authorization"].split()[1])
        resp = client.post(f"/runs/{run_id}/stop", data={"csrf": csrf}, follow_redirects=False)
        assert resp.status_code == 303, resp.text
    expected = f"stopped by {owner} via {surface}"
    assert [e["reason"] for e in events_of(client, auth, run_id, "stop_requested")] == [expected]

    monkeypatch.setattr(tasks.supervisor, "terminate", lambda pid, grace_s, cgroup=None: None)  # it had gone
    assert tasks.stop(run_id) == f"stopped: run {run_id}"  # the stop task records the end itself ("stopped")
    run = client.get(f"/api/runs/{run_id}", headers=auth).json()
    assert (run["status"], run["status_reason"]) == ("cancelled", expected)
    assert events_of(client, auth, run_id, "status")[-1]["data"]["reported"] == "stopped"


def test_a_stop_before_launch_and_a_resumed_runs_end_are_not_mixed_up(
    client: Any, auth: dict[str, str], make_run: Any
) -> None:
    """A queued run is cancelled at once with the user's reason; a stop asked before a resume does not name the
    resumed launch's own end (a failure there keeps its reason)."""
    queued = make_run()["id"]
    owner = client.get(f"/api/runs/{queued}", headers=auth).json()["owner"]
    run = client.post(f"/api/runs/{queued}/stop", headers=auth).json()
    assert (run["status"], run["status_reason"]) == ("cancelled", f"stopped by {owner} via API before launch")

    run_id = launched_run(make_run, "running", 999_999)
    assert client.post(f"/api/runs/{run_id}/stop", headers=auth).status_code == 200
    supervisor_reports(client, run_id, "interrupted")
    from sqlmodel import Session

    from server.core.db import engine
    from server.services import runs

    with Session(engine) as s:  # an eval-like resume: no checkpoint needed (the status machine is what is tested)
        row = runs.get(s, run_id, lock=True)
        runs.transition(s, row, runs.S.queued, reason="resumed", _resume=True)
        s.commit()
    set_status(client, run_id, "starting", "running")
    supervisor_reports(client, run_id, "interrupted")  # e.g. a Ctrl-C on the host: no stop was asked this launch
    assert client.get(f"/api/runs/{run_id}", headers=auth).json()["status_reason"] == "interrupted"


def test_pipeline_stop_names_the_user_surface_and_pipeline(client: Any, auth: dict[str, str]) -> None:
    p = client.post("/api/pipelines", json=body(name="stopper"), headers=auth).json()
    first_stage_run = p["stages"][0]["run_id"]
    set_status(client, first_stage_run, "starting", "running")
    stopped = client.post(f"/api/pipelines/{p['id']}/stop", headers={**auth, "User-Agent": "asyncrl-cli/1"}).json()
    owner = stopped["owner"]
    assert stopped["status_reason"] == f"stopped by {owner} via CLI"
    supervisor_reports(client, first_stage_run, "interrupted")
    run = client.get(f"/api/runs/{first_stage_run}", headers=auth).json()
    assert run["status_reason"] == f"stopped by {owner} via CLI (pipeline {p['id']})"
    assert show(client, auth, p["id"])["stages"][0]["reason"] == f"stopped by {owner} via CLI"
