"""The compare page takes at most ``MAX_COMPARE_RUNS`` distinct runs: beyond, a 422 naming the limit, before any
run's metrics or spec are loaded."""

from __future__ import annotations

import time
from typing import Any


def test_compare_refuses_more_runs_than_the_limit(web: tuple[Any, str], make_run: Any) -> None:
    from webui.compare import MAX_COMPARE_RUNS

    client, _ = web
    assert MAX_COMPARE_RUNS == 8
    ids = [make_run()["id"] for _ in range(MAX_COMPARE_RUNS + 1)]
    ok = client.get("/compare", params=[("run", i) for i in ids[:MAX_COMPARE_RUNS]])
    assert ok.status_code == 200
    assert all(f"#{i} " in ok.text for i in ids[:MAX_COMPARE_RUNS])
    # the same run repeated counts once
    same = client.get("/compare", params=[("run", ids[0])] * 50 + [("run", ids[1])])
    assert same.status_code == 200
    started = time.monotonic()
    resp = client.get("/compare", params=[("run", i) for i in ids], headers={"Accept": "text/html"})
    assert resp.status_code == 422
    assert f'id="page-error">run: compare takes at most 8 runs, got {len(ids)}</p>' in resp.text
    many = client.get("/compare", params=[("run", i) for i in range(1, 59)])  # the review's 58 runs
    assert many.status_code == 422 and many.json() == {"detail": "run: compare takes at most 8 runs, got 58"}
    assert time.monotonic() - started < 5
