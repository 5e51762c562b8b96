"""The dashboard's server side on the real Postgres: login, CSRF, read tokens, runs list, launch errors, run page,
live config diff, compare; and its pure helpers (bottleneck verdict, TOML key lines) with hand-made numbers."""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

import pytest
from sqlmodel import Session, func, select

from server.core.db import engine
from server.models import DashboardSession, MetricSeries
from tests.support.server import new_token, sft_data, spec
from tests.support.webui import csrf_of, login
from webui import figures
from webui.launch import error_line, key_line

# ----------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("batch", "policy", "verdict"),
    [
        (0.60, 0.05, "inference-bound"),
        (0.05, 0.40, "trainer-bound"),
        (0.10, 0.20, "balanced"),
        (0.30, 0.30, "balanced"),
        (0.25, 0.0, "inference-bound"),
        (0.0, 0.25, "trainer-bound"),
        (0.24, 0.0, "balanced"),
    ],
)
def test_bottleneck_verdict_rule(batch: float, policy: float, verdict: str) -> None:
    assert figures.bottleneck_verdict(batch, policy) == verdict


def _series(source: str, steps: list[int], values: list[float]) -> MetricSeries:
    return MetricSeries(source=source, total=len(steps), step=steps, value=values, time=[0.0] * len(steps))


def test_bottleneck_shares_use_the_last_window_of_steps() -> None:
    steps = list(range(1, 31))
    series = {
        ("trainer", "step_time_s"): _series("trainer", steps, [2.0] * 30),
        # steps 1-10 the trainer waits 1.8 s of 2 s (90%), steps 11-30 only 0.2 s (10%)
        ("trainer", "wait_for_batch_s"): _series("trainer", steps, [1.8] * 10 + [0.2] * 20),
        # the orchestrator waits 1 s (50%) from step 11 on; step 30 lacks it
        ("orchestrator", "wait_for_policy_s"): _series("orchestrator", steps[:29], [0.0] * 10 + [1.0] * 19),
    }
    bn = figures.bottleneck(series)
    assert bn.steps == list(range(1, 30))
    assert bn.batch_share[:2] == [0.9, 0.9] and bn.policy_share[-1] == 0.5
    # last 20 steps with all three metrics: 10..29 -> batch (0.9 + 19 * 0.1) / 20 = 0.14, policy 19 * 0.5 / 20
    assert bn.mean_batch_share == pytest.approx(0.14) and bn.mean_policy_share == pytest.approx(0.475)
    assert bn.verdict == "trainer-bound" and bn.advice[0] == "move GPUs from inference to the trainer"
    assert figures.bottleneck({}).verdict is None


def test_lag_histogram_chart_stacks_the_buckets_per_step() -> None:
    # two steps: step 1 trained 4 samples at lag 0; step 2 trained 1 at lag 0 and 3 at lag 1 (C20: 4 each)
    series = {
        ("orchestrator", name): _series("orchestrator", [1, 2], values)
        for name, values in [("lag_hist/0", [4.0, 1.0]), ("lag_hist/1", [0.0, 3.0]), ("lag_hist/8plus", [0.0, 0.0])]
    }
    fig = figures.run_figures(series, [])["lag_hist"]
    assert fig["layout"]["barmode"] == "stack"
    assert [(t["type"], t["name"], t["y"]) for t in fig["data"]] == [
        ("bar", "lag 0", [4.0, 1.0]),
        ("bar", "lag 1", [0.0, 3.0]),
        ("bar", "lag 8+", [0.0, 0.0]),
    ]
    assert ("orchestrator", "lag_hist/4-7") in figures.SERIES_KEYS  # loaded with the other series of the run page


def test_inference_bound_advice_names_the_key_that_widens_the_async_window() -> None:
    """Rollouts for step n start once inference serves version >= n - 1 - min(max_async_level, max_off_policy_steps)
    (worker/orchestrator/staleness.py): max_async_level is what lets inference run ahead, up to max_off_policy_steps."""
    advice = figures.ADVICE["inference-bound"]
    ahead = [a for a in advice if "further ahead" in a]
    assert len(ahead) == 1 and ahead[0].startswith("raise orchestrator.max_async_level ")
    assert not any(a.startswith("raise orchestrator.max_off_policy_steps") for a in advice)


def test_key_line_finds_the_offending_key() -> None:
    text = 'name = "x"\nmax_steps = 3\n\n[orchestrator]\nbatch_size = 8\ngroup_size = 0  # bad\n\n[env]\nargs = { a = 1 }\n'
    assert key_line(text, "orchestrator.group_size") == 6
    assert key_line(text, "max_steps") == 2
    assert key_line(text, "env.args.a") == 9
    assert key_line(text, "orchestrator.seq_len") == 4  # not set: its table
    assert key_line(text, "model.name") is None
    assert key_line("[trainer]\noptim . lrr = 1\n", "trainer.optim.lrr") == 2  # spaces around a dotted key's dots


def test_error_line_of_toml_syntax_and_unknown_key_errors() -> None:
    import tomllib

    from worker.spec import SpecError

    def toml_error(text: str) -> tomllib.TOMLDecodeError:
        with pytest.raises(tomllib.TOMLDecodeError) as err:
            tomllib.loads(text)
        return err.value

    text = 'name = "x"\n[trainer]\noptim.lrr = 1\n'
    assert error_line(text, SpecError("unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)")) == 3
    assert error_line(text, SpecError("unknown key 'trainer' (did you mean 'trainers'?)")) == 2
    assert error_line(text, SpecError("trainer.optim.lrr: Input should be a number")) == 3
    assert error_line(text, SpecError("unknown key 'model.nam' (valid keys here: name)")) is None
    assert error_line("a = 1\nb = 2\nbad line\n", toml_error("a = 1\nb = 2\nbad line\n")) == 3
    assert error_line('name = "x"\nmax_steps = [\n', toml_error('name = "x"\nmax_steps = [\n')) == 2


# ----------------------------------------------------------------------------- login, CSRF, scopes


def test_pages_need_login_and_a_bad_token_is_refused(client: Any) -> None:
    client.cookies.clear()
    resp = client.get("/runs?status=failed", follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == "/login?next=%2Fruns%3Fstatus%3Dfailed"
    form = client.get("/login").text
    resp = client.post("/login", data={"csrf": csrf_of(form), "token": "asr_nope", "next": "/runs"})
    assert resp.status_code == 401 and "token: invalid token" in resp.text
    resp = client.post("/login", data={"token": "asr_nope"})  # no CSRF token: still the token's answer (a 401)
    assert resp.status_code == 401 and "token: invalid token" in resp.text
    client.cookies.clear()  # a browser that never loaded the login page (no session cookie, no CSRF token)
    resp = client.post("/login", data={"token": "asr_nope", "next": "/runs"}, headers={"accept": "text/html"})
    assert resp.status_code == 401 and 'id="page-error">token: invalid token' in resp.text
    good = new_token(f"login-{secrets.token_hex(3)}")
    with Session(engine) as s:
        before = s.exec(select(func.count()).select_from(DashboardSession)).one()
    resp = client.post("/login", data={"token": good}, follow_redirects=False)  # a good token needs the CSRF token
    assert resp.status_code == 403 and resp.json()["detail"].startswith("csrf:")
    with Session(engine) as s:
        assert s.exec(select(func.count()).select_from(DashboardSession)).one() == before  # no session stored


def test_csrf_missing_or_wrong_is_403_and_nothing_is_written(web: tuple[Any, str], make_run: Any) -> None:
    client, csrf = web
    run = make_run()
    wrong = csrf[:-1] + (
        "y" if csrf.endswith("x") else "x"
    )  # never the token itself (csrf[:-2] + "xx" was, 1 in 4,096)
    for data in ({}, {"csrf": wrong}):
        resp = client.post(f"/runs/{run['id']}/stop", data=data)
        assert resp.status_code == 403, resp.text
        assert resp.json() == {"detail": "csrf: missing or wrong form token; reload the page and try again"}
    assert 'id="status-badge">queued<' in client.get(f"/runs/{run['id']}", params={"part": "status"}).text
    resp = client.post(f"/runs/{run['id']}/stop", data={"csrf": csrf}, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == f"/runs/{run['id']}"
    assert 'id="status-badge">cancelled<' in client.get(f"/runs/{run['id']}").text


def test_read_token_sees_no_write_buttons_and_its_forged_posts_are_403(client: Any, make_run: Any) -> None:
    run = make_run()
    csrf = login(client, new_token(f"reader-{secrets.token_hex(3)}", scope="read"))
    page = client.get(f"/runs/{run['id']}").text
    assert "read-only" in page
    for needle in (f'action="/runs/{run["id"]}/stop"', "Review change", 'href="/launch"', 'id="fork"'):
        assert needle not in page
    for url, data in (
        (f"/runs/{run['id']}/stop", {}),
        ("/launch", {"spec": 'name = "x"'}),
        (f"/runs/{run['id']}/config", {"trainer.optim.lr": "0.5"}),
    ):
        resp = client.post(url, data={"csrf": csrf, **data})
        assert resp.status_code == 403 and "is read-only" in resp.json()["detail"], (url, resp.text)
    assert 'id="status-badge">queued<' in client.get(f"/runs/{run['id']}").text


def test_read_token_gets_no_launch_form_and_no_config_form(client: Any, make_run: Any) -> None:
    run = make_run()
    login(client, new_token(f"reader-{secrets.token_hex(3)}", scope="read"))
    resp = client.get("/launch", params={"config": "reverse_text/rl.toml"}, headers={"Accept": "text/html"})
    assert resp.status_code == 403
    assert 'id="page-error">token &#39;reader-' in resp.text and "is read-only: it may only read" in resp.text
    assert 'action="/launch"' not in resp.text and "<textarea" not in resp.text
    page = client.get(f"/runs/{run['id']}").text
    assert 'id="config-values"' in page and 'id="config-form"' not in page and "<textarea" not in page
    assert re.search(r"<code>trainer.optim.lr</code> <small>\(trainer\)</small></th><td>0.0001</td>", page), page
    assert not re.findall(r'<form method="post" action="(?!/logout)', page)  # the only POST form is Log out
    alerts = client.get("/alerts").text
    assert not re.findall(r'<form method="post" action="(?!/logout)', alerts)


def test_dashboard_errors_are_html_pages_for_browsers_and_json_for_api_clients(
    client: Any, make_run: Any, auth: dict[str, str]
) -> None:
    run = make_run()
    csrf = login(client, new_token(f"web-{secrets.token_hex(3)}"))
    html = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    referer = {"Referer": f"http://testserver/runs/{run['id']}"}
    cases = [  # (method, url, form, status, message)
        ("GET", "/runs/2000000000", None, 404, "run 2000000000 not found"),
        (
            "GET",
            "/runs/abc",
            None,
            422,
            "path.run_id: Input should be a valid integer, unable to parse string as an integer",
        ),
        ("GET", "/runs?status=nope", None, 422, "status: expected one of queued, "),
        ("GET", "/alerts/webhooks/2000000000", None, 404, "webhook endpoint 2000000000 not found"),
        (
            "POST",
            f"/runs/{run['id']}/stop",
            {},
            403,
            "csrf: missing or wrong form token; reload the page and try again",
        ),
        (
            "POST",
            "/alerts/rules/2000000000/enabled",
            {"csrf": csrf, "enabled": "1"},
            404,
            "alert rule 2000000000 not found",
        ),
    ]
    for method, url, form, status, message in cases:
        resp = client.request(method, url, data=form, headers={**html, **referer})
        assert resp.status_code == status and resp.headers["content-type"].startswith("text/html"), (url, resp.text)
        assert f"<title>Error {status} · asyncrl</title>" in resp.text and '<header class="top">' in resp.text
        assert 'href="/compare">Compare</a>' in resp.text  # the site's layout, logged-in navigation included
        shown = re.search(r'<p class="error" role="alert" id="page-error">([^<]*)</p>', resp.text)
        assert shown and shown.group(1).replace("&#39;", "'").startswith(message), (url, resp.text)
        assert f'<a href="/runs/{run["id"]}" id="back">Back</a>' in resp.text
        # the same request from an API client (TestClient's Accept: */*) or an htmx fragment request: JSON
        for headers in ({}, {**html, "HX-Request": "true"}):
            resp = client.request(method, url, data=form, headers=headers)
            assert resp.status_code == status and resp.json()["detail"].startswith(message), (url, resp.text)
    # no referer (a typed URL): back to the runs list; the API keeps JSON whatever the Accept header says
    resp = client.get("/runs/2000000000", headers=html)
    assert resp.status_code == 404 and '<a href="/runs" id="back">Back</a>' in resp.text
    resp = client.get("/api/runs/2000000000", headers={**html, **auth})
    assert resp.status_code == 404 and resp.json() == {"detail": "run 2000000000 not found"}
    # a redirect to the login page stays a redirect
    client.cookies.clear()
    resp = client.get(f"/runs/{run['id']}", headers=html, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"].startswith("/login?next=")


def test_logout_ends_the_session(web: tuple[Any, str]) -> None:
    client, csrf = web
    assert client.post("/logout", data={"csrf": csrf}, follow_redirects=False).headers["location"] == "/login"
    assert client.get("/runs", follow_redirects=False).status_code == 303


# ----------------------------------------------------------------------------- pages


def test_runs_list_filters_by_status_and_name_without_javascript(web: tuple[Any, str], make_run: Any) -> None:
    client, csrf = web
    tag = secrets.token_hex(3)
    a, b = make_run(name=f"filter-{tag}-a"), make_run(name=f"filter-{tag}-b")
    client.post(f"/runs/{b['id']}/stop", data={"csrf": csrf})
    page = client.get("/runs", params={"q": f"filter-{tag}"}).text
    assert re.findall(r'data-run-id="(\d+)"', page) == [str(b["id"]), str(a["id"])]
    page = client.get("/runs", params={"q": f"filter-{tag}", "status": "cancelled"}).text
    assert re.findall(r'data-run-id="(\d+)"', page) == [str(b["id"])]
    assert '<span id="runs-count">1</span>' in page and "<html" in page
    fragment = client.get("/runs", params={"q": f"filter-{tag}"}, headers={"HX-Request": "true"}).text
    assert "<html" not in fragment and len(re.findall(r"data-run-id", fragment)) == 2
    assert client.get("/runs", params={"status": "nope"}).status_code == 422


def test_launch_shows_the_spec_error_at_its_line(web: tuple[Any, str]) -> None:
    client, csrf = web
    page = client.get("/launch", params={"config": "reverse_text/rl.toml"}).text
    assert '<option value="reverse_text/rl.toml" selected>' in page and "max_off_policy_steps = 8" in page
    text = 'name = "bad"\nmax_steps = 3\n[model]\nname = "m"\n[orchestrator]\ngroup_size = 0\n'
    resp = client.post("/launch", data={"csrf": csrf, "spec": text})
    assert resp.status_code == 422
    bad = re.search(
        r'<li value="(\d+)" class="bad" id="bad-line"><code>([^<]*)</code>\s*<p class="inline-error" '
        r'role="alert" id="spec-error">([^<]*)</p>',
        resp.text,
    )
    assert bad and bad.group(1) == "6" and bad.group(2) == "group_size = 0", resp.text
    assert bad.group(3).startswith("orchestrator.group_size:")
    resp = client.post("/launch", data={"csrf": csrf, "spec": 'name = "x"\nmax_steps = [\n'})
    assert resp.status_code == 422 and 'id="spec-error">TOML: ' in resp.text


def _marked(html: str) -> tuple[int, str, str]:
    """(line number, line text, error) of the launch page's marked line."""
    bad = re.search(
        r'<li value="(\d+)" class="bad" id="bad-line"><code>([^<]*)</code>\s*<p class="inline-error" '
        r'role="alert" id="spec-error">([^<]*)</p>',
        html,
    )
    assert bad, html
    return int(bad.group(1)), bad.group(2), bad.group(3)


@pytest.mark.parametrize(
    ("text", "line", "error"),
    [
        (
            'name = "bad"\nmax_steps = 3\n[model]\nname = "m"\n[orchestrator]\nbatch_sise = 8\n',
            6,
            "unknown key &#39;orchestrator.batch_sise&#39; (did you mean &#39;orchestrator.batch_size&#39;?) (line 6)",
        ),
        (
            'name = "bad"\nmax_step = 3\n[model]\nname = "m"\n',
            2,
            "unknown key &#39;max_step&#39; (did you mean &#39;max_steps&#39;?) (line 2)",
        ),
        (
            'name = "bad"\nmax_steps = 3\ntrainer.optim.lrr = 1e-5\n[model]\nname = "m"\n',
            3,
            "unknown key &#39;trainer.optim.lrr&#39; (did you mean &#39;trainer.optim.lr&#39;?) (line 3)",
        ),
        (
            'name = "bad"\nmax_steps = 3\n[orchestrater]\nbatch_size = 8\n',
            3,
            "unknown key &#39;orchestrater&#39; (did you mean &#39;orchestrator&#39;?) (line 3)",
        ),
        (
            'name = "bad"\nmax_steps = 3\nbatch size = 8\n',
            3,
            "TOML: Expected &#39;=&#39; after a key in a key/value pair (at line 3, column 7)",
        ),
        ('name = "bad"\nmax_steps = [\n', 2, "TOML: Invalid value (at end of document)"),
        (
            'name = "mine"\nmax_steps = 3\noutput_dir = "/tmp/mine"\n[model]\nname = "m"\n',
            3,
            "output_dir: the service chooses the run folder (&lt;ASYNCRL_OUTPUT_DIR&gt;/runs/&lt;id&gt;/&lt;name&gt;); "
            "leave output_dir out of a submitted spec (line 3)",
        ),
    ],
)
def test_launch_marks_unknown_keys_and_toml_syntax_errors_at_their_line(
    web: tuple[Any, str], text: str, line: int, error: str
) -> None:
    client, csrf = web
    resp = client.post("/launch", data={"csrf": csrf, "spec": text})
    assert resp.status_code == 422
    assert _marked(resp.text) == (line, text.splitlines()[line - 1].replace('"', "&#34;"), error)
    assert 'aria-invalid="true"' in resp.text


def test_launch_queues_the_run_and_redirects_to_its_page(web: tuple[Any, str]) -> None:
    client, csrf = web
    name = f"web-launch-{secrets.token_hex(3)}"
    text = f'name = "{name}"\nmax_steps = 3\n[model]\nname = "{spec()["model"]["name"]}"\n'
    resp = client.post("/launch", data={"csrf": csrf, "spec": text}, follow_redirects=False)
    assert resp.status_code == 303, resp.text
    run_id = int(resp.headers["location"].rsplit("/", 1)[1])
    page = client.get(f"/runs/{run_id}").text
    assert f"#{run_id} {name}" in page and "data-figures" in page and 'id="chart-mismatch_kl"' in page


def test_run_page_figures_marks_rollouts_and_config_diff(web: tuple[Any, str], make_run: Any, auth: Any) -> None:
    from tests.support.server import run_token_headers

    client, csrf = web
    run = make_run()
    rid = run["id"]
    now = time.time()
    points = [
        {"source": src, "step": s, "name": n, "value": v, "time": now}
        for s in (1, 2, 3)
        for src, n, v in (
            ("trainer", "loss", 0.5 / s),
            ("trainer", "mismatch_kl", 2e-4 * s),
            ("trainer", "step_time_s", 2.0),
            ("trainer", "wait_for_batch_s", 1.5),
            ("orchestrator", "wait_for_policy_s", 0.1),
            ("orchestrator", "reward_mean", 0.1 * s),
        )
    ]
    assert client.post(f"/api/runs/{rid}/metrics", json={"points": points}, headers=auth).status_code == 200
    # preview: the diff, nothing stored yet
    resp = client.post(
        f"/runs/{rid}/config", data={"csrf": csrf, "trainer.optim.lr": "5e-5", "orchestrator.temperature": "1.0"}
    )
    assert resp.status_code == 200
    assert re.search(
        r"<code>trainer.optim.lr</code></th><td class=\"old\">0.0001</td><td class=\"new\">5e-05</td>", resp.text
    ), resp.text
    assert client.get(f"/api/runs/{rid}/config", headers=auth).json()["revision"] == 0
    # the form has the live keys of this run's loss (dppo_kl) only: no ipo epsilon, no icepop band
    form = client.get(f"/runs/{rid}").text
    assert 'id="live-trainer-loss-kl_tau"' in form and 'id="live-orchestrator-group_size"' in form, form
    assert "live-trainer-loss-epsilon" not in form and "live-trainer-loss-band" not in form
    # a bad value: inline at its field
    resp = client.post(f"/runs/{rid}/config", data={"csrf": csrf, "orchestrator.max_tokens": "-3"})
    assert resp.status_code == 422
    assert re.search(r'id="live-orchestrator-max_tokens-error">orchestrator.max_tokens: ', resp.text), resp.text
    # confirm: applied through the PATCH service; the trainer acks at step 2 -> marker on every chart
    resp = client.post(
        f"/runs/{rid}/config", data={"csrf": csrf, "confirm": "1", "trainer.optim.lr": "5e-05"}, follow_redirects=False
    )
    assert resp.status_code == 303
    ack = client.post(
        f"/api/runs/{rid}/config/1/ack", json={"process": "trainer", "step": 2}, headers=run_token_headers(rid)
    )
    assert ack.status_code == 200, ack.text
    html = client.get(f"/runs/{rid}", params={"part": "charts"}).text
    figs = __import__("json").loads(re.search(r"data-figures>(.*?)</script>", html, re.S).group(1))
    assert figs["loss"]["data"][0]["x"] == [1, 2, 3] and figs["loss"]["data"][0]["y"] == [0.5, 0.25, 0.5 / 3]
    assert [a["text"] for a in figs["loss"]["layout"]["annotations"]] == ["r1 trainer"]
    assert [a["text"] for a in figs["lr"]["layout"]["annotations"]] == ["r1 trainer", "No data yet"]  # no lr posted
    assert all(f["layout"]["shapes"][0]["x0"] == 2 for f in figs.values())
    kl = figs["mismatch_kl"]["data"]
    assert kl[-1]["name"] == "alert threshold 0.001" and kl[-1]["y"] == [1e-3, 1e-3] and kl[-1]["x"] == [1, 3]
    assert figs["bottleneck"]["data"][0]["y"] == [0.75, 0.75, 0.75]
    assert '<strong id="verdict">inference-bound</strong>' in html


def test_sft_run_page_draws_its_loss_and_offers_no_live_config_or_fork(
    web: tuple[Any, str], make_run: Any, auth: Any
) -> None:
    """An SFT run logs under source ``sft`` (``worker/trainer/sft.py``): its loss, held-out loss, lr and tokens/s are
    drawn on the run page's charts; it has no live keys and no fork (both refused for SFT), so neither form shows."""
    import json

    client, _ = web
    data = sft_data()
    run = make_run(kind="sft", data={"path": data})
    rid, now = run["id"], time.time()
    points = [
        {"source": "sft", "step": s, "name": n, "value": v, "time": now}
        for s in (1, 2, 3)
        for n, v in (("loss", 2.0 / s), ("lr", 1e-3), ("tokens_per_s", 100.0 * s))
    ]
    points.append({"source": "sft", "step": 3, "name": "eval_loss", "value": 0.9, "time": now})
    assert client.post(f"/api/runs/{rid}/metrics", json={"points": points}, headers=auth).status_code == 200
    html = client.get(f"/runs/{rid}", params={"part": "charts"}).text
    figs = json.loads(re.search(r"data-figures>(.*?)</script>", html, re.S).group(1))
    loss = {t["name"]: (t["x"], t["y"]) for t in figs["loss"]["data"]}
    assert loss == {"sft loss": ([1, 2, 3], [2.0, 1.0, 2.0 / 3]), "held-out": ([3], [0.9])}
    assert [(t["name"], t["y"]) for t in figs["lr"]["data"]] == [("sft lr", [1e-3, 1e-3, 1e-3])]
    assert [(t["name"], t["y"]) for t in figs["tokens_per_s"]["data"]] == [("sft tokens/s", [100.0, 200.0, 300.0])]
    page = client.get(f"/runs/{rid}").text
    assert 'id="no-live-config">An sft run has no live config' in page
    assert 'id="config-form"' not in page and 'id="fork-panel"' not in page and 'name="trainer.optim.lr"' not in page


def test_fork_form_is_outside_every_refreshed_fragment(web: tuple[Any, str], make_run: Any) -> None:
    """What is typed in the fork form must survive the page's polling: no ``?part=`` fragment (each replaces its
    block every few seconds) holds it, and on the page it sits in no block with ``hx-get``."""
    from webui.run_page import PARTS

    client, _ = web
    rid = make_run()["id"]
    for part in PARTS:
        fragment = client.get(f"/runs/{rid}", params={"part": part}).text
        assert 'id="fork-changes"' not in fragment and "/fork" not in fragment, part
    page = client.get(f"/runs/{rid}").text
    assert page.count('id="fork-changes"') == 1
    assert _ancestors_of(page, "fork-changes")[:2] == [("form", ""), ("details", "")]  # no hx-get anywhere above
    assert all(hx == "" for _, hx in _ancestors_of(page, "fork-changes")), _ancestors_of(page, "fork-changes")
    assert any(hx == f"/runs/{rid}?part=status" for _, hx in _ancestors_of(page, "stop"))  # the check sees hx-get


def _ancestors_of(html: str, element_id: str) -> list[tuple[str, str]]:
    """(tag, its hx-get or "") of every element enclosing the element with ``element_id``, innermost first."""
    from html.parser import HTMLParser

    void = {"input", "br", "img", "meta", "link", "hr", "source", "col", "area", "base", "wbr", "embed", "track"}

    class Walk(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.stack: list[tuple[str, str]] = []
            self.found: list[tuple[str, str]] | None = None

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            a = dict(attrs)
            if a.get("id") == element_id and self.found is None:
                self.found = self.stack[::-1]
            if tag not in void:
                self.stack.append((tag, a.get("hx-get") or ""))

        def handle_endtag(self, tag: str) -> None:
            for i in range(len(self.stack) - 1, -1, -1):
                if self.stack[i][0] == tag:
                    del self.stack[i:]
                    break

    walk = Walk()
    walk.feed(html)
    assert walk.found is not None, element_id
    return walk.found


def test_rollouts_api_and_fragment_read_the_run_dir(web: tuple[Any, str], make_run: Any, auth: Any) -> None:
    from worker.run.rundir import RunDir, append_jsonl

    client, _ = web
    run = make_run()
    rd = RunDir(run["run_dir"])
    rd.rollouts.mkdir(parents=True)
    for step in (1, 2):
        for i in range(3):
            append_jsonl(
                rd.rollout_file(step),
                {"step": step, "task": f"abc{i}", "completion": f"cba{i}", "reward": 0.25 * i, "advantage": i - 1.0},
            )
    data = client.get(f"/api/runs/{run['id']}/rollouts", params={"limit": 2}, headers=auth).json()
    assert data["step"] == 2 and [r["completion"] for r in data["data"]] == ["cba0", "cba1"]
    assert client.get(f"/api/runs/{run['id']}/rollouts", params={"step": 9}, headers=auth).json()["data"] == []
    html = client.get(f"/runs/{run['id']}", params={"part": "rollouts"}).text
    assert "Step 2 (first 3)" in html and '<td class="num">0.500</td><td class="num">1.000</td>' in html


def test_compare_overlays_runs_and_diffs_their_specs(web: tuple[Any, str], make_run: Any, auth: Any) -> None:
    client, _ = web
    a, b = make_run(max_steps=3), make_run(max_steps=7)
    for run, v in ((a, 0.1), (b, 0.2)):
        pts = [{"source": "orchestrator", "step": 1, "name": "reward_mean", "value": v, "time": 1.0}]
        client.post(f"/api/runs/{run['id']}/metrics", json={"points": pts}, headers=auth)
    html = client.get("/compare", params=[("run", a["id"]), ("run", b["id"])]).text
    rows = re.findall(r'<tr><th scope="row"><code>([^<]+)</code></th>((?:<td>[^<]*</td>)+)</tr>', html)
    assert [(k, re.findall(r"<td>([^<]*)</td>", v)) for k, v in rows] == [
        ("max_steps", ["3", "7"]),
        ("name", [a["name"], b["name"]]),
    ]
    figs = __import__("json").loads(re.search(r"data-figures>(.*?)</script>", html, re.S).group(1))
    assert [(t["name"], t["y"]) for t in figs["reward"]["data"]] == [
        (f"#{a['id']} {a['name']} train", [0.1]),
        (f"#{b['id']} {b['name']} train", [0.2]),
    ]


def test_resume_and_fork_errors_show_on_the_run_page(web: tuple[Any, str], make_run: Any) -> None:
    client, csrf = web
    run = make_run()
    rid = run["id"]
    resp = client.post(f"/runs/{rid}/resume", data={"csrf": csrf})
    assert resp.status_code == 409
    assert f'id="page-error">run {rid} is queued: only failed or cancelled runs resume</p>' in resp.text
    resp = client.post(f"/runs/{rid}/fork", data={"csrf": csrf, "changes": "trainer.optim.lr = ", "step": ""})
    assert resp.status_code == 422 and 'id="page-error">changes: not valid TOML (' in resp.text
    for step in ("²", "-1", "4.0"):  # "²".isdigit() is True but int("²") raises: a 422, not a 500
        resp = client.post(f"/runs/{rid}/fork", data={"csrf": csrf, "changes": "", "step": step})
        want = f'id="page-error">step: expected a checkpoint step (a whole number), got &#39;{step}&#39;'
        assert resp.status_code == 422 and want in resp.text
    resp = client.post(f"/runs/{rid}/fork", data={"csrf": csrf, "changes": "", "name": "x" * 200})
    assert resp.status_code == 422 and 'id="page-error">name: String should have at most 128 characters' in resp.text
    resp = client.post(f"/runs/{rid}/fork", data={"csrf": csrf, "changes": "max_steps = 9"})
    assert resp.status_code == 409 and f'id="page-error">run {rid}: no complete checkpoint in ' in resp.text


def _fail(run_id: int, reason: str) -> None:
    """Move run ``run_id`` through starting and running to ``failed`` with ``reason`` (no launch happens here)."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.models import RunStatus
    from server.services import runs

    with Session(engine) as s:
        run = runs.get(s, run_id)
        for status in (RunStatus.starting, RunStatus.running):
            runs.transition(s, run, status)
        runs.transition(s, run, RunStatus.failed, reason=reason)
        s.commit()


def test_a_failed_run_page_opens_the_failed_process_log_and_offers_resume_only_with_a_checkpoint(
    web: tuple[Any, str], make_run: Any
) -> None:
    from pathlib import Path

    client, _ = web
    run = make_run()
    rid, run_dir = run["id"], Path(run["run_dir"])
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs" / "trainer.log").write_text("trainer step 3 done\n")
    (run_dir / "logs" / "orchestrator.log").write_text("Traceback: KeyError 'answer'\n")
    _fail(rid, f"orchestrator exited with code 1: KeyError (log: {run_dir / 'logs' / 'orchestrator.log'})")

    html = client.get(f"/runs/{rid}").text
    assert 'aria-label="orchestrator log, last 1 lines">Traceback: KeyError &#39;answer&#39;</pre>' in html
    assert "<option selected>orchestrator</option>" in html
    assert f'hx-get="/runs/{rid}?part=logs&process=orchestrator"' in html  # the refresh keeps the same process
    assert 'id="resume"' not in html  # no complete checkpoint: resume would be refused
    assert 'id="no-resume">No complete checkpoint: nothing to resume from.</span>' in html
    # the process asked for is shown; an unknown one is a 422
    assert (
        'aria-label="trainer log, last 1 lines">trainer step 3 done</pre>'
        in client.get(f"/runs/{rid}?process=trainer").text
    )
    assert client.get(f"/runs/{rid}?process=vllm").status_code == 422

    for part in ("trainer", "orchestrator"):  # a complete checkpoint of step 2
        folder = run_dir / "checkpoints" / "step_2" / part
        folder.mkdir(parents=True)
        (folder / ".complete").write_text("2")
    status = client.get(f"/runs/{rid}?part=status").text
    assert 'id="resume">Resume</button>' in status and 'id="no-resume"' not in status

    # a failed run whose reason names no process opens on the trainer
    other = make_run()
    _fail(other["id"], "launch refused: no worker")
    assert "<option selected>trainer</option>" in client.get(f"/runs/{other['id']}").text


def test_a_run_without_metrics_shows_the_no_data_note_on_every_chart(web: tuple[Any, str], make_run: Any) -> None:
    import json

    client, _ = web
    rid = make_run()["id"]
    html = client.get(f"/runs/{rid}?part=charts").text
    figs = json.loads(re.search(r"<script type=\"application/json\" data-figures>(.*?)</script>", html, re.S)[1])
    assert len(figs) == len(figures.CHARTS) + 1  # and the bottleneck chart
    for key, fig in figs.items():
        notes = [a["text"] for a in fig["layout"]["annotations"]]
        assert notes == ["No data yet"], key
        # plain tick numbers (d3 "~g"), no SI prefixes beside decimals; the bottleneck shares are percentages
        assert (fig["layout"]["xaxis"]["tickformat"], fig["layout"]["yaxis"]["tickformat"]) == (
            "~g",
            ".0%" if key == "bottleneck" else "~g",
        ), key
    # one point is data: no note
    one = figures.run_figures({("trainer", "loss"): _series("trainer", [1], [0.5])}, [])
    loss = next(c.key for c in figures.CHARTS if ("trainer", "loss") in [(s, n) for s, n, _ in c.lines])
    assert [a["text"] for a in one[loss]["layout"]["annotations"]] == []


def test_the_run_page_shows_step_of_max_steps_elapsed_time_and_eta(
    web: tuple[Any, str], make_run: Any, auth: Any
) -> None:
    from datetime import timedelta

    from sqlmodel import Session

    from server.core.db import engine
    from server.models import RunStatus
    from server.services import metrics, runs
    from webui.page import duration

    assert [duration(s) for s in (0, 42.9, 425, 10920, 187200)] == ["0s", "42s", "7m 05s", "3h 02m", "2d 04h"]
    client, _ = web
    rid = make_run(max_steps=10)["id"]
    assert 'id="progress">step <strong id="progress-step">0</strong> of 10' in client.get(f"/runs/{rid}").text
    t0 = 1_800_000_000.0
    points = [  # trainer steps 1-3 measured 4 s apart: 7 steps left at 4 s a step
        {"source": "trainer", "step": s, "name": "step_time_s", "value": 3.5, "time": t0 + 4 * s} for s in (1, 2, 3)
    ]
    assert client.post(f"/api/runs/{rid}/metrics", json={"points": points}, headers=auth).status_code == 200
    with Session(engine) as s:
        run = runs.get(s, rid)
        runs.transition(s, run, RunStatus.starting)
        runs.transition(s, run, RunStatus.running)
        run.started_at = run.started_at - timedelta(seconds=125)  # type: ignore[operator]
        s.add(run)
        s.commit()
        at = metrics.progress(s, run, now=run.started_at + timedelta(seconds=125.5))
    assert at == metrics.Progress(step=3, max_steps=10, elapsed_s=125.5, eta_s=28.0)
    status = client.get(f"/runs/{rid}?part=status").text
    assert 'step <strong id="progress-step">3</strong> of 10' in status
    assert re.search(r'elapsed <span id="elapsed">2m 0[5-9]s</span>', status), status  # 125 s and the request's own
    assert 'ETA <span id="eta">28s</span>' in status
    # ended: elapsed stops at the end, no ETA
    with Session(engine) as s:
        run = runs.get(s, rid)
        runs.transition(s, run, RunStatus.failed, reason="launch refused")
        run.finished_at = run.started_at + timedelta(seconds=3725)  # type: ignore[operator]
        s.add(run)
        s.commit()
    status = client.get(f"/runs/{rid}?part=status").text
    assert 'elapsed <span id="elapsed">1h 02m</span>' in status and 'id="eta"' not in status


def test_docs_serve_swagger_ui_from_the_app_not_a_cdn(client: Any) -> None:
    """``/docs`` names only this app's assets (offline it still draws); FastAPI's ``/redoc`` (a CDN script) is gone."""
    html = client.get("/docs").text
    assert sorted(re.findall(r'(?:src|href)="([^"]+)"', html)) == [
        "/static/swagger-ui-bundle.js",
        "/static/swagger-ui-favicon.png",
        "/static/swagger-ui.css",
    ]
    assert "url: '/openapi.json'" in html and "https://" not in html
    for name, kind, start in (
        (
            "swagger-ui-bundle.js",
            "javascript",
            b"/*! For license information please see swagger-ui-bundle.js.LICENSE.txt",
        ),
        ("swagger-ui.css", "text/css", b".swagger-ui"),
        ("swagger-ui-favicon.png", "image/png", b"\x89PNG"),
    ):
        resp = client.get(f"/static/{name}")
        assert resp.status_code == 200 and kind in resp.headers["content-type"], name
        assert resp.content.startswith(start), (name, resp.content[:80])
    assert client.get("/redoc").status_code == 404


def test_compare_colours_follow_the_run_and_dashes_the_line(web: tuple[Any, str], make_run: Any, auth: Any) -> None:
    """Run a has train and eval reward, run b eval only: b's eval line has b's colour (not the second trace's)."""
    client, _ = web
    a, b = make_run(), make_run()
    for run, lines in ((a, ("orchestrator", "eval")), (b, ("eval",))):
        pts = [{"source": src, "step": 1, "name": "reward_mean", "value": 0.5, "time": 1.0} for src in lines]
        assert client.post(f"/api/runs/{run['id']}/metrics", json={"points": pts}, headers=auth).status_code == 200
    html = client.get("/compare", params=[("run", a["id"]), ("run", b["id"])]).text
    figs = __import__("json").loads(re.search(r"data-figures>(.*?)</script>", html, re.S).group(1))
    assert [(t["name"], t["line"], t["marker"]) for t in figs["reward"]["data"]] == [
        (f"#{a['id']} {a['name']} train", {"color": "#1f77b4", "dash": "solid"}, {"color": "#1f77b4"}),
        (f"#{a['id']} {a['name']} eval", {"color": "#1f77b4", "dash": "dash"}, {"color": "#1f77b4"}),
        (f"#{b['id']} {b['name']} eval", {"color": "#ff7f0e", "dash": "dash"}, {"color": "#ff7f0e"}),
    ]
    assert figs["loss"]["data"] == [] and figs["loss"]["layout"]["annotations"][-1]["text"] == "No data yet"
