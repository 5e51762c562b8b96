"""``GET /metrics``: Prometheus text that parses, request counts by route template and status, runs by status
counted at scrape time, ingested metric points; the live runs' metrics (newest value wins, ended runs absent, the
caps), also on SQLite, and scraped by a real Prometheus (Debian's ``prometheus``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.prometheus import api_get, prometheus
from tests.support.server import spec, wait_for


def scrape(client: Any, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of one ``GET /metrics`` (with ``headers``: a user token's, for the live runs' series)."""
    resp = client.get("/metrics", headers=headers or {})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def sample(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], family: str, **labels: str) -> float:
    return samples.get((family, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_count(client: Any, auth: dict[str, str], make_run: Any) -> None:
    from sqlalchemy import func
    from sqlmodel import Session, select

    from server.core.db import engine
    from server.models import Run

    before = scrape(client)
    run_id = make_run()["id"]
    route = "/api/runs/{run_id}"
    for _ in range(3):
        assert client.get(f"/api/runs/{run_id}", headers=auth).status_code == 200
    assert client.get("/api/runs/999999", headers=auth).status_code == 404
    assert client.get("/no/such/path").status_code == 404
    points = [{"source": "trainer", "step": s, "name": "loss", "value": 0.5, "time": 1.0} for s in range(10)]
    client.post(f"/api/runs/{run_id}/metrics", json={"points": points}, headers=auth)
    replay = client.post(f"/api/runs/{run_id}/metrics", json={"points": points[5:] + points[9:]}, headers=auth)
    assert replay.json() == {"received": 6, "inserted": 0}  # replayed keys, one twice in the batch
    fresh = {"source": "trainer", "step": 99, "name": "loss", "value": 2.0, "time": 1.0}
    twice = client.post(f"/api/runs/{run_id}/metrics", json={"points": [fresh, fresh]}, headers=auth)
    assert twice.json() == {"received": 2, "inserted": 1}  # a new key twice in one batch is stored once
    client.post(f"/api/runs/{run_id}/stop", headers=auth)
    after = scrape(client)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("asyncrl_http_requests_total", method="GET", route=route, status="200") == 3
    assert delta("asyncrl_http_requests_total", method="GET", route=route, status="404") == 1
    assert delta("asyncrl_http_requests_total", method="GET", route="unmatched", status="404") == 1
    assert delta("asyncrl_http_requests_total", method="POST", route="/api/runs", status="201") == 1
    assert delta("asyncrl_http_request_duration_seconds_count", method="GET", route=route) == 4
    assert delta("asyncrl_metric_points_received_total") == 18
    assert delta("asyncrl_metric_points_inserted_total") == 11
    with Session(engine) as s:
        counts = dict(s.exec(select(Run.status, func.count()).group_by(Run.status)).all())
    for status in ("queued", "starting", "running", "paused", "completed", "failed", "cancelled"):
        assert sample(after, "asyncrl_runs", status=status) == counts.get(status, 0), status
    assert sample(after, "asyncrl_runs", status="cancelled") >= 1


def test_responses_carry_server_timing(client: Any) -> None:
    header = client.get("/healthz").headers["server-timing"]
    assert header.startswith("app;dur=") and float(header.removeprefix("app;dur=")) > 0


def post(client: Any, auth: dict[str, str], run_id: int, *points: tuple[str, int, str, float]) -> None:
    body = {"points": [{"source": src, "step": st, "name": n, "value": v, "time": 1.0} for src, st, n, v in points]}
    assert client.post(f"/api/runs/{run_id}/metrics", json=body, headers=auth).status_code == 200


def run_samples(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], run_ids: set[int]) -> dict[Any, float]:
    """The ``asyncrl_run_*`` samples of the runs ``run_ids``: ``(family, run, source[, name]) -> value``."""
    out = {}
    for (family, labels), v in samples.items():
        label = dict(labels)
        if family.startswith("asyncrl_run_") and label.get("run", "") in {str(i) for i in run_ids}:
            out[(family, int(label["run"]), label["source"], *([label["name"]] if "name" in label else []))] = v
    return out


def test_live_runs_metrics_newest_value(client: Any, auth: dict[str, str], make_run: Any) -> None:
    a, b, done = make_run(), make_run(env={"id": "reverse_text", "name": "rev"}), make_run()
    post(client, auth, a["id"], ("orchestrator", 2, "reward_mean", 0.3), ("eval", 0, "reward_mean", 0.9))
    post(client, auth, a["id"], *[("orchestrator", s, "reward_mean", s / 10) for s in (0, 1)])  # older steps later
    post(client, auth, a["id"], *[("trainer", s, "loss", 2.0 - s / 4) for s in range(5)])
    post(client, auth, b["id"], ("orchestrator", 7, "reward_mean", 0.5), ("trainer", 6, "grad/norm@0", -1.5))
    post(client, auth, done["id"], ("orchestrator", 9, "reward_mean", 1.0))
    assert client.post(f"/api/runs/{done['id']}/stop", headers=auth).json()["status"] == "cancelled"
    samples = scrape(client, auth)
    assert run_samples(samples, {a["id"], b["id"], done["id"]}) == {
        ("asyncrl_run_metric", a["id"], "orchestrator", "reward_mean"): 0.3,
        ("asyncrl_run_metric", a["id"], "eval", "reward_mean"): 0.9,
        ("asyncrl_run_metric", a["id"], "trainer", "loss"): 1.0,
        ("asyncrl_run_step", a["id"], "orchestrator"): 2,
        ("asyncrl_run_step", a["id"], "eval"): 0,
        ("asyncrl_run_step", a["id"], "trainer"): 4,
        ("asyncrl_run_metric", b["id"], "orchestrator", "reward_mean"): 0.5,
        ("asyncrl_run_metric", b["id"], "trainer", "grad/norm@0"): -1.5,
        ("asyncrl_run_step", b["id"], "orchestrator"): 7,
        ("asyncrl_run_step", b["id"], "trainer"): 6,
    }
    owner = a["owner"]
    labels = {"run": str(a["id"]), "source": "orchestrator", "name": "reward_mean", "env": "reverse_text"}
    assert sample(samples, "asyncrl_run_metric", **labels, owner=owner) == 0.3  # every label, exactly
    labels = {"run": str(b["id"]), "source": "trainer", "env": "rev", "owner": owner}
    assert sample(samples, "asyncrl_run_step", **labels) == 6


def test_caps_on_runs_and_series(
    client: Any, auth: dict[str, str], make_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy import func
    from sqlmodel import Session, col, select

    from server.core.config import settings
    from server.core.db import engine
    from server.models import TERMINAL, Run

    old, mid, new = make_run(), make_run(), make_run()  # the newest two are exported
    post(client, auth, old["id"], ("trainer", 0, "loss", 1.0))
    post(client, auth, mid["id"], ("trainer", 0, "loss", 2.0))
    post(client, auth, new["id"], *[("trainer", s, n, s + 0.5) for s in range(3) for n in ("a", "b", "c")])
    monkeypatch.setattr(settings, "PROMETHEUS_MAX_RUNS", 2)
    monkeypatch.setattr(settings, "PROMETHEUS_MAX_METRICS_PER_RUN", 2)
    samples = scrape(client, auth)
    assert run_samples(samples, {old["id"], mid["id"], new["id"]}) == {
        ("asyncrl_run_metric", mid["id"], "trainer", "loss"): 2.0,
        ("asyncrl_run_metric", new["id"], "trainer", "b"): 2.5,  # the last two in (source, name) order
        ("asyncrl_run_metric", new["id"], "trainer", "c"): 2.5,
        ("asyncrl_run_step", mid["id"], "trainer"): 0,
        ("asyncrl_run_step", new["id"], "trainer"): 2,
    }
    with Session(engine) as s:
        live = s.exec(select(func.count()).where(col(Run.status).not_in([t.value for t in TERMINAL]))).one()
    assert sample(samples, "asyncrl_run_metrics_left_out", cap="runs") == live - 2
    assert sample(samples, "asyncrl_run_metrics_left_out", cap="metrics") == 1
    monkeypatch.setattr(settings, "PROMETHEUS_MAX_RUNS", 0)  # off: the control plane only
    assert not [k for k in scrape(client, auth) if k[0].startswith("asyncrl_run_")]


def test_the_runs_series_need_a_user_token(client: Any, auth: dict[str, str], make_run: Any) -> None:
    """Without a token only the control plane (as a load balancer's probe sees it); a bad token 401, a run token 403
    (it reaches only its own run); a read token sees the live runs' series."""
    from server.services import tokens
    from tests.support.server import run_token_headers

    run = make_run()
    post(client, auth, run["id"], ("trainer", 1, "loss", 0.25))
    anonymous = scrape(client)
    assert sample(anonymous, "asyncrl_runs", status="queued") >= 1  # the control plane is there
    assert not [k for k in anonymous if k[0].startswith("asyncrl_run_")]
    bad = client.get("/metrics", headers={"Authorization": "Bearer asr_nope"})
    assert bad.status_code == 401 and "asyncrl_run_" not in bad.text
    by_run = client.get("/metrics", headers=run_token_headers(run["id"]))
    assert by_run.status_code == 403
    assert by_run.json() == {"detail": f"a run token (run {run['id']}) cannot read /metrics; use a user token"}
    from sqlmodel import Session

    from server.core.db import engine

    with Session(engine) as s:
        _, read = tokens.create(s, name="prometheus-reader", scope="read")
        s.commit()
    labels = {"run": str(run["id"]), "source": "trainer", "name": "loss", "env": "reverse_text", "owner": run["owner"]}
    assert sample(scrape(client, {"Authorization": f"Bearer {read}"}), "asyncrl_run_metric", **labels) == 0.25


OWNER = 'me "quoted" \\ back'
"""An owner whose label needs escaping (quote, backslash)."""


def test_live_runs_metrics_on_sqlite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Embedded mode: migration 0012 and the skip scan's SQLite form (row ids, no ``LATERAL``); a label value with a
    quote and a backslash comes back as it was."""
    import server.core.db
    from server.core.db import make_engine
    from server.core.telemetry import RunMetrics
    from server.models import MetricPoint
    from server.services import metrics, runs
    from tests.support.server import migrate

    url = f"sqlite:///{tmp_path}/embedded.db"
    migrate(url)
    eng = make_engine(url)
    monkeypatch.setattr(server.core.db, "engine", eng)
    from sqlmodel import Session

    with Session(eng) as s:
        ids = [int(runs.create(s, data=spec(), owner=OWNER, admin=True).id or 0) for _ in range(2)]
        s.commit()
        points = [("orchestrator", 3, "reward_mean", 0.7), ("orchestrator", 1, "reward_mean", 0.1)]
        points += [("trainer", st, "loss", st / 2) for st in range(4)]
        metrics.ingest(
            s, run_id=ids[1], points=[MetricPoint(source=a, step=b, name=c, value=d, time=0) for a, b, c, d in points]
        )
        s.commit()
    got = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(RunMetrics().exposition())
        for x in f.samples
    }
    eng.dispose()
    run = str(ids[1])
    assert got == {
        (
            "asyncrl_run_metric",
            (("env", "reverse_text"), ("name", "loss"), ("owner", OWNER), ("run", run), ("source", "trainer")),
        ): 1.5,
        (
            "asyncrl_run_metric",
            (
                ("env", "reverse_text"),
                ("name", "reward_mean"),
                ("owner", OWNER),
                ("run", run),
                ("source", "orchestrator"),
            ),
        ): 0.7,
        ("asyncrl_run_step", (("env", "reverse_text"), ("owner", OWNER), ("run", run), ("source", "orchestrator"))): 3,
        ("asyncrl_run_step", (("env", "reverse_text"), ("owner", OWNER), ("run", run), ("source", "trainer"))): 3,
        ("asyncrl_run_metrics_left_out", (("cap", "runs"),)): 0,
        ("asyncrl_run_metrics_left_out", (("cap", "metrics"),)): 0,
    }


def test_a_real_prometheus_scrapes_the_runs_metrics(
    live_server: str, client: Any, auth: dict[str, str], make_run: Any, tmp_path: Path
) -> None:
    """Debian's ``prometheus`` scrapes ``/metrics`` every second; its query API then gives the run's reward."""
    run_id = make_run()["id"]
    post(client, auth, run_id, ("orchestrator", 5, "reward_mean", 0.625))
    token = auth["Authorization"].removeprefix("Bearer ")  # the scrape's user token (Prometheus sends it as Bearer)
    query = f'asyncrl_run_metric{{name="reward_mean",run="{run_id}"}}'
    with prometheus(live_server, token, tmp_path) as api:
        (result,) = wait_for(
            lambda: (api_get(api, "query", query=query) or {}).get("result"), 60, f"prometheus to answer {query}"
        )
        assert result["metric"]["source"] == "orchestrator" and result["metric"]["job"] == "asyncrl"
        assert float(result["value"][1]) == 0.625
        up = api_get(api, "query", query="up")
        assert [float(r["value"][1]) for r in up["result"]] == [1.0]
