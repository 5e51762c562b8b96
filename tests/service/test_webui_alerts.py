"""The dashboard's alerts pages on the real Postgres: rules added, disabled and edited through forms (errors at the
field, nothing stored), webhooks added through a form (secret shown once) receiving a real alert through a real
Celery worker at a real HTTP receiver on 127.0.0.1, its delivery log and replay; read tokens, CSRF, escaping."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.alerts import Receiver, delivered, fire_once, new_run, signed_ok
from tests.support.server import new_token, run_token_headers, wait_for
from tests.support.webui import login

XSS = '"><script>alert(1)</script>'


@pytest.fixture
def cleanup(client: Any, auth: dict[str, str]) -> Iterator[dict[str, list[int]]]:
    """Ids of rules and endpoints a test adds through the forms; deleted afterwards (a global rule or an endpoint
    left behind would apply to later modules' runs)."""
    made: dict[str, list[int]] = {"rules": [], "webhooks": []}
    yield made
    for rule_id in made["rules"]:
        client.delete(f"/api/alerts/rules/{rule_id}", headers=auth)
    for endpoint_id in made["webhooks"]:
        client.delete(f"/api/webhooks/{endpoint_id}", headers=auth)


def rule_count(client: Any, auth: dict[str, str], run_id: int) -> int:
    return int(client.get(f"/api/runs/{run_id}/alerts/rules", headers=auth).json()["count"])


def add_rule(client: Any, csrf: str, **fields: Any) -> Any:
    return client.post("/alerts/rules", data={"csrf": csrf, **fields}, follow_redirects=False)


def test_rule_added_disabled_and_edited_through_forms(
    web: tuple[Any, str], auth: dict[str, str], cleanup: dict[str, list[int]]
) -> None:
    client, csrf = web
    run_id = new_run()
    # fields of other kinds (seconds, statuses) are filled too: only the chosen kind's fields are taken
    resp = add_rule(
        client,
        csrf,
        scope=str(run_id),
        kind="threshold",
        metric="mismatch_kl",
        op=">",
        value="0.05",
        window="2",
        after_step="",
        seconds="30",
        statuses="failed",
        run=str(run_id),
    )
    assert resp.status_code == 303, resp.text
    (rule,) = client.get(f"/api/runs/{run_id}/alerts/rules", headers=auth).json()["data"]
    assert resp.headers["location"] == f"/alerts?run={run_id}#rule-{rule['id']}"
    assert (rule["run_id"], rule["enabled"], rule["origin"]) == (run_id, True, "api")
    assert rule["rule"] == {
        "kind": "threshold",
        "name": "",
        "metric": "mismatch_kl",
        "source": "trainer",
        "op": ">",
        "value": 0.05,
        "window": 2,
        "after_step": 0,
    }
    html = client.get(f"/alerts?run={run_id}").text
    row = re.search(rf'<tr id="rule-{rule["id"]}">(.*?)</tr>', html, re.S)
    assert row, html
    assert f'<a href="/runs/{run_id}">run #{run_id}</a>' in row.group(1)
    assert "<td>trainer/mismatch_kl &gt; 0.05 for 2 steps</td>" in row.group(1)
    assert "<td>yes</td>" in row.group(1) and "<td>ok</td>" in row.group(1) and ">Disable</button>" in row.group(1)

    resp = client.post(
        f"/alerts/rules/{rule['id']}/enabled",
        data={"csrf": csrf, "enabled": "0", "run": run_id},
        follow_redirects=False,
    )
    assert resp.status_code == 303, resp.text
    rules = client.get(f"/api/runs/{run_id}/alerts/rules", headers=auth).json()["data"]
    assert [(r["id"], r["enabled"]) for r in rules] == [(rule["id"], False)]
    assert ">Enable</button>" in client.get(f"/alerts?run={run_id}").text

    resp = client.post(
        f"/alerts/rules/{rule['id']}/threshold", data={"csrf": csrf, "value": "0.2"}, follow_redirects=False
    )
    assert resp.status_code == 303 and resp.headers["location"] == f"/alerts#rule-{rule['id']}", resp.text
    resp = client.post(f"/alerts/rules/{rule['id']}/threshold", data={"csrf": csrf, "value": "abc"})
    assert resp.status_code == 422
    assert (
        f'id="page-error">rule {rule["id"]}: rule.value: Input should be a valid number, unable to parse string '
        "as a number</p>"
    ) in resp.text
    (after,) = client.get(f"/api/runs/{run_id}/alerts/rules", headers=auth).json()["data"]
    assert after["rule"] == {**rule["rule"], "value": 0.2} and after["enabled"] is False
    assert client.post("/alerts/rules/999999/enabled", data={"csrf": csrf, "enabled": "1"}).status_code == 404

    # a global rule shows as "global" on the page of every run
    resp = add_rule(client, csrf, scope="", kind="stall", seconds="600", metric="loss")
    assert resp.status_code == 303, resp.text
    cleanup["rules"].append(int(resp.headers["location"].rsplit("-", 1)[1]))
    html = client.get(f"/alerts?run={run_id}").text
    assert html.count('<tr id="rule-') == 2 and "<td>global</td>" in html and "<td>no metrics for 600 s</td>" in html


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (
            {"kind": "threshold", "metric": "not_a_metric", "op": ">", "value": "1"},
            "metric",
            "metric: unknown metric &#39;not_a_metric&#39;; known: loss,",
        ),
        ({"kind": "threshold", "metric": "loss", "op": ">"}, "value", "value: Field required"),
        ({"kind": "throughput", "fraction": "1.5"}, "fraction", "fraction: Input should be less than 1"),
        (
            {"kind": "status", "statuses": "failed, exploded"},
            "statuses",
            "statuses.1: Input should be &#39;failed&#39;, &#39;completed&#39;, &#39;cancelled&#39;, &#39;requeued&#39; or &#39;stalled&#39;",
        ),
        (
            {"kind": "bogus"},
            "kind",
            "kind: expected one of status, threshold, stall, non_finite, throughput, got &#39;bogus&#39;",
        ),
        (
            {"kind": "stall", "seconds": "60", "scope": "abc"},
            "scope",
            "scope: expected a run id (a whole number &gt;= 1), got",
        ),
        ({"kind": "stall", "seconds": "60", "scope": "999999"}, "scope", "scope: run 999999 not found"),
    ],
)
def test_bad_rule_is_shown_at_its_field_and_nothing_is_stored(
    web: tuple[Any, str], auth: dict[str, str], fields: dict[str, str], field: str, message: str
) -> None:
    client, csrf = web
    run_id = new_run()
    before = client.get("/api/alerts/rules", headers=auth).json()["count"]
    resp = add_rule(client, csrf, **{"scope": str(run_id), **fields})
    assert resp.status_code == 422, resp.text
    err = re.search(rf'<p class="inline-error" role="alert" id="err-{field}">([^<]*)</p>', resp.text)
    assert err and err.group(1).startswith(message), resp.text[-3000:]
    assert f'aria-describedby="err-{field}"' in resp.text
    assert resp.text.count('class="inline-error"') == 1
    if field != "kind":  # the typed values are kept in the form
        assert f'value="{fields.get("scope", run_id)}"' in resp.text
    assert rule_count(client, auth, run_id) == 0
    assert client.get("/api/alerts/rules", headers=auth).json()["count"] == before


def _secret_shown(html: str) -> str:
    m = re.search(
        r'id="new-secret">Endpoint #\d+ added\. Its signing secret, shown only now: <code>([^<]+)</code>', html
    )
    assert m, html[-3000:]
    return m.group(1)


@pytest.mark.usefixtures("worker")
def test_webhook_form_delivery_log_and_replay(
    web: tuple[Any, str], auth: dict[str, str], receiver: Receiver, cleanup: dict[str, list[int]]
) -> None:
    client, csrf = web
    resp = client.post(
        "/alerts/webhooks",
        data={"csrf": csrf, "url": receiver.url, "name": "hook <b>1</b>", "format": "json", "events": ["threshold"]},
    )
    assert resp.status_code == 201, resp.text[-2000:]
    secret = _secret_shown(resp.text)
    hooks = client.get("/api/webhooks", headers=auth).json()["data"]
    hook = next(h for h in hooks if h["url"] == receiver.url)
    cleanup["webhooks"].append(hook["id"])
    assert (hook["name"], hook["events"], hook["format"], hook["secret_prefix"]) == (
        "hook <b>1</b>",
        ["threshold"],
        "json",
        secret[:4],
    )
    page = client.get("/alerts").text
    assert secret not in page and f"<code>{secret[:4]}…</code>" in page and "<td>hook &lt;b&gt;1&lt;/b&gt;</td>" in page

    run_id = fire_once(client, auth)
    (first,) = delivered(client, auth, hook["id"], 1)
    assert len(receiver.requests) == 1 and signed_ok(secret, receiver.requests[0])  # the secret shown signs
    log = client.get(f"/alerts/webhooks/{hook['id']}").text
    row = re.search(rf'<tr id="delivery-{first["id"]}">(.*?)</tr>', log, re.S)
    assert row, log
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)
    assert cells[1:7] == [str(first["event_id"]), "delivered", "200", f"{first['latency_ms']:.1f}", "1", "0"]
    assert cells[7] == "" and cells[8] == f"<code>{first['idempotency_key']}</code>" and "ago</span>" in cells[9]
    assert ">Replay</button>" in cells[10]
    alerts = client.get(f"/alerts?run={run_id}").text
    assert "<td>threshold</td><td>fired</td>" in alerts and "<td>trainer/loss &gt; 1: fired at step 1</td>" in alerts
    assert f'<span class="status status-failed">firing</span> in <a href="/runs/{run_id}">#{run_id}</a>' in alerts

    resp = client.post(f"/alerts/deliveries/{first['id']}/replay", data={"csrf": csrf}, follow_redirects=False)
    assert (
        resp.status_code == 303 and resp.headers["location"] == f"/alerts/webhooks/{hook['id']}#delivery-{first['id']}"
    )
    wait_for(lambda: len(receiver.requests) == 2, 30, "the replayed request")
    (again,) = delivered(client, auth, hook["id"], 1)
    assert (again["attempts"], again["replays"], again["idempotency_key"]) == (1, 1, first["idempotency_key"])
    assert receiver.requests[0].body == receiver.requests[1].body
    row = re.search(
        rf'<tr id="delivery-{first["id"]}">(.*?)</tr>', client.get(f"/alerts/webhooks/{hook['id']}").text, re.S
    )
    assert row and re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)[5:7] == ["1", "1"]
    assert client.post("/alerts/deliveries/999999/replay", data={"csrf": csrf}).status_code == 404


def test_bad_webhook_is_shown_escaped_and_nothing_is_stored(web: tuple[Any, str], auth: dict[str, str]) -> None:
    client, csrf = web
    before = client.get("/api/webhooks", headers=auth).json()["count"]
    resp = client.post("/alerts/webhooks", data={"csrf": csrf, "url": XSS, "events": ["status"]})
    assert resp.status_code == 422
    assert '<p class="inline-error" role="alert" id="hook-error">url: Input should be a valid URL' in resp.text
    assert 'value="&#34;&gt;&lt;script&gt;alert(1)&lt;/script&gt;"' in resp.text and "<script>alert(1)" not in resp.text
    resp = client.post(
        "/alerts/webhooks", data={"csrf": csrf, "url": "http://169.254.169.254/latest", "events": ["status"]}
    )
    assert (
        resp.status_code == 422
        and (
            'id="hook-error">url: 169.254.169.254 resolves to 169.254.169.254, a cloud metadata address (allow it in '
            "WEBHOOK_ALLOW_HOSTS)</p>"
        )
        in resp.text
    )
    resp = client.post("/alerts/webhooks", data={"csrf": csrf, "url": "http://127.0.0.1:9/x", "events": ["nope"]})
    assert resp.status_code == 422 and 'id="hook-error">events.0: Input should be &#39;status&#39;' in resp.text
    assert client.get("/api/webhooks", headers=auth).json()["count"] == before


def test_rule_name_with_html_is_escaped(web: tuple[Any, str]) -> None:
    client, csrf = web
    run_id = new_run()
    assert add_rule(client, csrf, scope=str(run_id), kind="non_finite", name=XSS).status_code == 303
    html = client.get(f"/alerts?run={run_id}").text
    assert "<td>&#34;&gt;&lt;script&gt;alert(1)&lt;/script&gt;</td>" in html and "<script>alert(1)" not in html


def test_read_token_sees_no_forms_and_its_posts_are_403(client: Any, auth: dict[str, str]) -> None:
    run_id = new_run()
    rule = client.post(
        f"/api/runs/{run_id}/alerts/rules",
        headers=auth,
        json={"kind": "threshold", "metric": "loss", "op": ">", "value": 1.0},
    ).json()
    hook = client.post(
        "/api/webhooks", headers=auth, json={"url": "http://127.0.0.1:9/services/T0/B0/SECRETPATH"}
    ).json()
    csrf = login(client, new_token(f"reader-{secrets.token_hex(3)}", scope="read"))
    html = client.get(f"/alerts?run={run_id}").text
    log_page = client.get(f"/alerts/webhooks/{hook['id']}").text
    assert client.delete(f"/api/webhooks/{hook['id']}", headers=auth).status_code == 204
    assert "SECRETPATH" not in html and "SECRETPATH" not in log_page  # the URL path may be the credential
    assert html.count("<code>http://127.0.0.1:9/…</code>") == 1 and "<code>http://127.0.0.1:9/…</code>" in log_page
    assert f'<tr id="rule-{rule["id"]}">' in html and "<td>trainer/loss &gt; 1</td>" in html
    assert 'method="post" action="/alerts' not in html and "Add a rule" not in html and "Add a webhook" not in html
    for url, data in [
        ("/alerts/rules", {"kind": "stall", "seconds": "5"}),
        (f"/alerts/rules/{rule['id']}/enabled", {"enabled": "0"}),
        (f"/alerts/rules/{rule['id']}/threshold", {"value": "9"}),
        ("/alerts/webhooks", {"url": "http://127.0.0.1:9/x"}),
        ("/alerts/deliveries/1/replay", {}),
    ]:
        resp = client.post(url, data={"csrf": csrf, **data})
        assert resp.status_code == 403 and "is read-only" in resp.json()["detail"], (url, resp.text)
    (after,) = client.get(f"/api/runs/{run_id}/alerts/rules", headers=auth).json()["data"]
    assert after["enabled"] is True and after["rule"]["value"] == 1.0 and rule_count(client, auth, run_id) == 1


def test_csrf_missing_or_wrong_is_403(web: tuple[Any, str], auth: dict[str, str]) -> None:
    client, _ = web
    run_id = new_run()
    for sent in ({}, {"csrf": "forged"}):
        resp = client.post("/alerts/rules", data={"scope": str(run_id), "kind": "stall", "seconds": "5", **sent})
        assert resp.status_code == 403 and resp.json()["detail"].startswith("csrf:"), resp.text
        resp = client.post("/alerts/webhooks", data={"url": "http://127.0.0.1:9/x", **sent})
        assert resp.status_code == 403
    assert rule_count(client, auth, run_id) == 0


def test_run_page_links_to_its_alerts_and_bad_filters(web: tuple[Any, str]) -> None:
    client, _ = web
    run_id = new_run()
    assert f'<a href="/alerts?run={run_id}" id="run-alerts">' in client.get(f"/runs/{run_id}").text
    assert '<a href="/alerts">Alerts</a>' in client.get("/runs").text
    resp = client.get("/alerts?run=abc")
    assert (
        resp.status_code == 422 and resp.json()["detail"] == "run: expected a run id (a whole number >= 1), got 'abc'"
    )
    resp = client.get("/alerts?run=999999")
    assert resp.status_code == 404 and resp.json()["detail"] == "run 999999 not found"
    assert client.get("/alerts/webhooks/999999").status_code == 404


def test_built_in_policy_check_alert_is_listed_without_a_rule(web: tuple[Any, str]) -> None:
    """A run's ``policy_check_failed`` event fires the built-in ``policy_check`` rule: the run's alerts page lists the
    event as built-in (no rule to link to), with the check's reason."""
    client, _ = web
    run_id = new_run()
    reason = "orchestrator.policy_check: policy version 2: the served log-probs are nearer the base model"
    event = {"event": "policy_check_failed", "time": time.time(), "reason": reason, "data": {"step": 2}}
    sent = client.post(f"/api/runs/{run_id}/events", json={"events": [event]}, headers=run_token_headers(run_id))
    assert sent.status_code == 200 and sent.json() == {"recorded": 1}, sent.text
    page = client.get(f"/alerts?run={run_id}").text
    row = '<td><span class="muted">built-in</span></td><td>policy_check</td><td>fired</td>\n    <td class="num">2</td>'
    assert row in page, page
    assert f"<td>policy_check_failed (built-in rule policy_check): {reason}</td>" in page


def test_the_webhook_form_at_the_endpoint_cap_shows_a_page_message(client: Any) -> None:
    from server.alerts.webhooks import MAX_ENDPOINTS_PER_USER

    user = f"web-hooks-{secrets.token_hex(3)}"
    token = new_token(user)
    auth = {"Authorization": f"Bearer {token}"}
    for i in range(MAX_ENDPOINTS_PER_USER):
        resp = client.post("/api/webhooks", json={"url": f"http://127.0.0.1:9/h{i}"}, headers=auth)
        assert resp.status_code == 201, resp.text
    csrf = login(client, token)
    resp = client.post(
        "/alerts/webhooks",
        data={"csrf": csrf, "url": "http://127.0.0.1:9/one-more", "name": "more", "events": ["status"]},
    )
    line = f"webhooks: {user} has 20 webhook endpoints, the most one user may add (20)"
    assert resp.status_code == 422 and resp.headers["content-type"].startswith("text/html")
    assert f'<p class="error" role="alert" id="page-error">{line}</p>' in resp.text
    assert 'value="http://127.0.0.1:9/one-more"' in resp.text  # the draft is kept
    assert client.get("/api/webhooks", headers=auth).json()["count"] >= MAX_ENDPOINTS_PER_USER
