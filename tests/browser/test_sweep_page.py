"""The sweep page in headless Chromium (C17's page): a 2x2 grid over ``trainer.optim.lr`` x
``orchestrator.temperature`` reached from the nav; while the page is open the rung at step 2 prunes the worst trial and
the page's htmx refresh marks it (row, crossed red point, dashed line) and shows the best so far. The screenshot is the
page after the pruning."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session

from server.core.db import engine
from server.services import sweeps
from tests.support.checkpoints import mark_complete
from tests.support.server import new_token, run_token_headers, spec

pytestmark = pytest.mark.browser


def _post(base: str, path: str, body: Any, headers: dict[str, str]) -> Any:
    resp = httpx.post(f"{base}{path}", json=body, headers=headers)
    assert resp.status_code in (200, 201), resp.text
    return resp.json()


def test_sweep_page_marks_the_pruned_run_and_the_best(page: Any, login: Any, live_server: str) -> None:
    token = new_token(f"sweeper-{secrets.token_hex(3)}")
    h = {"Authorization": f"Bearer {token}"}
    body = {
        "name": "c17-page",
        "base": spec(max_steps=4),
        "grid": {"trainer.optim.lr": [1e-4, 3e-4], "orchestrator.temperature": [0.7, 1.0]},
        "max_parallel": 4,
        "pruning": {"rule": "successive_halving", "at_steps": [2], "reduction_factor": 1.5},
    }
    sw = _post(live_server, "/api/sweeps", body, h)
    ids = [t["run_id"] for t in sw["trials"]]
    values = [{1: 0.30, 2: 0.40}, {1: 0.35, 2: 0.55}, {1: 0.20, 2: 0.30}, {1: 0.10, 2: 0.05}]
    for run_id, vals in zip(ids, values, strict=True):
        for status in ("starting", "running"):
            _post(live_server, f"/api/runs/{run_id}/status", {"status": status}, run_token_headers(run_id))
        step_1 = [{"source": "eval", "step": 1, "name": "reward_mean", "value": vals[1], "time": time.time()}]
        _post(live_server, f"/api/runs/{run_id}/metrics", {"points": step_1}, run_token_headers(run_id))

    login(page, live_server, token)
    page.get_by_role("link", name="Sweeps", exact=True).click()
    page.wait_for_url(f"{live_server}/sweeps")
    page.get_by_role("link", name=f"#{sw['id']} c17-page").click()
    page.wait_for_url(f"{live_server}/sweeps/{sw['id']}")
    assert page.locator("#sweep-status").inner_text() == "running"
    assert page.locator("tr.trial-running").count() == 4 and page.locator("tr.trial-pruned").count() == 0
    assert page.locator("#best-value").inner_text() == "0.35"

    for run_id, vals in zip(ids, values, strict=True):  # step 2 arrives; the rung is decided while the page is open
        step_2 = [{"source": "eval", "step": 2, "name": "reward_mean", "value": vals[2], "time": time.time()}]
        _post(live_server, f"/api/runs/{run_id}/metrics", {"points": step_2}, run_token_headers(run_id))
        run_dir = httpx.get(f"{live_server}/api/runs/{run_id}", headers=h).json()["run_dir"]
        mark_complete(Path(run_dir), 2)  # what its trainer does at the rung (ckpt.hold_at): checkpoint, then hold
    with Session(engine) as s:
        assert sweeps.tick(s, sw["id"])[-1] == "rung 2 decided: 1 pruned, 3 promoted"
    pruned = page.locator('tr[data-trial="3"].trial-pruned')
    pruned.wait_for(timeout=15_000)  # the htmx refresh (every 3 s)
    assert pruned.locator("strong.pruned").inner_text() == "pruned at step 2"
    assert pruned.locator("a").inner_text() == f"#{ids[3]}"
    assert page.locator("tr.trial-waiting").count() == 3  # held at the rung, promoted, resumed by the next ticks
    assert page.locator("#best-value").inner_text() == "0.55"
    assert f"run #{ids[1]}" in page.locator("#sweep-best").inner_text()
    page.wait_for_function("document.getElementById('chart-swept-0').data[1].x.length === 1")
    drawn = page.evaluate(
        """() => {
        const s = document.getElementById('chart-swept-0'), b = document.getElementById('chart-by-step');
        return {kept: s.data[0].y, pruned: [s.data[1].x, s.data[1].y, s.data[1].marker.symbol],
                xtitle: s.layout.xaxis.title.text, dashed: b.data.filter(t => t.line && t.line.dash === 'dash').length,
                lines: b.data.length, points: page_points(s)};
        function page_points(div) { return div.querySelectorAll('.scatterlayer .point').length; }
    }"""
    )
    assert drawn["kept"] == [0.40, 0.55, 0.30] and drawn["pruned"] == [[3e-4], [0.10], "x"]
    assert drawn["xtitle"] == "trainer.optim.lr" and (drawn["lines"], drawn["dashed"]) == (4, 1)
    assert drawn["points"] == 4  # every trial drawn as a point in the browser
