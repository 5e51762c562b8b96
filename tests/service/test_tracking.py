"""Tracking basics: tags, notes and groups on runs (edit, filter, bad input, who may) and metric export as CSV
and Parquet (values equal to the stored ones), on the real Postgres."""

from __future__ import annotations

import csv
import io
import json
import math
import secrets
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.support.server import new_token, run_token_headers, spec


def _tag() -> str:
    return f"t-{secrets.token_hex(4)}"


def test_tags_notes_group_are_set_and_filtered(client: Any, auth: dict[str, str], make_run: Any) -> None:
    a, b, c = make_run()["id"], make_run()["id"], make_run()["id"]
    t1, t2, grp = _tag(), _tag(), f"study-{secrets.token_hex(3)}"
    resp = client.patch(
        f"/api/runs/{a}", json={"tags": [t1, t2, t1], "notes": "lr too high?\nretry", "group": grp}, headers=auth
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tags"] == [t1, t2] and body["notes"] == "lr too high?\nretry" and body["group"] == grp
    assert client.patch(f"/api/runs/{b}", json={"tags": [t1]}, headers=auth).json()["tags"] == [t1]
    assert client.patch(f"/api/runs/{c}", json={"group": grp}, headers=auth).json()["group"] == grp

    def ids(**params: Any) -> list[int]:
        resp = client.get("/api/runs", params=params, headers=auth)
        assert resp.status_code == 200, resp.text
        return [r["id"] for r in resp.json()["data"]]

    assert ids(tag=t1) == [b, a]
    assert ids(tag=[t1, t2]) == [a]
    assert ids(group=grp) == [c, a]
    assert ids(group=grp, tag=t1) == [a]
    assert ids(tag=_tag()) == []
    # a field left out stays; notes kept, tags replaced, group cleared
    after = client.patch(f"/api/runs/{a}", json={"tags": [t2], "group": ""}, headers=auth).json()
    assert after["tags"] == [t2] and after["notes"] == "lr too high?\nretry" and after["group"] is None
    assert ids(tag=t1) == [b]
    assert client.get(f"/api/runs/{a}", headers=auth).json()["tags"] == [t2]


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"tags": ["x" * 65]}, "tags[0]: expected 1 to 64 characters, got 65"),
        ({"tags": ["ok", "bad\ttab"]}, "tags[1]: control character '\\t' not allowed"),
        ({"tags": ["new\n"]}, "tags[0]: control character '\\n' not allowed"),
        ({"tags": ["zero\u200bwidth"]}, "tags[0]: control character '\\u200b' not allowed"),
        ({"tags": ["   "]}, "tags[0]: expected 1 to 64 characters, got 0"),
        ({"tags": ["ok", "a,b"]}, "tags[1]: ',' not allowed (the dashboard separates tags with commas)"),
        ({"tags": [f"t{i}" for i in range(33)]}, "body.tags: List should have at most 32 items"),
        ({"notes": "bell\x07"}, "notes: control character '\\x07' not allowed"),
        ({"group": "g" * 129}, "group: expected 1 to 128 characters, got 129"),
        ({"owner": "me"}, "body.owner: Extra inputs are not permitted"),
    ],
    ids=[
        "tag-65",
        "tag-tab",
        "tag-newline",
        "tag-zero-width",
        "tag-blank",
        "tag-comma",
        "33-tags",
        "notes-bell",
        "group-129",
        "extra",
    ],
)
def test_bad_input_is_422_naming_the_field_and_changes_nothing(
    client: Any, auth: dict[str, str], make_run: Any, body: dict[str, Any], detail: str
) -> None:
    run_id = make_run()["id"]
    keep = _tag()
    client.patch(f"/api/runs/{run_id}", json={"tags": [keep], "notes": "kept", "group": "kept"}, headers=auth)
    resp = client.patch(f"/api/runs/{run_id}", json=body, headers=auth)
    assert resp.status_code == 422 and detail in resp.json()["detail"], resp.text
    run = client.get(f"/api/runs/{run_id}", headers=auth).json()
    assert (run["tags"], run["notes"], run["group"]) == ([keep], "kept", "kept")


def test_bad_tag_filter_is_422(client: Any, auth: dict[str, str]) -> None:
    resp = client.get("/api/runs", params={"tag": "a\nb"}, headers=auth)
    assert resp.status_code == 422 and resp.json()["detail"].startswith("tag: control character")
    resp = client.get("/api/runs", params={"tag": "y" * 65}, headers=auth)
    assert resp.status_code == 422 and resp.json()["detail"] == "tag: expected 1 to 64 characters, got 65"
    resp = client.get("/api/runs", params={"group": "a\x00b"}, headers=auth)  # Postgres text takes no NUL
    assert (
        resp.status_code == 422
        and resp.json()["detail"] == "group: control character '\\x00' not allowed (printable text only)"
    )


def test_only_owner_or_admin_edits(client: Any) -> None:
    owner = {"Authorization": f"Bearer {new_token(f'own-{secrets.token_hex(3)}', role='member')}"}
    other = {"Authorization": f"Bearer {new_token(f'oth-{secrets.token_hex(3)}', role='member')}"}
    viewer = {"Authorization": f"Bearer {new_token(f'vw-{secrets.token_hex(3)}', role='viewer')}"}
    reader = {"Authorization": f"Bearer {new_token(f'rd-{secrets.token_hex(3)}', scope='read', role='admin')}"}
    admin = {"Authorization": f"Bearer {new_token(f'adm-{secrets.token_hex(3)}', role='admin')}"}
    run = client.post("/api/runs", json=spec(), headers=owner).json()
    run_id = run["id"]
    assert client.patch(f"/api/runs/{run_id}", json={"tags": ["mine"]}, headers=owner).status_code == 200
    resp = client.patch(f"/api/runs/{run_id}", json={"tags": ["theirs"]}, headers=other)
    assert resp.status_code == 403 and "only its owner or an admin may change its tags" in resp.json()["detail"]
    assert client.patch(f"/api/runs/{run_id}", json={"tags": ["v"]}, headers=viewer).status_code == 403
    assert client.patch(f"/api/runs/{run_id}", json={"tags": ["r"]}, headers=reader).status_code == 403
    resp = client.patch(f"/api/runs/{run_id}", json={"tags": ["rt"]}, headers=run_token_headers(run_id))
    assert resp.status_code == 403 and "run token" in resp.json()["detail"]
    assert client.patch(f"/api/runs/{run_id}", json={"notes": "x"}).status_code == 401
    assert client.get(f"/api/runs/{run_id}", headers=owner).json()["tags"] == ["mine"]
    assert client.patch(f"/api/runs/{run_id}", json={"tags": ["by-admin"]}, headers=admin).json()["tags"] == [
        "by-admin"
    ]
    # an ended run is still annotated
    client.post(f"/api/runs/{run_id}/stop", headers=owner)
    assert client.patch(f"/api/runs/{run_id}", json={"notes": "diverged"}, headers=owner).json()["notes"] == "diverged"


def _post_points(client: Any, run_id: int, pts: list[dict[str, Any]]) -> None:
    body = json.dumps({"points": pts})  # NaN as the bare token NaN, which the API takes
    headers = {**run_token_headers(run_id), "Content-Type": "application/json"}
    resp = client.post(f"/api/runs/{run_id}/metrics", content=body, headers=headers)
    assert resp.status_code == 200 and resp.json()["inserted"] == len(pts), resp.text


def _pts(run_seed: float, n: int = 30) -> list[dict[str, Any]]:
    out = []
    for s in range(n):
        out.append({"source": "trainer", "step": s, "name": "loss", "value": run_seed / (s + 1), "time": 1e9 + s})
        out.append(
            {
                "source": "orchestrator",
                "step": s,
                "name": "reward_mean",
                "value": run_seed * s / 7,
                "time": 1e9 + s + 0.5,
            }
        )
    out.append({"source": "trainer", "step": n, "name": "loss", "value": math.nan, "time": 1e9 + n})
    return out


def _expected(run_id: int, pts: list[dict[str, Any]], names: set[str] | None = None) -> list[tuple[Any, ...]]:
    rows = [
        (run_id, p["source"], p["step"], p["name"], p["value"] if math.isfinite(p["value"]) else None, p["time"])
        for p in pts
        if names is None or p["name"] in names
    ]
    return sorted(rows, key=lambda r: (r[0], r[3], r[1], r[2]))


def _csv_rows(text: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    reader = csv.reader(io.StringIO(text))
    header = next(reader)
    rows = [(int(r[0]), r[1], int(r[2]), r[3], float(r[4]) if r[4] else None, float(r[5])) for r in reader]
    return header, rows


def test_run_export_csv_and_parquet_hold_the_stored_values(client: Any, auth: dict[str, str], make_run: Any) -> None:
    run_id = make_run()["id"]
    pts = _pts(1.7)
    _post_points(client, run_id, pts)
    resp = client.get(f"/api/runs/{run_id}/metrics/export", headers=auth)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/csv")
    assert resp.headers["content-disposition"] == f'attachment; filename="run-{run_id}-metrics.csv"'
    header, rows = _csv_rows(resp.text)
    assert header == ["run_id", "source", "step", "name", "value", "time"]
    assert rows == _expected(run_id, pts)  # the NaN comes back empty (null), as in GET .../metrics

    resp = client.get(f"/api/runs/{run_id}/metrics/export", params={"format": "parquet"}, headers=auth)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/vnd.apache.parquet"
    table = pq.read_table(io.BytesIO(resp.content))
    assert table.column_names == ["run_id", "source", "step", "name", "value", "time"]
    assert [tuple(r.values()) for r in table.to_pylist()] == _expected(run_id, pts)

    one = client.get(f"/api/runs/{run_id}/metrics/export", params={"name": "reward_mean"}, headers=auth)
    assert _csv_rows(one.text)[1] == _expected(run_id, pts, {"reward_mean"})
    # the run's own token reads its own run's export, not another's
    assert client.get(f"/api/runs/{run_id}/metrics/export", headers=run_token_headers(run_id)).status_code == 200
    other = make_run()["id"]
    assert client.get(f"/api/runs/{other}/metrics/export", headers=run_token_headers(run_id)).status_code == 403


def test_comparison_export_holds_every_run(client: Any, auth: dict[str, str], make_run: Any) -> None:
    a, b = make_run()["id"], make_run()["id"]
    pa_, pb = _pts(1.0, 12), _pts(3.0, 9)
    _post_points(client, a, pa_)
    _post_points(client, b, pb)
    resp = client.get("/api/metrics/export", params={"run": [a, b], "format": "parquet"}, headers=auth)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-disposition"] == f'attachment; filename="runs-{a}-{b}-metrics.parquet"'
    got = [tuple(r.values()) for r in pq.read_table(io.BytesIO(resp.content)).to_pylist()]
    assert got == _expected(a, pa_) + _expected(b, pb)
    resp = client.get("/api/metrics/export", params={"run": [a, b], "name": "loss"}, headers=auth)
    assert _csv_rows(resp.text)[1] == _expected(a, pa_, {"loss"}) + _expected(b, pb, {"loss"})


def test_export_bad_input(client: Any, auth: dict[str, str], make_run: Any) -> None:
    run_id = make_run()["id"]
    _post_points(client, run_id, _pts(1.0, 3))
    resp = client.get(f"/api/runs/{run_id}/metrics/export", params={"name": ["loss", "no_such"]}, headers=auth)
    assert resp.status_code == 404
    assert resp.json()["detail"] == f"name: no run of {run_id} has a metric 'no_such' (it has: loss, reward_mean)"
    resp = client.get(f"/api/runs/{run_id}/metrics/export", params={"format": "xlsx"}, headers=auth)
    assert resp.status_code == 422 and resp.json()["detail"].startswith("query.format:")
    assert client.get("/api/runs/2147483000/metrics/export", headers=auth).status_code == 404
    resp = client.get("/api/metrics/export", headers=auth)
    assert resp.status_code == 422 and resp.json()["detail"].startswith("query.run:")
    resp = client.get("/api/metrics/export", params={"run": list(range(1, 22))}, headers=auth)
    assert resp.status_code == 422 and resp.json()["detail"].startswith("query.run:")
    assert client.get(f"/api/runs/{run_id}/metrics/export").status_code == 401


def test_dashboard_edits_tags_and_filters_the_runs_list(
    web: tuple[Any, str], auth: dict[str, str], make_run: Any
) -> None:
    client, csrf = web
    run_id, other = make_run()["id"], make_run()["id"]
    tag, grp = _tag(), f"g-{secrets.token_hex(3)}"
    data = {"csrf": csrf, "tags": f"{tag}, baseline ,{tag}", "group": grp, "notes": "first try"}
    resp = client.post(f"/runs/{run_id}/annotate", data=data, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == f"/runs/{run_id}", resp.text
    run = client.get(f"/api/runs/{run_id}", headers=auth).json()
    assert (run["tags"], run["group"], run["notes"]) == ([tag, "baseline"], grp, "first try")
    page = client.get(f"/runs/{run_id}").text
    assert f'href="/runs?tag={tag}"' in page and "first try" in page and f'href="/runs?group={grp}"' in page
    listed = client.get("/runs", params={"tag": tag}).text
    assert f'data-run-id="{run_id}"' in listed and f'data-run-id="{other}"' not in listed
    assert f'data-run-id="{run_id}"' in client.get("/runs", params={"group": grp}).text
    assert client.get("/runs", params={"tag": "a\x07"}).status_code == 422
    # a bad tag: the one-line error on the run page, nothing changed
    bad = client.post(f"/runs/{run_id}/annotate", data={**data, "tags": "ok, " + "x" * 65})
    assert bad.status_code == 422 and "tags[1]: expected 1 to 64 characters, got 65" in bad.text
    assert client.get(f"/api/runs/{run_id}", headers=auth).json()["tags"] == [tag, "baseline"]


def test_dashboard_annotate_needs_owner_and_csrf(client: Any, auth: dict[str, str], make_run: Any) -> None:
    from tests.support.webui import login

    run_id = make_run()["id"]  # owned by the admin of ``auth``
    csrf = login(client, new_token(f"mem-{secrets.token_hex(3)}", role="member"))
    resp = client.post(f"/runs/{run_id}/annotate", data={"csrf": csrf, "tags": "mine"})
    assert resp.status_code == 403
    assert client.post(f"/runs/{run_id}/annotate", data={"csrf": "wrong", "tags": "mine"}).status_code == 403
    assert 'id="annotate-form"' not in client.get(f"/runs/{run_id}").text
    assert client.get(f"/api/runs/{run_id}", headers=auth).json()["tags"] == []


def test_dashboard_downloads_equal_the_api_export(web: tuple[Any, str], auth: dict[str, str], make_run: Any) -> None:
    client, _ = web
    a, b = make_run()["id"], make_run()["id"]
    _post_points(client, a, _pts(2.0, 5))
    _post_points(client, b, _pts(4.0, 4))
    page = client.get(f"/runs/{a}").text
    assert f'href="/runs/{a}/metrics.csv"' in page and f'href="/runs/{a}/metrics.parquet"' in page
    for fmt in ("csv", "parquet"):
        mine = client.get(f"/runs/{a}/metrics.{fmt}")
        api = client.get(f"/api/runs/{a}/metrics/export", params={"format": fmt}, headers=auth)
        assert mine.status_code == 200 and mine.content == api.content
        both = client.get(f"/compare/metrics.{fmt}", params={"run": [a, b]})
        api = client.get("/api/metrics/export", params={"run": [a, b], "format": fmt}, headers=auth)
        assert both.status_code == 200 and both.content == api.content
    assert f'href="/compare/metrics.csv?run={a}&amp;run={b}"' in client.get("/compare", params={"run": [a, b]}).text
    assert client.get(f"/runs/{a}/metrics.xlsx").status_code == 422


def test_tags_filter_and_export_on_sqlite(tmp_path: Any) -> None:
    """Embedded mode: migration 0009, the tag filter (``json_each``) and the export's row-by-row path on SQLite."""
    from sqlmodel import Session

    from server.core.db import make_engine
    from server.models import MetricPoint, Role, RunUpdate
    from server.services import metric_export, metrics, runs
    from server.services.tokens import Principal
    from tests.support.server import migrate

    url = f"sqlite:///{tmp_path}/embedded.db"
    migrate(url)
    eng = make_engine(url)
    admin = Principal(name="me", role=Role.admin)
    with Session(eng) as s:
        ids = []
        for i in range(3):
            run = runs.create(s, data=spec(name=f"sq-{i}"), owner="me", admin=True)
            s.commit()
            ids.append(int(run.id))  # type: ignore[arg-type]
        runs.update_by(s, ids[0], admin, RunUpdate(tags=["a", "b"], group="g"))
        runs.update_by(s, ids[1], admin, RunUpdate(tags=["b"]))
        assert [r.id for r in runs.list_runs(s, tags=["b"])[0]] == [ids[1], ids[0]]
        assert [r.id for r in runs.list_runs(s, tags=["a", "b"], group="g")[0]] == [ids[0]]
        assert runs.list_runs(s, tags=["ab"])[0] == []
        pts = _pts(0.5, 6)
        metrics.ingest(s, run_id=ids[0], points=[MetricPoint(**p) for p in pts])
        s.commit()
        header, rows = _csv_rows(metric_export.export(s, run_ids=[ids[0]], fmt="csv").decode())
        assert header == ["run_id", "source", "step", "name", "value", "time"] and rows == _expected(ids[0], pts)
        table = pq.read_table(io.BytesIO(metric_export.export(s, run_ids=[ids[0]], names=["loss"], fmt="parquet")))
        assert [tuple(r.values()) for r in table.to_pylist()] == _expected(ids[0], pts, {"loss"})
    eng.dispose()
