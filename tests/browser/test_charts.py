"""Chart controls and layout in headless Chromium: the EMA smoothing slider (plotted values against hand-computed
numbers, raw line faint behind), the per-chart log-scale toggle, both kept over a reload and a live update; legends
clear of axis titles on every chart; the runs table's column chooser remembered in localStorage.
Screenshots: ``$ASYNCRL_ARTIFACTS`` (default ``test-artifacts/``): ``charts-smoothed-reward.png``,
``charts-log-loss.png`` and each test's full page."""

from __future__ import annotations

import secrets
import time
from typing import Any

import httpx
import pytest

from tests.browser.conftest import ARTIFACTS
from tests.support.server import new_token, wait_for

pytestmark = pytest.mark.browser

REWARDS = [1.0, 3.0, 2.0, 6.0, 4.0]
# debiased EMA, weight 0.5, by hand: m_t = 0.5 m_{t-1} + 0.5 y_t, s_t = m_t / (1 - 0.5^t)
# m: 0.5, 1.75, 1.875, 3.9375, 3.96875  ->  s: 1, 7/3, 15/7, 4.2, 127/31
SMOOTHED = [1.0, 7 / 3, 15 / 7, 4.2, 127 / 31]
# a 6th point 5.0 arriving live: m = 0.5 * 3.96875 + 2.5 = 4.484375, s = m / (1 - 1/64) = 287/63
SIXTH = 287 / 63


def _chart(page: Any, key: str, expr: str) -> Any:
    return page.evaluate(
        f"() => {{ const d = document.getElementById('chart-{key}'); return d && d.data ? {expr} : null }}"
    )


def _post(base: str, auth: dict[str, str], run_id: int, steps: list[int], rewards: list[float]) -> None:
    pts = [
        {"source": src, "step": s, "name": n, "value": v, "time": time.time()}
        for s, r in zip(steps, rewards, strict=True)
        for src, n, v in (("orchestrator", "reward_mean", r), ("trainer", "loss", 10.0**-s))
    ]
    resp = httpx.post(f"{base}/api/runs/{run_id}/metrics", json={"points": pts}, headers=auth)
    assert resp.status_code == 200, resp.text


def test_smoothing_slider_and_log_toggle_redraw_the_charts_and_are_remembered(
    page: Any, login: Any, live_server: str, make_run: Any, auth: dict[str, str]
) -> None:
    run = make_run(max_steps=50)
    _post(live_server, auth, run["id"], [1, 2, 3, 4, 5], REWARDS)
    login(page, live_server, new_token(f"smooth-{secrets.token_hex(3)}"))
    page.goto(f"{live_server}/runs/{run['id']}")
    wait_for(lambda: _chart(page, "reward", "d.data.length") == 1, 10, "the raw reward line drawn")
    assert _chart(page, "reward", "d.data[0].y") == REWARDS

    page.locator("#smoothing").fill("0.5")
    wait_for(lambda: _chart(page, "reward", "d.data.length") == 2, 10, "raw + smoothed reward lines")
    assert page.locator("#smoothing-value").inner_text() == "0.50"
    raw, smooth = _chart(
        page,
        "reward",
        "d.data.map(t => ({meta: t.meta, y: t.y, o: t.opacity, leg: t.showlegend, c: t.line.color, name: t.name}))",
    )
    assert raw["meta"] == "raw" and raw["y"] == REWARDS and raw["o"] == 0.25 and raw["leg"] is False
    assert smooth["meta"] == "smoothed" and smooth["y"] == pytest.approx(SMOOTHED, rel=1e-12)
    assert raw["c"] == smooth["c"] == "#1f77b4" and smooth["name"] == "train"
    # the drawn line follows the smoothed values: its last point sits at y = 127/31 on the axis
    assert _chart(page, "reward", "d._fullData[1].y[4]") == pytest.approx(127 / 31)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator("#chart-reward").screenshot(path=str(ARTIFACTS / "charts-smoothed-reward.png"))

    # log scale of one chart only; the mismatch KL chart starts on a log axis
    assert page.locator("#log-mismatch_kl").is_checked() and not page.locator("#log-loss").is_checked()
    page.locator("#log-loss").check()
    wait_for(lambda: _chart(page, "loss", "d._fullLayout.yaxis.type") == "log", 10, "loss on a log axis")
    assert _chart(page, "reward", "d._fullLayout.yaxis.type") == "linear"
    ticks = page.locator("#chart-loss .ytick text").all_text_contents()
    assert ticks == ["0.00001", "0.0001", "0.001", "0.01", "0.1"], ticks  # one tick a decade, plain numbers (~g)
    page.locator("#chart-loss").screenshot(path=str(ARTIFACTS / "charts-log-loss.png"))

    # both survive a reload and a live update (htmx redraw)
    page.reload()
    wait_for(lambda: _chart(page, "reward", "d.data.length") == 2, 10, "smoothing kept over a reload")
    assert page.locator("#smoothing").input_value() == "0.5" and page.locator("#log-loss").is_checked()
    assert _chart(page, "loss", "d._fullLayout.yaxis.type") == "log"
    _post(live_server, auth, run["id"], [6], [5.0])
    wait_for(lambda: _chart(page, "reward", "d.data[1].y.length") == 6, 15, "6 smoothed points after a poll")
    assert _chart(page, "reward", "d.data[1].y[5]") == pytest.approx(SIXTH, rel=1e-12)

    page.locator("#smoothing").fill("0")
    page.locator("#log-loss").uncheck()
    wait_for(lambda: _chart(page, "reward", "d.data.length") == 1, 10, "no smoothing: the raw line alone")
    assert _chart(page, "reward", "d.data[0].y") == [*REWARDS, 5.0]
    assert _chart(page, "loss", "d._fullLayout.yaxis.type") == "linear"


def _overlaps(page: Any, key: str) -> dict[str, Any]:
    """Bounding boxes of chart ``key``'s legend and axis titles, and which pairs intersect."""
    return dict(
        page.evaluate(
            """key => {
        const div = document.getElementById('chart-' + key);
        const box = sel => { const el = div.querySelector(sel); if (!el) return null;
          const r = el.getBoundingClientRect(); return r.width && r.height ? [r.left, r.top, r.right, r.bottom] : null };
        const hit = (a, b) => !!(a && b && a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3]);
        const legend = box('g.legend'), x = box('.g-xtitle'), y = box('.g-ytitle');
        return {legend, x, y, xtext: (div.querySelector('.g-xtitle') || {}).textContent,
                ytext: (div.querySelector('.g-ytitle') || {}).textContent, hits: [hit(legend, x), hit(legend, y)]};
      }""",
            key,
        )
    )


def test_legends_never_cover_the_axis_titles_and_axes_name_their_units(
    page: Any, login: Any, live_server: str, make_run: Any, auth: dict[str, str]
) -> None:
    a, b = make_run(name=f"legend-{secrets.token_hex(3)}-with-a-long-name"), make_run()
    for run in (a, b):
        pts = [
            {"source": src, "step": s, "name": n, "value": 0.1 * s, "time": time.time()}
            for s in range(1, 30)
            for src, n in (
                ("orchestrator", "reward_mean"),
                ("eval", "reward_mean"),
                ("orchestrator", "staleness_mean"),
                ("orchestrator", "staleness_max"),
                ("orchestrator", "dropped_stale"),
                ("trainer", "tokens_per_s"),
            )
        ]
        assert httpx.post(f"{live_server}/api/runs/{run['id']}/metrics", json={"points": pts}, headers=auth).is_success
    login(page, live_server, new_token(f"legend-{secrets.token_hex(3)}"))
    page.goto(f"{live_server}/compare?run={a['id']}&run={b['id']}")
    wait_for(lambda: _chart(page, "staleness", "d.data.length") == 6, 10, "6 staleness lines")
    units = {"reward": "reward per sample", "staleness": "policy versions; rollouts", "tokens_per_s": "tokens/s"}
    for key, unit in units.items():
        o = _overlaps(page, key)
        assert o["legend"] and o["x"] and o["y"], o  # all three drawn
        assert o["hits"] == [False, False], (key, o)
        assert (o["xtext"], o["ytext"]) == ("trainer step", unit)
    page.goto(f"{live_server}/runs/{a['id']}")
    wait_for(lambda: _chart(page, "staleness", "d.data.length") == 3, 10, "3 staleness lines")
    for key in ("reward", "staleness"):
        o = _overlaps(page, key)
        assert o["legend"] and o["hits"] == [False, False], (key, o)


def test_runs_table_columns_are_chosen_and_remembered(page: Any, login: Any, live_server: str, make_run: Any) -> None:
    tag = secrets.token_hex(3)
    make_run(name=f"pick-{tag}")
    login(page, live_server, new_token(f"pick-{tag}"))
    headers = "() => Array.from(document.querySelectorAll('table.runs th')).map(th => th.dataset.col)"
    assert page.evaluate(headers) == [
        "run",
        "status",
        "step",
        "reward",
        "best_eval",
        "trend",
        "duration",
        "steps_per_s",
        "age",
        "owner",
    ]
    page.locator("details.columns summary").click()
    for col in ("step", "reward", "age", "owner", "status"):
        page.locator(f"#col-{col}").uncheck()
    page.get_by_role("button", name="Show columns").click()
    page.wait_for_url("**/runs?*col=run*")
    assert page.evaluate(headers) == ["run", "best_eval", "trend", "duration", "steps_per_s"]
    page.goto(f"{live_server}/runs")  # no ?col=: the remembered choice is restored
    page.wait_for_url("**/runs?*col=best_eval*")
    assert page.evaluate(headers) == ["run", "best_eval", "trend", "duration", "steps_per_s"]
    page.get_by_label("Name contains").fill(f"pick-{tag}")
    page.get_by_role("button", name="Filter").click()  # the filter keeps the choice
    page.wait_for_url(f"**/runs?*q=pick-{tag}*")
    assert page.evaluate(headers) == ["run", "best_eval", "trend", "duration", "steps_per_s"]
    assert page.locator("tr[data-run-id]").count() == 1
