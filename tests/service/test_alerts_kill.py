"""kill -9 of the Celery worker while a webhook request is in flight: the broker redelivers the unacked task
to a new worker once the visibility timeout (60 s here) passed, the request is sent again with the same
``Idempotency-Key``, and a receiver that dedups on it records the event exactly once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from tests.support.alerts import Receiver, delivered, deliveries, fire_once
from tests.support.server import start_celery_worker, stop_process_group

VISIBILITY_S = 60


def test_kill_9_mid_delivery_no_duplicate_at_the_receiver(
    client: Any, auth: dict[str, str], live_server: str, tmp_path: Path
) -> None:
    from server.jobs.celery_app import app

    app.control.purge()
    env = {
        "CELERY_VISIBILITY_TIMEOUT_S": str(VISIBILITY_S),
        "WEBHOOK_BACKOFF_BASE_S": "0.5",
        "WEBHOOK_BACKOFF_MAX_S": "4",
    }
    receiver = Receiver(delays=[8.0]).start()  # the first request is answered only after 8 s
    hook = client.post("/api/webhooks", json={"url": receiver.url, "events": ["threshold"]}, headers=auth).json()
    first = start_celery_worker(live_server, tmp_path / "first.log", **env)
    second = None
    try:
        fire_once(client, auth)
        assert receiver.arrived.wait(30), "the first request never arrived"
        sent_at = time.monotonic()
        os.killpg(first.pid, signal.SIGKILL)  # mid-request: the receiver is still sleeping
        first.wait()
        (log,) = deliveries(client, auth, hook["id"])
        assert log["status"] == "pending" and log["attempts"] == 1
        time.sleep(max(0.0, VISIBILITY_S + 2 - (time.monotonic() - sent_at)))
        second = start_celery_worker(live_server, tmp_path / "second.log", **env)
        (log,) = delivered(client, auth, hook["id"], 1, timeout=90)
        time.sleep(2)  # nothing more arrives
    finally:
        if second is not None:
            stop_process_group(second)
        receiver.stop()
        client.delete(f"/api/webhooks/{hook['id']}", headers=auth)
    assert [r.key for r in receiver.requests] == [log["idempotency_key"]] * 2  # sent twice, same key
    assert receiver.requests[0].body == receiver.requests[1].body
    assert list(receiver.bodies) == [log["idempotency_key"]]  # recorded once
    assert log["attempts"] == 2 and log["status_code"] == 200
