"""Limits (issue 16, item 3): absurd spec values, the worker's declared capacity, alert-rule caps, deeply nested
bodies, and concurrent runs per user and per worker (queued with the reason, started when a slot frees)."""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import new_token, spec, start_celery_worker, stop_process_group, wait_for
from tests.support.webui import login
from worker.run.checkpoint import write_part
from worker.run.rundir import RunDir

DEEP = 10_000


def run_count() -> int:
    from sqlalchemy import func
    from sqlmodel import Session, select

    from server.core.db import engine
    from server.models import Run

    with Session(engine) as s:
        return int(s.exec(select(func.count()).select_from(Run)).one())


def submit_error(client: Any, auth: dict[str, str], body: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """POST /api/runs expecting a refusal: returns (status, detail) and checks that no run was stored."""
    before = run_count()
    resp = client.post("/api/runs", json=body, headers=auth, **kwargs)
    assert run_count() == before
    return resp.status_code, resp.json()["detail"]


# ----------------------------------------------------------------------------- static bounds


@pytest.mark.parametrize(
    ("overrides", "detail"),
    [
        (
            {"orchestrator": {"group_size": 10**9}},
            "orchestrator.group_size: Input should be less than or equal to 1024, got 1000000000",
        ),
        ({"max_steps": 10**12}, "max_steps: Input should be less than or equal to 1000000, got 1000000000000"),
        (
            {"trainer": {"optim": {"lr": 1e9}}},
            "trainer.optim.lr: Input should be less than or equal to 1, got 1000000000.0",
        ),
        ({"trainer": {"threads": 10**6}}, "trainer.threads: Input should be less than or equal to 1024, got 1000000"),
        (
            {"launcher": {"local": {"trainer_processes": 1024}}},
            "launcher.local.trainer_processes: Input should be less than or equal to 256, got 1024",
        ),
        (
            {"alerts": [{"kind": "status"}] * 10_000},
            "alerts: at most 100 alert rules per run, got 10000",
        ),
    ],
)
def test_absurd_values_are_422_naming_the_bound(
    client: Any, auth: dict[str, str], overrides: dict[str, Any], detail: str
) -> None:
    assert submit_error(client, auth, spec(**overrides)) == (422, detail)


# ----------------------------------------------------------------------------- capacity


def test_a_spec_beyond_the_declared_capacity_is_422_naming_key_value_and_capacity(
    client: Any, auth: dict[str, str], declared: Any
) -> None:
    declared("small", 2, 4, 0)
    assert submit_error(client, auth, spec(trainer={"threads": 3})) == (
        422,
        "trainer.threads: 3 exceeds the worker's capacity (2 cores, 4 GiB, 0 GPUs): at most 2",
    )
    assert submit_error(client, auth, spec(launcher={"local": {"trainer_processes": 8}})) == (
        422,
        "launcher.local.trainer_processes: 8 exceeds the worker's capacity (2 cores, 4 GiB, 0 GPUs): at most 2",
    )
    assert submit_error(client, auth, spec(trainer={"device": "cuda"})) == (
        422,
        "trainer.device: 'cuda' exceeds the worker's capacity (2 cores, 4 GiB, 0 GPUs): no GPU",
    )
    assert client.post("/api/runs", json=spec(trainer={"threads": 2}), headers=auth).status_code == 201
    declared("big", 8, 64, 1)  # a spec fits when one worker can hold it; the error names the largest
    assert client.post("/api/runs", json=spec(trainer={"threads": 8}), headers=auth).status_code == 201
    assert submit_error(client, auth, spec(trainer={"threads": 9})) == (
        422,
        "trainer.threads: 9 exceeds the worker's capacity (8 cores, 64 GiB, 1 GPUs): at most 8",
    )


def test_without_a_declared_worker_the_settings_capacity_counts(
    client: Any, auth: dict[str, str], declared: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.core.config import settings

    del declared  # no worker declared: embedded mode, or before the first worker started
    monkeypatch.setattr(settings, "WORKER_CORES", 3)
    monkeypatch.setattr(settings, "WORKER_MEMORY_GIB", 2.0)
    monkeypatch.setattr(settings, "WORKER_GPUS", 0)
    assert submit_error(client, auth, spec(trainer={"threads": 4})) == (
        422,
        "trainer.threads: 4 exceeds the worker's capacity (3 cores, 2 GiB, 0 GPUs): at most 3",
    )
    big = spec(orchestrator={"batch_size": 1024, "group_size": 64}, inference={"max_model_len": 1024})
    assert submit_error(client, auth, big) == (
        422,
        "orchestrator.batch_size: 1024 (x group_size 64 x inference.max_model_len 1024 = 67108864 rollout tokens "
        "per step) exceeds the worker's capacity (3 cores, 2 GiB, 0 GPUs): at most 4194304 tokens (256 bytes each "
        "in 0.5 of the memory)",
    )


def test_fork_is_checked_against_the_capacity_too(
    client: Any, auth: dict[str, str], make_run: Any, declared: Any
) -> None:
    declared("small", 2, 4, 0)
    parent = make_run(max_steps=6)
    rd = RunDir(parent["run_dir"])
    rd.create()

    def write(folder: Path) -> None:
        (folder / "state.bin").write_bytes(b"x")

    for part in ("trainer", "orchestrator"):
        write_part(rd, 2, part, write)
    before = run_count()
    resp = client.post(f"/api/runs/{parent['id']}/fork", json={"changes": {"trainer.threads": 5}}, headers=auth)
    assert (resp.status_code, resp.json()["detail"]) == (
        422,
        "trainer.threads: 5 exceeds the worker's capacity (2 cores, 4 GiB, 0 GPUs): at most 2",
    )
    assert run_count() == before
    resp = client.post(f"/api/runs/{parent['id']}/fork", json={"changes": {"trainer.optim.lr": 2.0}}, headers=auth)
    assert resp.json()["detail"] == "trainer.optim.lr: Input should be less than or equal to 1, got 2.0"


# ----------------------------------------------------------------------------- alert rules


def test_alert_rules_are_capped_per_run_and_per_user(client: Any, session: Any) -> None:
    from sqlmodel import col, delete

    from server.alerts import rules
    from server.alerts.models import AlertRuleRow

    user = f"rules-{secrets.token_hex(3)}"
    auth = {"Authorization": f"Bearer {new_token(user)}"}
    rule = {"kind": "threshold", "metric": "loss", "op": ">", "value": 1e6, "after_step": 1_000_000}
    run = client.post("/api/runs", json=spec(alerts=[rule] * 100), headers=auth).json()
    resp = client.post(f"/api/runs/{run['id']}/alerts/rules", json=rule, headers=auth)
    assert (resp.status_code, resp.json()["detail"]) == (
        422,
        f"alerts: run {run['id']} has 100 alert rules, the most one run may have (100)",
    )
    added = []
    try:
        for _ in range(100):
            added.append(rules.add(session, rules.RULE.validate_python(rule), run_id=None, by=user).id)
        session.commit()
        resp = client.post("/api/alerts/rules", json=rule, headers=auth)
        assert (resp.status_code, resp.json()["detail"]) == (
            422,
            f"alerts: {user} has 100 global alert rules, the most one user may add (100)",
        )
        other = {"Authorization": f"Bearer {new_token(f'rules-{secrets.token_hex(3)}')}"}
        resp = client.post("/api/alerts/rules", json=rule, headers=other)  # the cap is per user
        assert resp.status_code == 201, resp.text
        added.append(resp.json()["id"])
    finally:
        session.exec(delete(AlertRuleRow).where(col(AlertRuleRow.id).in_(added)))
        session.commit()


def _at_once(n: int, send: Any) -> list[Any]:
    """Call ``send()`` from ``n`` threads released together; the answers."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    start = Barrier(n)

    def one(_: int) -> Any:
        start.wait()
        return send()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_caps_hold_under_concurrent_requests(live_server: str, session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Count-then-add runs one request at a time per user (a Postgres advisory lock): 20 concurrent rule posts by a
    user with 90 rules add exactly 10; 25 concurrent webhook endpoints add exactly 20; with
    MAX_QUEUED_RUNS_PER_USER 3, 8 concurrent submissions queue exactly 3."""
    import httpx
    from sqlmodel import col, delete, func, select

    from server.alerts import rules, webhooks
    from server.alerts.models import AlertRuleRow, WebhookEndpoint
    from server.core.config import settings
    from server.models import Run

    user = f"race-{secrets.token_hex(3)}"
    auth = {"Authorization": f"Bearer {new_token(user, role='member')}"}
    rule = {"kind": "threshold", "metric": "loss", "op": ">", "value": 1e6, "after_step": 1_000_000}
    for _ in range(90):
        rules.add(session, rules.RULE.validate_python(rule), run_id=None, by=user)
    session.commit()
    monkeypatch.setattr(settings, "MAX_QUEUED_RUNS_PER_USER", 3)
    try:
        with httpx.Client(base_url=live_server, headers=auth, timeout=60) as api:
            codes = [r.status_code for r in _at_once(20, lambda: api.post("/api/alerts/rules", json=rule))]
            assert (codes.count(201), codes.count(422)) == (10, 10)
            hook = {"url": "http://127.0.0.1:9/hook", "events": ["status"]}
            answers = _at_once(25, lambda: api.post("/api/webhooks", json=hook))
            assert sorted(r.status_code for r in answers) == [201] * 20 + [422] * 5
            refused = next(r for r in answers if r.status_code == 422).json()["detail"]
            assert refused == f"webhooks: {user} has 20 webhook endpoints, the most one user may add (20)"
            answers = _at_once(8, lambda: api.post("/api/runs", json=spec()))
            assert sorted(r.status_code for r in answers) == [201] * 3 + [422] * 5
            refused = next(r for r in answers if r.status_code == 422).json()["detail"]
            assert refused == f"queued: {user} has 3 runs waiting to start, the most one user may queue (3); " + (
                "stop or delete some first"
            )
        n_rules = select(func.count()).select_from(AlertRuleRow).where(AlertRuleRow.created_by == user)
        assert session.exec(n_rules).one() == 100
        assert session.exec(select(func.count()).select_from(Run).where(Run.owner == user)).one() == 3
        assert webhooks.MAX_ENDPOINTS_PER_USER == 20
    finally:
        session.rollback()
        session.exec(delete(AlertRuleRow).where(col(AlertRuleRow.created_by) == user))
        session.exec(delete(WebhookEndpoint).where(col(WebhookEndpoint.created_by) == user))
        session.commit()
        for run in session.exec(select(Run).where(Run.owner == user)).all():
            run.status = "cancelled"
        session.commit()


def test_the_dashboard_shows_the_rule_cap(client: Any) -> None:
    user = f"web-rules-{secrets.token_hex(3)}"
    csrf = login(client, new_token(user))
    rule = {"kind": "status"}
    from sqlmodel import Session

    from server.core.db import engine
    from server.services import runs

    with Session(engine) as s:
        run_id = runs.create(s, data=spec(alerts=[rule] * 100), owner=user).id
        s.commit()
    resp = client.post("/alerts/rules", data={"csrf": csrf, "kind": "status", "scope": str(run_id)})
    assert resp.status_code == 422
    assert f"alerts: run {run_id} has 100 alert rules, the most one run may have (100)" in resp.text


# ----------------------------------------------------------------------------- nested bodies


def nested_json(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def nested_toml(depth: int) -> str:
    return 'name = "deep"\n[model]\nname = "m"\n[env.args]\nx = ' + "[" * depth + "]" * depth + "\n"


@pytest.mark.parametrize("depth", [33, DEEP])
def test_deeply_nested_json_bodies_are_422(client: Any, auth: dict[str, str], make_run: Any, depth: int) -> None:
    headers = {**auth, "content-type": "application/json"}
    before = run_count()
    run_id = make_run()["id"]
    for path in ("/api/runs", f"/api/runs/{run_id}/fork", f"/api/runs/{run_id}/metrics", "/api/alerts/rules"):
        resp = client.post(path, content=nested_json(depth), headers=headers)
        assert (resp.status_code, resp.json()) == (422, {"detail": "body: nested deeper than 32 levels"}), path
    resp = client.patch(f"/api/runs/{run_id}/config", content=nested_json(depth), headers=headers)
    assert (resp.status_code, resp.json()) == (422, {"detail": "body: nested deeper than 32 levels"})
    assert run_count() == before + 1
    x: Any = 1
    for _ in range(30):
        x = [x]
    inner = spec(env={"args": {"x": x}})  # the spec, env, args and 30 lists: 33 levels
    assert submit_error(client, auth, inner) == (422, "body: nested deeper than 32 levels")


def test_a_body_at_the_depth_limit_is_read(client: Any, auth: dict[str, str]) -> None:
    """32 levels pass the body check (brackets inside strings do not count); the spec check then applies."""
    args: Any = 1
    for _ in range(29):
        args = [args]
    body = spec(name="depth-ok", env={"args": {"x": args, "s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}})
    resp = client.post("/api/runs", json=body, headers=auth)  # past the body check: the spec's own answer
    assert (resp.status_code, resp.json()["detail"].split(";")[0]) == (
        422,
        "env.args.x: not an argument a submitted spec may give 'reverse_text'",
    ), resp.text


@pytest.mark.parametrize(("filename", "text"), [("deep.toml", nested_toml(DEEP)), ("deep.json", nested_json(DEEP))])
def test_deeply_nested_uploads_are_422(client: Any, auth: dict[str, str], filename: str, text: str) -> None:
    before = run_count()
    resp = client.post("/api/runs", files={"file": (filename, text.encode(), "application/octet-stream")}, headers=auth)
    assert (resp.status_code, resp.json()) == (422, {"detail": "file: nested deeper than 32 levels"})
    assert run_count() == before


def test_deeply_nested_forms_are_422(web: tuple[Any, str], make_run: Any) -> None:
    client, csrf = web
    before = run_count()
    resp = client.post("/launch", data={"csrf": csrf, "spec": nested_toml(DEEP)})
    assert resp.status_code == 422
    assert 'id="spec-error">spec: nested deeper than 32 levels</p>' in resp.text
    assert run_count() == before
    run_id = make_run()["id"]
    resp = client.post(f"/runs/{run_id}/fork", data={"csrf": csrf, "changes": "x = " + "[" * DEEP + "]" * DEEP})
    assert resp.status_code == 422 and 'id="page-error">changes: nested deeper than 32 levels</p>' in resp.text


# ----------------------------------------------------------------------------- concurrent runs


@pytest.fixture
def server_url(live_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    from server.core.config import settings

    monkeypatch.setattr(settings, "ASYNCRL_SERVER_URL", live_server)
    return live_server


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Lower the concurrency limits for this test, under a worker name of its own (other tests' live runs do not
    count)."""
    from sqlmodel import Session

    from server.core.config import settings
    from server.core.db import engine
    from server.services import capacity, runs

    monkeypatch.setattr(settings, "WORKER_NAME", f"limits-{secrets.token_hex(3)}")

    def set_limits(per_user: int = 1000, per_worker: int = 1000) -> None:
        monkeypatch.setattr(settings, "MAX_RUNS_PER_USER", per_user)
        monkeypatch.setattr(settings, "MAX_RUNS_PER_WORKER", per_worker)

    yield set_limits
    with Session(engine) as s:  # a failed test leaves no waiting run for later launches to start
        for run_id in capacity.waiting_runs(s):
            runs.request_stop(s, runs.get(s, run_id, lock=True), by="test teardown")
        s.commit()


def user_auth() -> tuple[str, dict[str, str]]:
    user = f"limits-{secrets.token_hex(3)}"
    return user, {"Authorization": f"Bearer {new_token(user)}"}


def run_of(client: Any, auth: dict[str, str], run_id: int) -> dict[str, Any]:
    return dict(client.get(f"/api/runs/{run_id}", headers=auth).json())


def events_of(client: Any, auth: dict[str, str], run_id: int) -> list[tuple[str, str | None, str]]:
    data = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    return [(e["kind"], e["to_status"], e["reason"]) for e in data]


def ended(client: Any, auth: dict[str, str], run_id: int) -> dict[str, Any] | None:
    run = run_of(client, auth, run_id)
    return run if run["status"] in ("failed", "completed", "cancelled") else None


@pytest.mark.usefixtures("server_url")
def test_runs_beyond_the_user_limit_wait_with_the_reason_and_start_when_a_slot_frees(client: Any, limits: Any) -> None:
    from server.jobs.tasks import launch, start_waiting

    limits(per_user=1)
    user, auth = user_auth()
    ids = [client.post("/api/runs", json=spec(), headers=auth).json()["id"] for _ in range(3)]
    first = launch(ids[0])
    assert first.startswith(f"launched: run {ids[0]} pid")
    # the first run fails in preflight within a second or so: held stopped until the checks of its waiting runs are
    # done, so that a loaded box cannot end it (and free its slot) while they run
    supervisor = int(first.split(" pid ")[1].split()[0])
    os.kill(supervisor, signal.SIGSTOP)
    try:
        rest = [launch(i) for i in ids[1:]]
        reason = f"waiting for a slot: {user} has 1 live runs (MAX_RUNS_PER_USER = 1)"
        assert rest == [f"waiting: run {i}: {reason}" for i in ids[1:]]
        for run_id in ids[1:]:
            run = run_of(client, auth, run_id)
            assert (run["status"], run["status_reason"], run["launcher_handle"]) == ("queued", reason, None)
            assert events_of(client, auth, run_id)[-1] == ("waiting", None, reason)
        assert launch(ids[1]) == f"waiting: run {ids[1]}: {reason}"  # a repeat adds no event
        assert [e[0] for e in events_of(client, auth, ids[1])] == ["status", "waiting"]
        web = login(client, new_token(f"viewer-{secrets.token_hex(3)}"))
        assert web and reason in client.get(f"/runs/{ids[1]}").text  # the dashboard shows it too
    finally:
        os.kill(supervisor, signal.SIGCONT)

    wait_for(lambda: ended(client, auth, ids[0]), 60, "the first run to fail in preflight")
    behind = f"waiting for a slot: run {ids[1]} of {user} waits for one first"
    assert launch(ids[2]) == f"waiting: run {ids[2]}: {behind}"  # the slot is free, but the older run goes first
    assert run_of(client, auth, ids[2])["status_reason"] == behind
    second, third = start_waiting()  # what the end of a run and every reconcile call
    assert second.startswith(f"launched: run {ids[1]} pid") and third == f"waiting: run {ids[2]}: {reason}"
    wait_for(lambda: ended(client, auth, ids[1]), 60, "the second run to fail in preflight")
    (last,) = start_waiting()
    assert last.startswith(f"launched: run {ids[2]} pid")
    done = [wait_for(partial(ended, client, auth, i), 60, f"run {i} to end") for i in ids]
    assert [r["status_reason"].split(":")[0] for r in done] == ["preflight"] * 3
    assert start_waiting() == []


@pytest.mark.usefixtures("server_url")
def test_runs_beyond_the_worker_limit_wait_and_reconcile_starts_them(client: Any, limits: Any) -> None:
    from server.core.config import settings
    from server.jobs.tasks import launch, reconcile_runs

    limits(per_worker=1)
    (_, auth_a), (_, auth_b) = user_auth(), user_auth()
    a = client.post("/api/runs", json=spec(), headers=auth_a).json()["id"]
    b = client.post("/api/runs", json=spec(), headers=auth_b).json()["id"]
    reason = f"waiting for a slot: worker {settings.WORKER_NAME} runs 1 live runs (MAX_RUNS_PER_WORKER = 1)"
    first = launch(a)
    assert first.startswith(f"launched: run {a} pid")
    supervisor = int(first.split(" pid ")[1].split()[0])
    os.kill(supervisor, signal.SIGSTOP)  # held live while b is refused its slot (as in the test above)
    try:
        assert launch(b) == f"waiting: run {b}: {reason}"
        assert run_of(client, auth_b, b)["status_reason"] == reason
        assert run_of(client, auth_a, a)["worker"] == settings.WORKER_NAME
    finally:
        os.kill(supervisor, signal.SIGCONT)
    wait_for(lambda: ended(client, auth_a, a), 60, "the first run to fail in preflight")
    reconcile_runs()
    run = wait_for(lambda: ended(client, auth_b, b), 60, "the waiting run to start and end")
    assert run["worker"] == settings.WORKER_NAME and run["status_reason"].startswith("preflight: ")
    statuses = [e[1] for e in events_of(client, auth_b, b) if e[0] == "status"]
    assert statuses == ["queued", "starting", "failed"]


def test_three_simultaneous_submissions_beyond_a_limit_of_one_queue_and_run_one_by_one(
    client: Any, live_server: str, tmp_path: Path
) -> None:
    """A real Celery worker with MAX_RUNS_PER_USER = 1: the first run starts, the other two wait with the reason;
    each later one starts when the one before ended (its supervisor's final report enqueues ``start_waiting``)."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.jobs.celery_app import app
    from server.models import WorkerCapacity
    from worker.launchers.capacity import detect

    app.control.purge()
    name = f"limits-worker-{secrets.token_hex(3)}"
    proc = start_celery_worker(live_server, tmp_path / "worker.log", MAX_RUNS_PER_USER="1", WORKER_NAME=name)
    try:

        def declared_row() -> WorkerCapacity | None:
            with Session(engine) as s:
                return s.get(WorkerCapacity, name)

        row = wait_for(declared_row, 30, "the declared capacity")
        assert (row.cores, row.memory_gib, row.gpus) == tuple(detect().model_dump().values())
        user, auth = user_auth()
        ids = [client.post("/api/runs", json=spec(), headers=auth).json()["id"] for _ in range(3)]
        runs = [wait_for(partial(ended, client, auth, i), 120, f"run {i} to end") for i in ids]
    finally:
        stop_process_group(proc)
    assert [r["status_reason"].split(":")[0] for r in runs] == ["preflight"] * 3, runs
    reason = f"waiting for a slot: {user} has 1 live runs (MAX_RUNS_PER_USER = 1)"
    for run_id in ids[1:]:
        assert ("waiting", None, reason) in events_of(client, auth, run_id), (tmp_path / "worker.log").read_text()
    starts = [
        next(
            e["time"]
            for e in client.get(f"/api/runs/{i}/events", headers=auth).json()["data"]
            if e["to_status"] == "starting"
        )
        for i in ids
    ]
    at = datetime.fromisoformat
    assert at(starts[1]) >= at(runs[0]["finished_at"]) and at(starts[2]) >= at(runs[1]["finished_at"])  # one at a time
    assert os.environ.get("MAX_RUNS_PER_USER") == "1000"  # the test process itself kept the session's limits


@pytest.mark.parametrize("broker", ["redis", "embedded"])
def test_runs_submitted_at_once_start_in_submission_order_on_both_brokers(
    client: Any, live_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broker: str
) -> None:
    """Eight runs of one user submitted at once (eight threads: their launch tasks reach the broker in any order)
    to a real worker with MAX_RUNS_PER_WORKER = 1, on Redis and on the embedded (filesystem) broker behind its own
    API server: each starts after the one before ended, in id order (``capacity.wait_reason``: a run takes no slot an
    older queued run of its owner may take)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from server.jobs.celery_app import app
    from tests.support.server import ApiServer

    env = {"MAX_RUNS_PER_WORKER": "1", "WORKER_NAME": f"order-{broker}-{secrets.token_hex(3)}"}
    server = None
    if broker == "embedded":
        monkeypatch.setenv("CELERY_BROKER_URL", "")  # filesystem:// in ASYNCRL_HOME/broker, for both processes
        env["CELERY_BROKER_URL"] = ""
        server = ApiServer(tmp_path / "server.log")
        server.start()
        url = server.url
    else:
        app.control.purge()
        url = live_server
    proc = start_celery_worker(url, tmp_path / "worker.log", **env)
    try:
        _, auth = user_auth()

        def submit(_: int) -> int:
            resp = httpx.post(f"{url}/api/runs", json=spec(), headers=auth, timeout=60)
            assert resp.status_code == 201, resp.text
            return int(resp.json()["id"])

        with ThreadPoolExecutor(8) as pool:
            ids = sorted(pool.map(submit, range(8)))
        done = [wait_for(partial(ended, client, auth, i), 180, f"run {i} to end") for i in ids]
    finally:
        stop_process_group(proc)
        if server is not None and server.proc is not None:
            stop_process_group(server.proc)
    assert [r["status_reason"].split(":")[0] for r in done] == ["preflight"] * 8, (tmp_path / "worker.log").read_text()

    def started(run_id: int) -> tuple[int, str]:
        data = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
        first = next(e for e in data if e["to_status"] == "starting")
        return first["id"], first["time"]

    starts = [started(i) for i in ids]
    assert sorted(ids, key=lambda i: starts[ids.index(i)][0]) == ids  # started in id order
    at = datetime.fromisoformat
    assert all(at(starts[k + 1][1]) >= at(done[k]["finished_at"]) for k in range(7))  # one at a time
