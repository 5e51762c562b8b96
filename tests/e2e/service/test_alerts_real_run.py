"""A live RL run through the service posts its alerts: the spec's ``alerts`` list becomes the run's rules, the
supervisor's metric batches are checked on ingest, and the webhooks arrive signed at a real receiver on 127.0.0.1
(one per episode of the threshold rule, one for ``completed``). The run's vLLM metrics (``vllm``) are stored with
the others."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.alerts import Receiver, alert_events, delivered, signed_ok
from tests.support.runs import real_spec, run_of
from tests.support.server import ApiServer, start_celery_worker, stop_process_group, wait_for

pytestmark = pytest.mark.vllm


def episodes(values: list[float | None], threshold: float) -> list[int]:
    """Indices where ``value > threshold`` starts holding (a null, i.e. non-finite, value does not hold)."""
    holding = [v is not None and v > threshold for v in values]
    return [i for i, h in enumerate(holding) if h and (i == 0 or not holding[i - 1])]


def test_live_run_posts_its_alerts(
    client: Any,
    auth: dict[str, str],
    model: Path,
    api: ApiServer,
    tmp_path: Path,
) -> None:
    receiver = Receiver().start()
    hook = client.post(
        "/api/webhooks", json={"url": receiver.url, "events": ["threshold", "status"]}, headers=auth
    ).json()
    worker = start_celery_worker(api.url, tmp_path / "worker.log")
    try:
        alerts = [
            {"kind": "threshold", "metric": "mismatch_kl", "op": ">", "value": -1.0},
            {"kind": "status", "statuses": ["completed", "failed"]},
        ]
        spec = {**real_spec(model, "alerts-live", max_steps=4), "alerts": alerts}
        resp = client.post("/api/runs", json=spec, headers=auth)
        assert resp.status_code == 201, resp.text
        run_id = resp.json()["id"]
        done = wait_for(
            lambda: (r := run_of(client, auth, run_id))["status"] in {"completed", "failed"} and r, 400, "run ended"
        )
        assert done["status"] == "completed", done["status_reason"]
        series = client.get(f"/api/runs/{run_id}/metrics", params={"name": "mismatch_kl"}, headers=auth).json()
        (trainer,) = [s for s in series["series"] if s["source"] == "trainer"]
        assert trainer["step"] == [1, 2, 3, 4]
        fired_at = [trainer["step"][i] for i in episodes(trainer["value"], -1.0)]
        # vLLM's own metrics of the run's server (read with the run's key), stored like any other: every step
        for name in ("kv_cache_usage", "requests_running", "requests_waiting"):
            got = client.get(f"/api/runs/{run_id}/metrics", params={"name": name}, headers=auth).json()
            (served,) = [s for s in got["series"] if s["source"] == "vllm"]
            assert served["step"] == [1, 2, 3, 4], (name, served)
            if name == "kv_cache_usage":
                assert all(0.0 <= v <= 1.0 for v in served["value"]), served
            else:
                assert all(v >= 0 and v == int(v) for v in served["value"]), (name, served)
        assert fired_at[:1] == [1]  # the first step holds: mismatch_kl >= 0
        logged = delivered(client, auth, hook["id"], len(fired_at) + 1, timeout=60)
        time.sleep(2)  # nothing more arrives
    finally:
        stop_process_group(worker)
        receiver.stop()
        client.delete(f"/api/webhooks/{hook['id']}", headers=auth)
    fired = [(k, s) for k, state, s in alert_events(client, auth, run_id) if state == "fired"]
    assert fired == [("threshold", s) for s in fired_at] + [("status", None)]
    bodies = [json.loads(r.body) for r in receiver.requests]
    assert sorted(((b["event"], b["step"]) for b in bodies), key=str) == sorted(fired, key=str)
    assert len(receiver.requests) == len(receiver.bodies) == len(logged) == len(fired_at) + 1
    assert all(signed_ok(hook["secret"], r) for r in receiver.requests)
    assert all(b["run"]["id"] == run_id for b in bodies)
    assert any(b["message"].startswith(f"run status completed or failed: run {run_id} is completed") for b in bodies)
