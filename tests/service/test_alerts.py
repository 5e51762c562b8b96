"""Alert rules through the API: validation, the SSRF guard, and when each kind fires (events and the deliveries
they create; sending them is ``test_alerts_delivery.py``)."""

from __future__ import annotations

import json
import math
from datetime import timedelta
from typing import Any

import pytest

from tests.support.alerts import alert_events, deliveries, fire_once, new_run, post_metrics
from tests.support.server import new_token, run_token_headers, spec


def add_rule(client: Any, auth: dict[str, str], run_id: int, **rule: Any) -> dict[str, Any]:
    resp = client.post(f"/api/runs/{run_id}/alerts/rules", json=rule, headers=auth)
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


@pytest.fixture
def endpoint(client: Any, auth: dict[str, str]) -> Any:
    """A webhook endpoint (nothing listens at its URL: no worker runs in this module) removed afterwards."""
    resp = client.post(
        "/api/webhooks", json={"url": "http://127.0.0.1:9/hook", "events": ["threshold", "status"]}, headers=auth
    )
    assert resp.status_code == 201, resp.text
    yield resp.json()
    client.delete(f"/api/webhooks/{resp.json()['id']}", headers=auth)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (
            {"kind": "threshold", "metric": "mismatch_kll", "op": ">", "value": 1},
            "body.threshold.metric: Value error, unknown metric 'mismatch_kll' (did you mean 'mismatch_kl'?); known: loss, "
            "entropy, mismatch_kl,",
        ),
        (
            {"kind": "threshold", "metric": "loss", "op": ">", "value": 1, "window": 0},
            "body.threshold.window: Input should be greater than or equal to 1",
        ),
        ({"kind": "throughput", "window": -3}, "body.throughput.window: Input should be greater than or equal to 2"),
        ({"kind": "stall", "seconds": 0}, "body.stall.seconds: Input should be greater than 0"),
        (
            {"kind": "status", "statuses": ["exploded"]},
            "body.status.statuses.0: Input should be 'failed', 'completed', 'cancelled', 'requeued' or 'stalled'",
        ),
        (
            {"kind": "non_finite", "metrics": ["loss", "rewardd"]},
            "body.non_finite.metrics: Value error, unknown metric ",
        ),
        (
            {"kind": "threshold", "metric": "reward_mean", "source": "trainer", "op": "<", "value": 0.1},
            "body.threshold: Value error, source: trainer does not report 'reward_mean'",
        ),
        ({"kind": "siren"}, "body: Input tag 'siren' found using 'kind' does not match any of the expected tags"),
    ],
)
def test_bad_rules_are_422_naming_the_field(
    client: Any, auth: dict[str, str], body: dict[str, Any], detail: str
) -> None:
    resp = client.post("/api/alerts/rules", json=body, headers=auth)
    assert resp.status_code == 422 and resp.json()["detail"].startswith(detail), resp.text


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"url": "not a url"}, "body.url: Input should be a valid URL"),
        ({"url": "ftp://example.org/x"}, "body.url: URL scheme should be 'http' or 'https'"),
        (
            {"url": "http://127.0.0.1:9/x", "events": ["threshold", "earthquake"]},
            "body.events.1: Input should be 'status', 'threshold', 'stall', 'non_finite', 'throughput' or 'policy_check'",
        ),
        ({"url": "http://127.0.0.1:9/x", "format": "xml"}, "body.format: Input should be 'json' or 'slack'"),
        ({"url": "http://127.0.0.1:9/x", "secret": "short"}, "body.secret: String should have at least 16 characters"),
        (
            {"url": "http://169.254.169.254/latest/meta-data"},
            "url: 169.254.169.254 resolves to 169.254.169.254, a cloud metadata address",
        ),
        ({"url": "http://169.254.10.1/x"}, "url: 169.254.10.1 resolves to 169.254.10.1, a link-local address"),
        ({"url": "http://[fe80::1]:8080/x"}, "url: fe80::1 resolves to fe80::1, a link-local address"),
        (
            {"url": "http://[::ffff:169.254.169.254]/x"},
            "url: ::ffff:a9fe:a9fe resolves to ::ffff:a9fe:a9fe (IPv4 169.254.169.254), a cloud metadata address",
        ),
        ({"url": "http://[fd00:ec2::254]/x"}, "url: fd00:ec2::254 resolves to fd00:ec2::254, a cloud metadata address"),
        (
            {"url": "http://100.100.100.200/latest/meta-data"},
            "url: 100.100.100.200 resolves to 100.100.100.200, a cloud metadata address (allow it in WEBHOOK_ALLOW_HOSTS)",
        ),
        (
            {"url": "http://metadata.google.internal/computeMetadata/v1/"},
            "url: metadata.google.internal is a cloud metadata service",
        ),
        ({"url": "http://no-such-host.invalid/x"}, "url: host no-such-host.invalid does not resolve"),
        ({"url": "http://127.0.0.1:9/" + "x" * 2050}, "body.url: URL should have at most 2048 characters"),
    ],
)
def test_bad_webhooks_are_422_naming_the_field(
    client: Any, auth: dict[str, str], body: dict[str, Any], detail: str
) -> None:
    before = client.get("/api/webhooks", headers=auth).json()["count"]
    resp = client.post("/api/webhooks", json=body, headers=auth)
    assert resp.status_code == 422 and resp.json()["detail"].startswith(detail), resp.text
    assert client.get("/api/webhooks", headers=auth).json()["count"] == before


def test_ssrf_allow_list_and_loopback_without_allow_private(
    client: Any, auth: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.core.config import settings

    monkeypatch.setattr(settings, "WEBHOOK_ALLOW_HOSTS", ["169.254.169.254"])
    ok = client.post("/api/webhooks", json={"url": "http://169.254.169.254/hook"}, headers=auth)
    assert ok.status_code == 201, ok.text
    client.delete(f"/api/webhooks/{ok.json()['id']}", headers=auth)
    monkeypatch.setattr(settings, "WEBHOOK_ALLOW_PRIVATE", False)
    resp = client.post("/api/webhooks", json={"url": "http://localhost:8080/hook"}, headers=auth)
    assert resp.status_code == 422
    assert resp.json()["detail"].startswith("url: localhost resolves to "), resp.text
    assert resp.json()["detail"].endswith(
        "a loopback address (allowed only with WEBHOOK_ALLOW_PRIVATE or in WEBHOOK_ALLOW_HOSTS)"
    )


@pytest.mark.parametrize("host", ["100.64.0.1", "100.127.255.254", "[::ffff:100.64.0.1]"])
def test_shared_address_space_is_refused_without_allow_private(
    client: Any, auth: dict[str, str], monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    from server.core.config import settings

    before = client.get("/api/webhooks", headers=auth).json()["count"]
    monkeypatch.setattr(settings, "WEBHOOK_ALLOW_PRIVATE", False)
    resp = client.post("/api/webhooks", json={"url": f"http://{host}/hook"}, headers=auth)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"].endswith(
        "a shared address space address, 100.64.0.0/10 (allowed only with WEBHOOK_ALLOW_PRIVATE or in WEBHOOK_ALLOW_HOSTS)"
    )
    assert client.get("/api/webhooks", headers=auth).json()["count"] == before
    monkeypatch.setattr(settings, "WEBHOOK_ALLOW_PRIVATE", True)  # an admin allowed internal receivers
    ok = client.post("/api/webhooks", json={"url": f"http://{host}/hook"}, headers=auth)
    assert ok.status_code == 201, ok.text
    client.delete(f"/api/webhooks/{ok.json()['id']}", headers=auth)


# the IPv6 forms that carry an IPv4 address; Teredo's client is stored bit-inverted (RFC 4380 section 4):
# 2001:0:4136:e378:0:7fff:5601:5601 is server 65.54.227.120, client ~0x5601_5601 = 0xa9fe_a9fe = 169.254.169.254
EMBEDDED = {
    "mapped": (
        "::ffff:{}",
        {
            "169.254.169.254": "::ffff:a9fe:a9fe",
            "169.254.7.7": "::ffff:a9fe:707",
            "127.0.0.1": "::ffff:7f00:1",
            "10.1.2.3": "::ffff:a01:203",
        },
    ),
    "nat64": (
        "64:ff9b::{}",
        {
            "169.254.169.254": "64:ff9b::a9fe:a9fe",
            "169.254.7.7": "64:ff9b::a9fe:707",
            "127.0.0.1": "64:ff9b::7f00:1",
            "10.1.2.3": "64:ff9b::a01:203",
        },
    ),
    "6to4": (
        "{}",
        {
            "169.254.169.254": "2002:a9fe:a9fe::1",
            "169.254.7.7": "2002:a9fe:707::1",
            "127.0.0.1": "2002:7f00:1::1",
            "10.1.2.3": "2002:a01:203::1",
        },
    ),
    "teredo": (
        "{}",
        {
            "169.254.169.254": "2001:0:4136:e378:0:7fff:5601:5601",
            "169.254.7.7": "2001:0:4136:e378:0:7fff:5601:f8f8",
            "127.0.0.1": "2001:0:4136:e378:0:7fff:80ff:fffe",
            "10.1.2.3": "2001:0:4136:e378:0:7fff:f5fe:fdfc",
        },
    ),
    "compatible": (
        "::{}",
        {
            "169.254.169.254": "::a9fe:a9fe",
            "169.254.7.7": "::a9fe:707",
            "127.0.0.1": "::7f00:1",
            "10.1.2.3": "::a01:203",
        },
    ),
}
REASONS = {
    "169.254.169.254": "a cloud metadata address (allow it in WEBHOOK_ALLOW_HOSTS)",
    "169.254.7.7": "a link-local address (allow it in WEBHOOK_ALLOW_HOSTS)",
    "127.0.0.1": "a loopback address (allowed only with WEBHOOK_ALLOW_PRIVATE or in WEBHOOK_ALLOW_HOSTS)",
    "10.1.2.3": "a private address (allowed only with WEBHOOK_ALLOW_PRIVATE or in WEBHOOK_ALLOW_HOSTS)",
}


@pytest.mark.parametrize("form", sorted(EMBEDDED))
@pytest.mark.parametrize("v4", sorted(REASONS))
def test_ssrf_guard_judges_ipv6_by_the_ipv4_it_embeds(form: str, v4: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import ipaddress

    from server.alerts.webhooks import UnsafeURL, check_url, embedded_ipv4
    from server.core.config import settings

    pattern, written = EMBEDDED[form]
    literal = pattern.format(v4) if pattern != "{}" else written[v4]
    ip6 = written[v4]
    assert str(ipaddress.IPv6Address(literal)) == ip6  # the table is right: the literal is that address
    assert ipaddress.IPv4Address(v4) in embedded_ipv4(ipaddress.IPv6Address(ip6))
    monkeypatch.setattr(settings, "WEBHOOK_ALLOW_PRIVATE", False)
    with pytest.raises(UnsafeURL) as err:
        check_url(f"http://[{literal}]:8080/hook")
    assert str(err.value) == f"url: {literal} resolves to {ip6} (IPv4 {v4}), {REASONS[v4]}"  # the host as written
    monkeypatch.setattr(
        settings, "WEBHOOK_ALLOW_PRIVATE", True
    )  # loopback and private pass when an admin allows them, the rest never
    if v4.startswith("169.254."):
        with pytest.raises(UnsafeURL, match="IPv4 169.254"):
            check_url(f"http://[{literal}]:8080/hook")
    else:
        check_url(f"http://[{literal}]:8080/hook")


def test_ssrf_guard_lets_public_embedded_ipv4_and_allow_listed_ones_through(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.alerts.webhooks import UnsafeURL, check_url
    from server.core.config import settings

    monkeypatch.setattr(settings, "WEBHOOK_ALLOW_PRIVATE", False)
    # 8.8.8.8 inside each form, and a Teredo address whose server and client are both public
    for literal in (
        "::ffff:8.8.8.8",
        "64:ff9b::8.8.8.8",
        "2002:808:808::1",
        "::8.8.8.8",
        "2001:0:4136:e378:0:7fff:f7f7:f7f7",
        "2606:4700::1111",
    ):
        check_url(f"http://[{literal}]/hook")
    with pytest.raises(UnsafeURL, match="private address"):
        check_url("http://10.1.2.3/hook")  # plain IPv4 is judged the same way
    monkeypatch.setattr(settings, "WEBHOOK_ALLOW_HOSTS", ["169.254.169.254"])
    check_url("http://[2002:a9fe:a9fe::1]/hook")  # the allow-listed IPv4 is allowed in every form
    with pytest.raises(UnsafeURL, match=r"::a9fe:707 \(IPv4 169.254.7.7\), a link-local address"):
        check_url("http://[::169.254.7.7]/hook")


def test_writes_need_a_write_token(client: Any) -> None:
    body = {"url": "http://127.0.0.1:9/x"}
    assert client.post("/api/webhooks", json=body).status_code == 401
    read = {"Authorization": f"Bearer {new_token('alerts-reader', scope='read')}"}
    resp = client.post("/api/webhooks", json=body, headers=read)
    assert resp.status_code == 403 and "read-only" in resp.json()["detail"]
    assert client.get("/api/webhooks", headers=read).status_code == 200
    resp = client.post("/api/alerts/rules", json={"kind": "stall", "seconds": 5}, headers=read)
    assert resp.status_code == 403
    run_id = new_run()
    resp = client.post("/api/alerts/rules", json={"kind": "stall", "seconds": 5}, headers=run_token_headers(run_id))
    assert resp.status_code == 403


def test_secret_is_shown_once_then_only_its_prefix(client: Any, auth: dict[str, str]) -> None:
    secret = "s3cret-s3cret-s3cret"
    created = client.post(
        "/api/webhooks", json={"url": "http://127.0.0.1:9/x", "secret": secret, "format": "slack"}, headers=auth
    ).json()
    try:
        assert created["secret"] == secret and created["secret_prefix"] == "s3cr"
        shown = client.get(f"/api/webhooks/{created['id']}", headers=auth).text
        listed = client.get("/api/webhooks", headers=auth).text
        assert secret[:5] not in shown and secret[:5] not in listed and '"secret_prefix":"s3cr"' in shown
        assert created["events"] == ["status", "threshold", "stall", "non_finite", "throughput", "policy_check"]
        from sqlmodel import Session

        from server.alerts.models import WebhookEndpoint
        from server.alerts.webhooks import reveal_secret
        from server.core.db import engine

        with Session(engine) as s:
            row = s.get(WebhookEndpoint, created["id"])
            assert row is not None and secret not in row.secret_encrypted and reveal_secret(row) == secret
    finally:
        assert client.delete(f"/api/webhooks/{created['id']}", headers=auth).status_code == 204
    assert client.get(f"/api/webhooks/{created['id']}", headers=auth).status_code == 404


def test_read_tokens_see_webhook_urls_without_path_or_query(client: Any, auth: dict[str, str]) -> None:
    """A Slack-style URL is itself the credential: read tokens see only scheme://host:port/…"""
    url = "http://127.0.0.1:9/services/T000/B000/XXXXsecret?token=abc"
    created = client.post("/api/webhooks", json={"url": url}, headers=auth).json()
    read = {"Authorization": f"Bearer {new_token('alerts-url-reader', scope='read')}"}
    try:
        mine = [h["url"] for h in client.get("/api/webhooks", headers=read).json()["data"] if h["id"] == created["id"]]
        assert mine == ["http://127.0.0.1:9/…"]
        one = client.get(f"/api/webhooks/{created['id']}", headers=read).json()
        assert (one["url"], one["secret_prefix"]) == ("http://127.0.0.1:9/…", created["secret_prefix"])
        assert len(created["secret_prefix"]) == 4
        assert client.get(f"/api/webhooks/{created['id']}", headers=auth).json()["url"] == url
    finally:
        assert client.delete(f"/api/webhooks/{created['id']}", headers=auth).status_code == 204


@pytest.mark.parametrize("path", ["/api/webhooks", "/api/alerts/rules"])
def test_oversized_chunked_body_is_413(client: Any, auth: dict[str, str], path: str) -> None:
    """As for /api/runs: not FastAPI's 400 "There was an error parsing the body"."""
    from server.core.config import settings

    before = client.get(path, headers=auth).json()["count"]

    def chunks() -> Any:
        for _ in range(settings.MAX_BODY_BYTES // 10_000 + 2):
            yield b" " * 10_000

    resp = client.post(path, content=chunks(), headers={**auth, "content-type": "application/json"})
    assert (resp.status_code, resp.json()) == (413, {"detail": f"body: larger than {settings.MAX_BODY_BYTES} bytes"})
    assert client.get(path, headers=auth).json()["count"] == before


# ----------------------------------------------------------------------------- rules and when they fire


def test_rules_crud_and_spec_rules(client: Any, auth: dict[str, str]) -> None:
    alerts = [{"kind": "threshold", "metric": "mismatch_kl", "op": ">", "value": 0.05, "window": 2}]
    run = client.post("/api/runs", json=spec(alerts=alerts), headers=auth).json()
    g = client.post(
        "/api/alerts/rules", json={"kind": "status", "statuses": ["failed", "requeued"]}, headers=auth
    ).json()
    try:
        own = add_rule(client, auth, run["id"], kind="stall", seconds=30, name="quiet")
        listed = client.get(f"/api/runs/{run['id']}/alerts/rules", headers=auth).json()
        assert [(r["kind"], r["origin"], r["run_id"]) for r in listed["data"]] == [
            ("threshold", "spec", run["id"]),
            ("status", "api", None),
            ("stall", "api", run["id"]),
        ]
        assert listed["data"][0]["rule"] == {**alerts[0], "name": "", "source": "trainer", "after_step": 0}
        assert g["id"] in [r["id"] for r in client.get("/api/alerts/rules", headers=auth).json()["data"]]
        patched = client.patch(f"/api/alerts/rules/{own['id']}", json={"enabled": False}, headers=auth).json()
        assert patched["enabled"] is False
        assert client.delete(f"/api/alerts/rules/{own['id']}", headers=auth).status_code == 204
        assert client.delete(f"/api/alerts/rules/{own['id']}", headers=auth).status_code == 404
    finally:
        client.delete(f"/api/alerts/rules/{g['id']}", headers=auth)
    bad = client.post(
        "/api/runs", json=spec(alerts=[{"kind": "threshold", "metric": "nope", "op": ">", "value": 1}]), headers=auth
    )
    assert bad.status_code == 422 and bad.json()["detail"].startswith(
        "alerts.0.threshold.metric: unknown metric 'nope'"
    )
    assert (
        client.post("/api/runs/999999/alerts/rules", json={"kind": "stall", "seconds": 1}, headers=auth).status_code
        == 404
    )


def test_threshold_fires_once_per_episode_and_replays_change_nothing(
    client: Any, auth: dict[str, str], endpoint: dict[str, Any]
) -> None:
    run_id = new_run()
    add_rule(client, auth, run_id, kind="threshold", metric="mismatch_kl", op=">", value=0.1, window=2)
    values = {1: 0.0, 2: 0.5, 3: 0.6, 4: 0.7, 5: 0.0, 6: 0.2, 7: 0.3, 8: 0.4, 9: 0.05}
    post_metrics(client, run_id, "mismatch_kl", {s: values[s] for s in (1, 2, 3, 4)})  # one batch, many steps
    for s in (5, 6, 7, 8, 9):
        post_metrics(client, run_id, "mismatch_kl", {s: values[s]})
    post_metrics(client, run_id, "mismatch_kl", values)  # a replay of every point: stored once, no new events
    post_metrics(client, run_id, "loss", {10: 1.0})  # another metric: no event
    assert alert_events(client, auth, run_id) == [
        ("threshold", "fired", 3),
        ("threshold", "cleared", 5),
        ("threshold", "fired", 7),
        ("threshold", "cleared", 9),
    ]
    sent = deliveries(client, auth, endpoint["id"])
    assert len(sent) == 2 and len({d["idempotency_key"] for d in sent}) == 2
    assert all(d["status"] == "pending" and d["attempts"] == 0 for d in sent)


def test_reward_below_after_step(client: Any, auth: dict[str, str]) -> None:
    run_id = new_run()
    add_rule(client, auth, run_id, kind="threshold", metric="reward_mean", op="<", value=0.3, after_step=5)
    post_metrics(
        client, run_id, "reward_mean", {1: 0.1, 2: 0.1, 3: 0.5, 5: 0.2, 6: 0.25, 7: 0.4}, source="orchestrator"
    )
    post_metrics(client, run_id, "reward_mean", {8: 0.1}, source="eval")  # another source's series
    assert alert_events(client, auth, run_id) == [("threshold", "fired", 5), ("threshold", "cleared", 7)]


def test_non_finite_and_throughput_rules(client: Any, auth: dict[str, str]) -> None:
    run_id = new_run()
    add_rule(client, auth, run_id, kind="non_finite")
    add_rule(client, auth, run_id, kind="throughput", fraction=0.5, window=3)
    post_metrics(client, run_id, "loss", {1: 1.0, 2: math.nan, 3: math.inf, 4: 0.9})
    post_metrics(client, run_id, "reward_mean", {5: -math.inf}, source="orchestrator")
    post_metrics(client, run_id, "tokens_per_s", {1: 100.0, 2: 120.0, 3: 80.0, 4: 50.0, 5: 30.0, 6: 90.0})
    got = alert_events(client, auth, run_id)
    assert got == [
        ("non_finite", "fired", 2),
        ("non_finite", "cleared", 4),
        ("non_finite", "fired", 5),
        ("throughput", "fired", 5),
        ("throughput", "cleared", 6),
    ]
    data = client.get("/api/alerts/events", params={"run_id": run_id}, headers=auth).json()["data"]
    assert data[1]["data"] == {"metric": "tokens_per_s", "value": 30.0, "median": 80.0}
    assert data[2]["data"] == {"values": {"reward_mean": "-inf"}}


def test_status_rule_fires_on_each_matching_transition(
    client: Any, auth: dict[str, str], endpoint: dict[str, Any]
) -> None:
    from sqlmodel import Session

    from server.core.db import engine
    from server.models import RunStatus
    from server.services import runs

    run_id = new_run()
    add_rule(client, auth, run_id, kind="status", statuses=["failed", "requeued"])
    with Session(engine) as s:
        run = runs.get(s, run_id)
        runs.transition(s, run, RunStatus.failed, reason="preflight: no model")
        runs.transition(s, run, RunStatus.queued, _resume=True, reason="resumed")
        runs.transition(s, run, RunStatus.starting)
        runs.record_event(s, run, "requeued", reason="Slurm job 7 requeued (restart 1)")
        runs.transition(s, run, RunStatus.cancelled, reason="stopped")
        s.commit()
    assert alert_events(client, auth, run_id) == [("status", "fired", None)] * 3
    bodies = [json.loads(d.body) for d in _delivery_rows(endpoint["id"])]
    assert [(b["event"], b["run"]["id"], b["message"]) for b in bodies] == [
        ("status", run_id, f"run status failed or requeued: run {run_id} is failed (preflight: no model)"),
        ("status", run_id, f"run status failed or requeued: run {run_id} is requeued (resumed)"),
        (
            "status",
            run_id,
            f"run status failed or requeued: run {run_id} is requeued (Slurm job 7 requeued (restart 1))",
        ),
    ]


def _delivery_rows(endpoint_id: int) -> list[Any]:
    from sqlmodel import Session, col, select

    from server.alerts.models import WebhookDelivery
    from server.core.db import engine

    with Session(engine) as s:
        return list(
            s.exec(
                select(WebhookDelivery)
                .where(WebhookDelivery.endpoint_id == endpoint_id)
                .order_by(col(WebhookDelivery.id))
            ).all()
        )


def test_stall_rule_fires_once_then_clears_on_metrics(client: Any, auth: dict[str, str]) -> None:
    from sqlmodel import Session

    from server.alerts import rules
    from server.core.db import engine
    from server.models import RunStatus, utcnow
    from server.services import runs

    run_id = new_run()
    rule = add_rule(client, auth, run_id, kind="stall", seconds=60)
    with Session(engine) as s:
        run = runs.get(s, run_id)
        runs.transition(s, run, RunStatus.starting)
        runs.transition(s, run, RunStatus.running)
        s.commit()
    with Session(engine) as s:
        assert (rule["id"], run_id) not in rules.check_stalls(s, now=utcnow() + timedelta(seconds=30))
        s.commit()
    for _ in range(2):  # fires once; the second check finds it holding already
        with Session(engine) as s:
            fired = rules.check_stalls(s, now=utcnow() + timedelta(seconds=90))
            s.commit()
        assert ((rule["id"], run_id) in fired) == (_ == 0)
    post_metrics(client, run_id, "loss", {1: 1.0})
    assert alert_events(client, auth, run_id) == [("stall", "fired", None), ("stall", "cleared", None)]


def test_attempts_run_out_then_failed(
    client: Any, auth: dict[str, str], endpoint: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain attempt function (no worker here): nothing listens at the endpoint's port."""
    from sqlmodel import Session

    from server.alerts import webhooks
    from server.core.config import settings
    from server.core.db import engine

    monkeypatch.setattr(settings, "WEBHOOK_MAX_ATTEMPTS", 2)
    monkeypatch.setattr(settings, "WEBHOOK_BACKOFF_BASE_S", 3.0)
    fire_once(client, auth)
    (row,) = _delivery_rows(endpoint["id"])
    with Session(engine) as s:
        first = webhooks.attempt(s, row.id)
        replay = client.post(f"/api/deliveries/{row.id}/replay", headers=auth)  # a second chain: refused
        assert (replay.status_code, replay.json()) == (
            409,
            {"detail": f"delivery {row.id} is still being retried (attempt 1 of 2); replay it once it has ended"},
        )
        second = webhooks.attempt(s, row.id)
        third = webhooks.attempt(s, row.id)
    assert first[0].startswith(f"retry: delivery {row.id} attempt 1: ConnectError") and first[1] == 3.0
    assert second[0].startswith(f"failed: delivery {row.id} after 2 attempts: ConnectError") and second[1] is None
    assert third == (f"skipped: delivery {row.id} is failed", None)
    (log,) = deliveries(client, auth, endpoint["id"])
    assert log["status"] == "failed" and log["attempts"] == 2 and log["status_code"] is None and log["replays"] == 0


def test_pending_deliveries_untouched_too_long_are_enqueued_again(
    client: Any, auth: dict[str, str], endpoint: dict[str, Any]
) -> None:
    from sqlmodel import Session

    from server.alerts import webhooks
    from server.core.config import settings
    from server.core.db import engine
    from server.models import utcnow

    fire_once(client, auth)
    (row,) = _delivery_rows(endpoint["id"])
    limit = 2 * settings.WEBHOOK_BACKOFF_MAX_S + settings.WEBHOOK_TIMEOUT_S
    with Session(engine) as s:
        assert row.id not in webhooks.requeue_stuck(s, now=row.updated_at + timedelta(seconds=limit - 5))
        assert row.id in webhooks.requeue_stuck(s, now=row.updated_at + timedelta(seconds=limit + 5))
        s.rollback()  # nothing enqueued
        with Session(engine) as s2:
            webhooks.attempt(s2, row.id)  # refused by the closed port: attempts 1, still pending, touched now
        assert row.id not in webhooks.requeue_stuck(s, now=utcnow() + timedelta(seconds=limit - 5))


def test_editing_a_rule_changes_what_fires(client: Any, auth: dict[str, str]) -> None:
    run_id = new_run()
    rule = add_rule(client, auth, run_id, kind="threshold", metric="reward_mean", op="<", value=0.2)
    post_metrics(client, run_id, "reward_mean", {1: 0.3}, source="orchestrator")
    url = f"/api/alerts/rules/{rule['id']}"
    new = {"kind": "threshold", "metric": "reward_mean", "op": "<", "value": 0.5}
    patched = client.patch(url, json={"rule": new}, headers=auth)
    assert patched.status_code == 200 and patched.json()["rule"]["value"] == 0.5, patched.text
    post_metrics(client, run_id, "reward_mean", {2: 0.3}, source="orchestrator")
    assert client.patch(url, json={"enabled": False}, headers=auth).json()["enabled"] is False
    post_metrics(client, run_id, "reward_mean", {3: 0.9, 4: 0.1}, source="orchestrator")  # not checked
    assert alert_events(client, auth, run_id) == [("threshold", "fired", 2)]
    other_kind = client.patch(url, json={"rule": {"kind": "stall", "seconds": 5}}, headers=auth)
    assert other_kind.status_code == 422
    assert other_kind.json()["detail"] == f"rule.kind: rule {rule['id']} is a threshold rule, got 'stall'"
    bad = client.patch(url, json={"rule": {**new, "window": 0}}, headers=auth)
    assert bad.status_code == 422
    assert bad.json()["detail"].startswith("body.rule.threshold.window: Input should be greater than or equal to 1")
    assert client.patch("/api/alerts/rules/999999", json={"enabled": True}, headers=auth).status_code == 404


def test_a_rule_added_while_the_run_is_over_its_threshold_fires_at_once(client: Any, auth: dict[str, str]) -> None:
    """Judged at the newest stored step when added, not only at the next point (issue 21: it said "ok" until then)."""
    run_id = new_run()
    post_metrics(client, run_id, "mismatch_kl", {1: 0.0, 2: 0.5, 3: 0.6})
    url = f"/api/runs/{run_id}/alerts/rules"
    over = {"kind": "threshold", "metric": "mismatch_kl", "op": ">", "value": 0.1, "window": 2}
    assert client.post(url, headers=auth, json=over).status_code == 201
    assert alert_events(client, auth, run_id) == [("threshold", "fired", 3)]
    # a rule not holding at step 3 is ok from there: the next points are judged as they come, once each
    under = {"kind": "threshold", "metric": "mismatch_kl", "op": ">", "value": 0.55, "window": 2}
    assert client.post(url, headers=auth, json=under).status_code == 201
    assert alert_events(client, auth, run_id) == [("threshold", "fired", 3)]
    post_metrics(client, run_id, "mismatch_kl", {4: 0.7})
    assert alert_events(client, auth, run_id) == [("threshold", "fired", 3), ("threshold", "fired", 4)]
    # a throughput rule: the newest value under half the median of the 2 before it
    post_metrics(client, run_id, "tokens_per_s", {1: 100.0, 2: 120.0, 3: 40.0})
    slow = {"kind": "throughput", "metric": "tokens_per_s", "fraction": 0.5, "window": 2}
    assert client.post(url, headers=auth, json=slow).status_code == 201
    assert alert_events(client, auth, run_id)[-1] == ("throughput", "fired", 3)
    # a run without points yet: nothing to judge, nothing recorded
    empty = new_run()
    assert client.post(f"/api/runs/{empty}/alerts/rules", headers=auth, json=over).status_code == 201
    assert alert_events(client, auth, empty) == []
