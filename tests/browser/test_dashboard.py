"""The dashboard in headless Chromium against uvicorn + Postgres: no-JS runs list, read-only token, CSRF,
inline spec errors, live charts and compare on stored metrics (the real-run flow: ``test_real_run.py``)."""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

import httpx
import pytest

from tests.support.server import new_token, wait_for

pytestmark = pytest.mark.browser


def test_runs_list_filters_without_javascript(nojs_page: Any, login: Any, live_server: str, make_run: Any) -> None:
    tag = secrets.token_hex(3)
    a, b = make_run(name=f"nojs-{tag}-a"), make_run(name=f"nojs-{tag}-b")
    page = nojs_page
    login(page, live_server, new_token(f"nojs-{tag}"))
    page.get_by_label("Name contains").fill(f"nojs-{tag}")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url(f"**/runs?status=&q=nojs-{tag}&tag=&group=")  # the tag and group filters, left empty
    assert page.locator("tr[data-run-id]").evaluate_all("rs => rs.map(r => r.dataset.runId)") == [
        str(b["id"]),
        str(a["id"]),
    ]
    page.get_by_role("link", name=f"#{a['id']} nojs-{tag}-a").click()
    page.wait_for_url(f"{live_server}/runs/{a['id']}")
    assert page.locator("#status-badge").inner_text() == "queued"
    page.get_by_role("button", name="Stop").click()  # a plain POST form with its CSRF field
    page.wait_for_url(f"{live_server}/runs/{a['id']}")
    assert page.locator("#status-badge").inner_text() == "cancelled"
    page.goto(f"{live_server}/runs?status=cancelled&q=nojs-{tag}")
    assert page.locator("tr[data-run-id]").evaluate_all("rs => rs.map(r => r.dataset.runId)") == [str(a["id"])]


def test_read_only_token_sees_no_write_buttons_and_a_forged_post_is_refused(
    page: Any, login: Any, live_server: str, make_run: Any
) -> None:
    run = make_run()
    login(page, live_server, new_token(f"reader-{secrets.token_hex(3)}", scope="read"))
    page.goto(f"{live_server}/runs/{run['id']}")
    assert page.locator(".who .badge").inner_text() == "read-only"
    for gone in ("button#stop", "button#fork", "a[href='/launch']", "#config-form", "textarea"):
        assert page.locator(gone).count() == 0, gone
    assert page.locator("#config-values").get_by_text("trainer.optim.lr").count() == 1
    assert page.locator("form[method=post]").evaluate_all("fs => fs.map(f => f.getAttribute('action'))") == ["/logout"]
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    status = page.evaluate(
        """async ([url, csrf]) => (await fetch(url, {method: "POST",
        body: new URLSearchParams({csrf})})).status""",
        [f"/runs/{run['id']}/stop", csrf],
    )
    assert status == 403
    page.reload()
    assert page.locator("#status-badge").inner_text() == "queued"


def test_read_only_token_gets_an_error_page_instead_of_the_launch_form(page: Any, login: Any, live_server: str) -> None:
    login(page, live_server, new_token(f"reader-{secrets.token_hex(3)}", scope="read"))
    resp = page.goto(f"{live_server}/launch")
    assert resp.status == 403
    assert page.locator("#page-error").inner_text().endswith("is read-only: it may only read (GET)")
    assert page.locator("textarea").count() == 0 and page.locator("form[action='/launch']").count() == 0
    page.get_by_role("link", name="Back").click()
    page.wait_for_url(f"{live_server}/runs")


def test_errors_are_html_pages_in_the_site_layout(page: Any, login: Any, live_server: str) -> None:
    login(page, live_server, new_token(f"errors-{secrets.token_hex(3)}"))
    resp = page.goto(f"{live_server}/runs/2000000000")  # typed URL: no referer, back goes to the runs list
    assert resp.status == 404 and resp.headers["content-type"].startswith("text/html")
    assert page.title() == "Error 404 · asyncrl"
    assert page.locator("#page-error").inner_text() == "run 2000000000 not found"
    assert page.get_by_role("navigation", name="main").get_by_role("link", name="Runs").count() == 1
    page.get_by_role("link", name="Back").click()
    page.wait_for_url(f"{live_server}/runs")
    resp = page.goto(f"{live_server}/alerts?run=x")
    assert resp.status == 422 and page.locator("#page-error").inner_text().startswith("run: expected a run id")
    api = page.request.get(f"{live_server}/api/runs/2000000000", headers={"Accept": "text/html"})
    assert api.status == 401 and api.json()["detail"].startswith("missing token")  # the API answers JSON


def test_post_without_csrf_is_403(page: Any, login: Any, live_server: str, make_run: Any) -> None:
    run = make_run()
    login(page, live_server, new_token(f"csrf-{secrets.token_hex(3)}"))
    page.goto(f"{live_server}/runs/{run['id']}")
    page.locator("form[action$='/stop'] input[name=csrf]").evaluate("el => el.remove()")
    with page.expect_response(lambda r: r.url.endswith("/stop")) as resp:
        page.get_by_role("button", name="Stop").click()
    assert resp.value.status == 403  # an HTML page in the site's layout, with a link back to the run page
    assert page.locator("#page-error").inner_text().startswith("csrf: missing or wrong form token")
    assert page.get_by_role("link", name="Back").get_attribute("href") == f"/runs/{run['id']}"
    page.goto(f"{live_server}/runs/{run['id']}")
    assert page.locator("#status-badge").inner_text() == "queued"


def test_launch_form_shows_the_error_at_the_offending_key(page: Any, login: Any, live_server: str) -> None:
    login(page, live_server, new_token(f"launch-{secrets.token_hex(3)}"))
    page.goto(f"{live_server}/launch")
    page.get_by_label("Config from configs/").select_option("reverse_text/rl.toml")
    page.get_by_role("button", name="Load").click()
    text = page.get_by_label("Run spec (TOML)").input_value()
    assert "max_off_policy_steps = 8" in text
    page.get_by_label("Run spec (TOML)").fill(text.replace("max_off_policy_steps = 8", "max_off_policy_steps = -1"))
    page.get_by_role("button", name="Launch").click()
    bad = page.locator("#bad-line")
    assert bad.locator("code").inner_text() == "max_off_policy_steps = -1"
    assert bad.locator("#spec-error").inner_text().startswith("orchestrator.max_off_policy_steps: ")
    assert page.get_by_label("Run spec (TOML)").get_attribute("aria-invalid") == "true"


def _chart(page: Any, key: str, expr: str) -> Any:
    return page.evaluate(
        f"() => {{ const d = document.getElementById('chart-{key}'); return d && d.data ? {expr} : null }}"
    )


def test_run_page_charts_update_live_and_compare_overlays(
    page: Any, login: Any, live_server: str, make_run: Any, auth: dict[str, str]
) -> None:
    a, b = make_run(max_steps=50), make_run(max_steps=60)

    def post(run: dict[str, Any], steps: range, reward: float) -> None:
        pts = [
            {"source": src, "step": s, "name": n, "value": v, "time": time.time()}
            for s in steps
            for src, n, v in (("orchestrator", "reward_mean", reward + 0.01 * s), ("trainer", "loss", 1.0 / s))
        ]
        r = httpx.post(f"{live_server}/api/runs/{run['id']}/metrics", json={"points": pts}, headers=auth)
        assert r.status_code == 200, r.text

    post(a, range(1, 4), 0.1)
    login(page, live_server, new_token(f"charts-{secrets.token_hex(3)}"))
    page.goto(f"{live_server}/runs/{a['id']}")
    wait_for(lambda: _chart(page, "reward", "d.data[0].x.length") == 3, 10, "3 reward points drawn")
    # a chart is drawn again only when its figure changed: polls that bring no new point (status, events, logs and
    # charts, every 3 s each) draw nothing; new points draw each chart they change once
    page.evaluate(
        "() => { window.drawn = []; const react = Plotly.react;"
        " Plotly.react = function (div) { window.drawn.push(div.id); return react.apply(this, arguments); }; }"
    )
    page.wait_for_timeout(7_000)
    assert page.evaluate("() => window.drawn") == []
    post(a, range(4, 9), 0.1)  # arrives while the page is open: htmx polling redraws
    wait_for(lambda: _chart(page, "reward", "d.data[0].x.length") == 8, 15, "8 reward points after a poll")
    page.wait_for_timeout(7_000)
    drawn = page.evaluate("() => window.drawn")
    assert {"chart-reward", "chart-loss"} <= set(drawn) and len(drawn) == len(set(drawn)), drawn
    assert _chart(page, "loss", "d.data[0].y[7]") == 1.0 / 8
    post(b, range(1, 6), 0.5)
    page.goto(f"{live_server}/compare")
    page.get_by_label(f"#{a['id']} {a['name']}").check()
    page.keyboard.press("Tab")
    page.get_by_label(f"#{b['id']} {b['name']}").check()
    page.get_by_role("button", name="Compare").click()
    wait_for(lambda: _chart(page, "reward", "d.data.length") == 2, 10, "two reward lines")
    # the runs in the list's order (newest first)
    assert _chart(page, "reward", "d.data.map(t => [t.name, t.x.length])") == [
        [f"#{b['id']} {b['name']} train", 5],
        [f"#{a['id']} {a['name']} train", 8],
    ]
    rows = page.locator("#config-diff tbody tr").evaluate_all(
        "rs => rs.map(r => Array.from(r.children).map(c => c.innerText))"
    )
    assert rows == [["max_steps", "60", "50"], ["name", b["name"], a["name"]]]


def test_run_page_draws_the_lag_histogram_as_stacked_bars(
    page: Any, login: Any, live_server: str, make_run: Any, auth: dict[str, str]
) -> None:
    """Case C20 on the run page: per step, one bar segment per lag bucket; step 2's 1 + 3 stack to its 4 samples."""
    run = make_run(max_steps=10)
    buckets = {"lag_hist/0": [4, 1], "lag_hist/1": [0, 3], "lag_hist/8plus": [0, 0]}
    pts = [
        {"source": "orchestrator", "step": step, "name": name, "value": counts[step - 1], "time": time.time()}
        for name, counts in buckets.items()
        for step in (1, 2)
    ]
    r = httpx.post(f"{live_server}/api/runs/{run['id']}/metrics", json={"points": pts}, headers=auth)
    assert r.status_code == 200, r.text
    login(page, live_server, new_token(f"lag-{secrets.token_hex(3)}"))
    page.goto(f"{live_server}/runs/{run['id']}")
    wait_for(lambda: _chart(page, "lag_hist", "d.data.length") == 3, 10, "three lag buckets drawn")
    assert _chart(page, "lag_hist", "d.layout.barmode") == "stack"
    assert _chart(page, "lag_hist", "d.data.map(t => [t.type, t.name, t.y])") == [
        ["bar", "lag 0", [4, 1]],
        ["bar", "lag 1", [0, 3]],
        ["bar", "lag 8+", [0, 0]],
    ]


def test_docs_draw_the_api_with_every_request_outside_the_app_blocked(page: Any, live_server: str) -> None:
    """``/docs`` offline: a request to any other host is aborted (and recorded); Swagger UI still draws the API."""
    outside: list[str] = []

    def only_the_app(route: Any) -> None:
        if route.request.url.startswith(f"{live_server}/"):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_app)
    page.goto(f"{live_server}/docs")
    page.locator(".opblock-summary-path[data-path='/api/runs']").first.wait_for()
    assert page.locator(".info .title").inner_text().startswith("asyncrl")
    assert page.locator(".opblock").count() == sum(
        len(ops) for ops in httpx.get(f"{live_server}/openapi.json").json()["paths"].values()
    )
    assert outside == []


def test_axis_numbers_are_plain_numbers_without_si_prefixes(
    page: Any, login: Any, live_server: str, make_run: Any, auth: dict[str, str]
) -> None:
    """A loss of 1e-05 to 3e-05 over steps 10000-30000: ticks read 0.00002 and 20000, never 20µ or 20k."""
    run = make_run(max_steps=50000)
    pts = [
        {"source": "trainer", "step": s, "name": "loss", "value": s * 1e-9, "time": time.time()}
        for s in (10000, 20000, 30000)
    ]
    assert (
        httpx.post(f"{live_server}/api/runs/{run['id']}/metrics", json={"points": pts}, headers=auth).status_code == 200
    )
    login(page, live_server, new_token(f"ticks-{secrets.token_hex(3)}"))
    page.goto(f"{live_server}/runs/{run['id']}")
    page.locator("#chart-loss .ytick text").first.wait_for()
    y = page.locator("#chart-loss .ytick text").all_text_contents()
    x = page.locator("#chart-loss .xtick text").all_text_contents()
    assert y and x and all(re.fullmatch(r"[0-9.e+-]+", t) for t in y + x), (y, x)  # no µ, m or k
    assert "0.00002" in y and "20000" in x, (y, x)
