"""Metric ingestion is idempotent on (run, source, step, name); series queries downsample server-side."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.server import points, run_token_headers, stored


def test_same_batch_twice_stores_one_row_per_key(client: Any, make_run: Any) -> None:
    run_id = make_run()["id"]
    rt = run_token_headers(run_id)
    batch = {"points": points(50) + points(50, name="reward_mean", source="orchestrator")}
    first = client.post(f"/api/runs/{run_id}/metrics", json=batch, headers=rt)
    assert first.json() == {"received": 100, "inserted": 100}
    second = client.post(f"/api/runs/{run_id}/metrics", json=batch, headers=rt)
    assert second.json() == {"received": 100, "inserted": 0}
    overlap = client.post(f"/api/runs/{run_id}/metrics", json={"points": points(60, start=40)}, headers=rt)
    assert overlap.json() == {"received": 20, "inserted": 10}
    assert stored(run_id) == 110


def test_duplicates_within_one_batch_keep_the_first(client: Any, make_run: Any) -> None:
    run_id = make_run()["id"]
    dup = points(1) + [{**points(1)[0], "value": 99.0}]
    resp = client.post(f"/api/runs/{run_id}/metrics", json={"points": dup}, headers=run_token_headers(run_id))
    assert resp.json() == {"received": 2, "inserted": 1}


def test_downsampling_returns_at_most_max_points_and_keeps_the_last(client: Any, make_run: Any) -> None:
    run_id = make_run()["id"]
    rt = run_token_headers(run_id)
    client.post(f"/api/runs/{run_id}/metrics", json={"points": points(1001)}, headers=rt)
    client.post(f"/api/runs/{run_id}/metrics", json={"points": points(7, source="eval")}, headers=rt)
    for max_points in (1, 2, 3, 10, 100, 999, 1000, 1001, 5000):
        body = client.get(
            f"/api/runs/{run_id}/metrics", params={"name": "loss", "max_points": max_points}, headers=rt
        ).json()
        by_source = {s["source"]: s for s in body["series"]}
        trainer = by_source["trainer"]
        assert trainer["total"] == 1001
        assert len(trainer["step"]) <= max_points and trainer["step"][-1] == 1000, max_points
        assert trainer["step"] == sorted(trainer["step"]) and trainer["value"][-1] == 100.0
        assert len(trainer["step"]) >= min(max_points, 1001) // 2  # decimated, not truncated
        assert len(by_source["eval"]["step"]) == min(7, max_points) and by_source["eval"]["step"][-1] == 6
    tail = client.get(f"/api/runs/{run_id}/metrics", params={"name": "loss", "since_step": 995}, headers=rt).json()
    assert {s["source"]: s["step"] for s in tail["series"]} == {"trainer": [996, 997, 998, 999, 1000]}
    assert client.get(f"/api/runs/{run_id}/metrics", params={"name": "nope"}, headers=rt).json()["series"] == []


def test_non_finite_values_come_back_as_null(client: Any, make_run: Any) -> None:
    run_id = make_run()["id"]
    rt = run_token_headers(run_id)
    body = b'{"points": [{"source": "trainer", "step": 1, "name": "loss", "value": NaN, "time": 1.0}]}'
    resp = client.post(f"/api/runs/{run_id}/metrics", content=body, headers={**rt, "content-type": "application/json"})
    assert resp.json()["inserted"] == 1
    got = client.get(f"/api/runs/{run_id}/metrics", params={"name": "loss"}, headers=rt)
    assert got.status_code == 200 and got.json()["series"][0]["value"] == [None]


def test_run_token_cannot_write_to_another_run(client: Any, auth: dict[str, str], make_run: Any) -> None:
    mine, other = make_run()["id"], make_run()["id"]
    resp = client.post(f"/api/runs/{other}/metrics", json={"points": points(3)}, headers=run_token_headers(mine))
    assert resp.status_code == 403 and "belongs to run" in resp.json()["detail"]
    assert (
        client.get(f"/api/runs/{other}/metrics", params={"name": "loss"}, headers=run_token_headers(mine)).status_code
        == 403
    )
    assert stored(other) == 0
    assert client.post(f"/api/runs/{other}/metrics", json={"points": points(3)}, headers=auth).json()["inserted"] == 3


@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        pytest.param(
            {"points": [{"source": "trainer", "step": -1, "name": "loss", "value": 1, "time": 0}]},
            422,
            "body.points.0.step: Input should be greater than or equal to 0",
            id="negative-step",
        ),
        pytest.param(
            {"points": [{"source": "trainer", "step": 1, "name": "loss", "value": "x", "time": 0}]},
            422,
            "body.points.0.value: Input should be a valid number",
            id="value-not-number",
        ),
        pytest.param(
            {"points": [*points(3), {"source": "a b", "step": 1, "name": "loss", "value": 1, "time": 0}]},
            422,
            "body.points.3.source: String should match pattern",
            id="bad-source",
        ),
        pytest.param({"rows": []}, 422, "body.points: Field required", id="missing-points"),
        pytest.param({"points": points(2001)}, 413, "points: 2001 in one batch, at most 2000", id="too-many"),
    ],
)
def test_bad_batches_are_rejected_whole(client: Any, make_run: Any, body: Any, status: int, detail: str) -> None:
    run_id = make_run()["id"]
    resp = client.post(f"/api/runs/{run_id}/metrics", json=body, headers=run_token_headers(run_id))
    assert resp.status_code == status and resp.json()["detail"].startswith(detail), resp.text
    assert stored(run_id) == 0


def test_malformed_json_is_400_naming_the_body(client: Any, make_run: Any) -> None:
    run_id = make_run()["id"]
    resp = client.post(
        f"/api/runs/{run_id}/metrics",
        content=b'{"points": [',
        headers={**run_token_headers(run_id), "content-type": "application/json"},
    )
    assert resp.status_code == 400 and resp.json()["detail"].startswith("body: not valid JSON")


def test_metrics_of_unknown_run_is_404(client: Any, auth: dict[str, str]) -> None:
    resp = client.post("/api/runs/999999/metrics", json={"points": points(2)}, headers=auth)
    assert resp.status_code == 404
