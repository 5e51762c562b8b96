"""``/healthz`` against the real Postgres and Redis: the broker and a real Celery worker up, the broker at a closed
port, no worker on the queue, and a worker that stopped (its heartbeat expires); the embedded broker's folder."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import free_port, start_celery_worker, stop_process_group, wait_for


@pytest.mark.usefixtures("worker")
def test_broker_up_and_a_worker_up_is_ok(client: Any) -> None:
    resp = client.get("/healthz")
    assert (resp.status_code, resp.json()) == (
        200,
        {"status": "ok", "database": "postgresql", "broker": "redis", "worker": "ok"},
    )


def test_broker_down_is_503_naming_host_and_port_within_2_s(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from server.core.config import settings

    port = free_port()  # nothing listens there
    monkeypatch.setattr(settings, "CELERY_BROKER_URL", f"redis://:hunter2@127.0.0.1:{port}/0")
    start = time.monotonic()
    resp = client.get("/healthz")
    assert time.monotonic() - start < 2.0
    assert (resp.status_code, resp.json()) == (
        503,
        {
            "status": "degraded",
            "database": "postgresql",
            "broker": "redis",
            "worker": "unknown",
            "reason": f"broker: redis at 127.0.0.1:{port} does not answer",
        },
    )
    assert "hunter2" not in resp.text


def test_no_worker_on_the_queue_is_degraded_but_200(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """200: the server still takes submits (they wait in the queue), and the compose stack starts its worker only
    once the server is healthy."""
    from server.core.config import settings

    monkeypatch.setattr(settings, "CELERY_QUEUE", f"asyncrl-test-unserved-{secrets.token_hex(3)}")
    resp = client.get("/healthz")
    assert (resp.status_code, resp.json()) == (
        200,
        {
            "status": "degraded",
            "database": "postgresql",
            "broker": "redis",
            "worker": "missing",
            "reason": "worker: no worker answered in 30 s",
        },
    )


def test_a_stopped_worker_stops_counting_after_three_missed_beats(
    live_server: str, client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.core.config import settings

    queue = f"asyncrl-test-beat-{secrets.token_hex(3)}"
    monkeypatch.setattr(settings, "CELERY_QUEUE", queue)
    monkeypatch.setattr(settings, "WORKER_HEARTBEAT_S", 1.0)
    proc = start_celery_worker(live_server, tmp_path / "worker.log", CELERY_QUEUE=queue, WORKER_HEARTBEAT_S="1")
    try:
        assert client.get("/healthz").json()["worker"] == "ok"
        time.sleep(4)  # beats every second keep it fresh past the 3 s window
        assert client.get("/healthz").json()["worker"] == "ok"
    finally:
        stop_process_group(proc)
    body = wait_for(lambda: (b := client.get("/healthz").json())["worker"] == "missing" and b, 10, "expired beat")
    assert body["reason"] == "worker: no worker answered in 3 s"


def test_embedded_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded broker's heartbeat is a file in its folder; a folder that is gone is the broker's problem."""
    from server.core import health
    from server.core.config import settings
    from server.jobs import heartbeat

    monkeypatch.setattr(settings, "ASYNCRL_HOME", tmp_path)
    monkeypatch.setattr(settings, "CELERY_BROKER_URL", "filesystem://")
    (tmp_path / "broker").mkdir()
    assert health.report("sqlite") == (
        200,
        {
            "status": "degraded",
            "database": "sqlite",
            "broker": "embedded",
            "worker": "missing",
            "reason": "worker: no worker answered in 30 s",
        },
    )
    heartbeat.beat("w1")
    assert health.report("sqlite") == (
        200,
        {"status": "ok", "database": "sqlite", "broker": "embedded", "worker": "ok"},
    )
    beat_file = tmp_path / "broker" / f".heartbeat-{settings.CELERY_QUEUE}"
    os.utime(beat_file, (time.time() - 31, time.time() - 31))  # the last beat 31 s ago
    assert health.report("sqlite")[1]["worker"] == "missing"
    beat_file.unlink()
    (tmp_path / "broker").rmdir()
    assert health.report("sqlite") == (
        503,
        {
            "status": "degraded",
            "database": "sqlite",
            "broker": "embedded",
            "worker": "unknown",
            "reason": "broker: the embedded broker's folder is missing or not writable",
        },
    )
