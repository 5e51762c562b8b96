"""Webhook deliveries through a real Celery worker on the real Redis to a real HTTP receiver on 127.0.0.1:
episodes, signatures, retries with backoff, a receiver down for 60 s, replay. (A worker killed mid-delivery:
``test_alerts_kill.py``.)"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.alerts import (
    Receiver,
    alert_events,
    delivered,
    deliveries,
    fire_once,
    new_run,
    post_metrics,
    signed_ok,
)
from tests.support.server import run_token_headers, wait_for


@pytest.fixture
def hook(client: Any, auth: dict[str, str], receiver: Receiver) -> Iterator[dict[str, Any]]:
    """An endpoint for threshold alerts at the receiver (its secret in the response), deleted afterwards."""
    resp = client.post("/api/webhooks", json={"url": receiver.url, "events": ["threshold"]}, headers=auth)
    assert resp.status_code == 201, resp.text
    yield resp.json()
    client.delete(f"/api/webhooks/{resp.json()['id']}", headers=auth)


@pytest.mark.usefixtures("worker")
def test_threshold_alert_arrives_once_per_episode_signed(
    client: Any, auth: dict[str, str], receiver: Receiver, hook: dict[str, Any]
) -> None:
    run_id = new_run()
    resp = client.post(
        f"/api/runs/{run_id}/alerts/rules",
        headers=auth,
        json={"kind": "threshold", "metric": "mismatch_kl", "op": ">", "value": 0.1, "window": 2},
    )
    assert resp.status_code == 201, resp.text
    for step, value in enumerate([0.0, 0.5, 0.6, 0.7, 0.0, 0.3, 0.4, 0.5], start=1):  # holds 3-4, clears, holds 7-8
        post_metrics(client, run_id, "mismatch_kl", {step: value})
    logged = delivered(client, auth, hook["id"], 2)
    time.sleep(2)  # nothing more arrives
    assert len(receiver.requests) == 2 and len(receiver.bodies) == 2
    assert [d["attempts"] for d in logged] == [1, 1] and [d["status_code"] for d in logged] == [200, 200]
    assert all(d["latency_ms"] > 0 for d in logged)
    assert all(signed_ok(hook["secret"], r) for r in receiver.requests)
    assert not signed_ok("whsec_another-secret-entirely", receiver.requests[0])
    bodies = [json.loads(r.body) for r in receiver.requests]
    assert [(b["event"], b["state"], b["step"], b["run"]["id"]) for b in bodies] == [
        ("threshold", "fired", 3, run_id),
        ("threshold", "fired", 7, run_id),
    ]
    assert [r.key for r in receiver.requests] == [d["idempotency_key"] for d in logged] == [b["id"] for b in bodies]
    assert bodies[0]["message"] == "trainer/mismatch_kl > 0.1 for 2 steps: fired at step 3"
    assert alert_events(client, auth, run_id) == [
        ("threshold", "fired", 3),
        ("threshold", "cleared", 5),
        ("threshold", "fired", 7),
    ]


@pytest.mark.usefixtures("worker")
def test_500_twice_is_retried_with_backoff_then_delivered(
    client: Any, auth: dict[str, str], receiver: Receiver, hook: dict[str, Any]
) -> None:
    receiver.codes = [500, 500]
    fire_once(client, auth)
    (log,) = delivered(client, auth, hook["id"], 1)
    assert log["attempts"] == 3 and log["status_code"] == 200 and log["last_error"] == ""
    times = [r.time for r in receiver.requests]
    assert len(times) == 3 and len({r.key for r in receiver.requests}) == 1 and len(receiver.bodies) == 1
    assert 0.45 <= times[1] - times[0] and 0.95 <= times[2] - times[1]  # backoff 0.5 s, then 1 s
    assert receiver.requests[0].body == receiver.requests[2].body


@pytest.mark.timing  # >= 14 attempts in 60 s, 3 within 30 s: a loaded box (pass 1's 4 processes) delayed them
@pytest.mark.usefixtures("worker")
def test_receiver_down_60s_then_delivered(
    client: Any, auth: dict[str, str], receiver: Receiver, hook: dict[str, Any]
) -> None:
    receiver.stop()
    down = time.monotonic()
    fire_once(client, auth)
    (log,) = wait_for(
        lambda: (d := deliveries(client, auth, hook["id"])) and d[0]["attempts"] >= 3 and d, 30, "3 refused attempts"
    )
    assert log["status"] == "pending" and log["last_error"].startswith("ConnectError")
    time.sleep(60 - (time.monotonic() - down))
    tried = deliveries(client, auth, hook["id"])[0]["attempts"]
    receiver.start()
    (log,) = delivered(client, auth, hook["id"], 1, timeout=30)
    assert tried >= 14 and log["attempts"] == tried + 1 and log["status_code"] == 200
    assert len(receiver.requests) == 1 and len(receiver.bodies) == 1


@pytest.mark.usefixtures("worker")
def test_replay_sends_the_same_body_and_key(
    client: Any, auth: dict[str, str], receiver: Receiver, hook: dict[str, Any]
) -> None:
    fire_once(client, auth)
    (first,) = delivered(client, auth, hook["id"], 1)
    replay = client.post(f"/api/deliveries/{first['id']}/replay", headers=auth)
    assert replay.status_code == 200 and replay.json()["status"] == "pending" and replay.json()["replays"] == 1
    wait_for(lambda: len(receiver.requests) == 2, 30, "the replayed request")
    (log,) = delivered(client, auth, hook["id"], 1)
    assert log["attempts"] == 1 and log["replays"] == 1 and log["idempotency_key"] == first["idempotency_key"]
    assert [r.key for r in receiver.requests] == [first["idempotency_key"]] * 2
    assert receiver.requests[0].body == receiver.requests[1].body and len(receiver.bodies) == 1
    assert client.post("/api/deliveries/999999/replay", headers=auth).status_code == 404


@pytest.mark.usefixtures("worker")
def test_failed_policy_check_alerts_once_through_the_built_in_rule(
    client: Any, auth: dict[str, str], receiver: Receiver
) -> None:
    """Case C14's alert with no rule added: the run's ``policy_check_failed`` event, as its supervisor forwards it
    (sent twice: the second records nothing), fires the built-in ``policy_check`` rule once, signed, with the check's
    reason. The rule is no stored row: the run's rule list stays empty (its cap untouched)."""
    resp = client.post("/api/webhooks", json={"url": receiver.url}, headers=auth)  # default filter: every kind
    assert resp.status_code == 201 and "policy_check" in resp.json()["events"], resp.text
    hook = resp.json()
    run_id = new_run()
    reason = (
        "orchestrator.policy_check: policy version 1: the served log-probs differ from the trainer's by up to 0.727 "
        "nats (tolerance 0.001): inference does not serve the published policy"
    )
    data = {"step": 1, "max_abs_diff": 0.727, "moved_from_base": False, "tolerance": 0.001, "on_fail": "fail"}
    event = {"event": "policy_check_failed", "time": time.time(), "reason": reason, "process": "orchestrator"}
    for recorded in (1, 0):
        sent = client.post(
            f"/api/runs/{run_id}/events", json={"events": [{**event, "data": data}]}, headers=run_token_headers(run_id)
        )
        assert sent.status_code == 200 and sent.json() == {"recorded": recorded}, sent.text
    (log,) = delivered(client, auth, hook["id"], 1)
    time.sleep(2)  # nothing more arrives
    assert len(receiver.requests) == 1 and signed_ok(hook["secret"], receiver.requests[0])
    body = json.loads(receiver.requests[0].body)
    assert (body["event"], body["state"], body["step"], body["rule_id"], body["run"]["id"]) == (
        "policy_check",
        "fired",
        1,
        None,
        run_id,
    )
    assert body["message"] == f"policy_check_failed (built-in rule policy_check): {reason}"
    assert body["data"] == {"event": "policy_check_failed", "reason": reason, **data, "time": event["time"]} | {
        "process": "orchestrator"
    }
    assert body["id"] == log["idempotency_key"]
    assert alert_events(client, auth, run_id) == [("policy_check", "fired", 1)]
    assert client.get(f"/api/runs/{run_id}/alerts/rules", headers=auth).json()["count"] == 0
    client.delete(f"/api/webhooks/{hook['id']}", headers=auth)
