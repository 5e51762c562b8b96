"""``GET /metrics``: Prometheus text that parses, request counts by route template and status, runs by status
counted at scrape time, ingested metric points."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def scrape(client: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def sample(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


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
