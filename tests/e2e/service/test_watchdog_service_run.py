"""Case C18 through the service: a live run (its own vLLM server, supervisor, Celery worker, API on Postgres) whose
inference server gets SIGSTOP for longer than ``watchdog.no_progress_s``. The supervisor's ``stalled`` event names
inference, the run's ``status`` rule on ``stalled`` fires once and its webhook arrives signed at a real receiver on
127.0.0.1; after SIGCONT the run completes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.alerts import Receiver, alert_events, delivered, signed_ok
from tests.support.runs import real_spec, run_of, trainer_steps
from tests.support.server import ApiServer, start_celery_worker, stop_process_group, wait_for
from worker.run.rundir import RunDir, read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.timing]  # the alert within NO_PROGRESS_S + SLACK_S: alone
NO_PROGRESS_S = 8.0
SLACK_S = 8.0
"""Past the no-progress time until the webhook arrives: the watchdog's loop, heartbeat and probe (up to 3.5 s), the
supervisor's event forwarding (1 s period), the delivery task, and the 2-core machine's scheduling."""


def test_c18_a_stopped_inference_server_alerts_once_and_the_run_completes(
    client: Any, auth: dict[str, str], model: Path, api: ApiServer, tmp_path: Path
) -> None:
    receiver = Receiver().start()
    hook = client.post("/api/webhooks", json={"url": receiver.url, "events": ["status"]}, headers=auth).json()
    worker = start_celery_worker(api.url, tmp_path / "worker.log")
    pgid = None
    try:
        spec = {
            **real_spec(model, "watchdog-live", max_steps=5),
            "alerts": [{"kind": "status", "statuses": ["stalled"]}],
            "watchdog": {"no_progress_s": NO_PROGRESS_S},
        }
        resp = client.post("/api/runs", json=spec, headers=auth)
        assert resp.status_code == 201, resp.text
        run_id = resp.json()["id"]
        run = RunDir(resp.json()["run_dir"])
        wait_for(lambda: trainer_steps(client, auth, run_id), 300, "trainer step 1")
        (running,) = [e for e in read_jsonl(run.events) if e["event"] == "running"]
        pgid = running["pids"]["inference"]  # the vLLM server leads its process group (its EngineCore is in it)
        t_stop = time.time()
        os.killpg(pgid, signal.SIGSTOP)
        (arrived,) = delivered(client, auth, hook["id"], 1, timeout=NO_PROGRESS_S + SLACK_S + 30)
        t_alert = time.time()
        os.killpg(pgid, signal.SIGCONT)
        done = wait_for(
            lambda: (r := run_of(client, auth, run_id))["status"] in {"completed", "failed", "cancelled"} and r,
            180,
            "run ended",
        )
        time.sleep(2)  # nothing more arrives
    finally:
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError):  # the run ended: its server with it
                os.killpg(pgid, signal.SIGCONT)
        stop_process_group(worker)
        receiver.stop()
        client.delete(f"/api/webhooks/{hook['id']}", headers=auth)
    print(f"C18 service: webhook {t_alert - t_stop:.1f}s after SIGSTOP (no_progress_s {NO_PROGRESS_S:g})")
    assert done["status"] == "completed", done["status_reason"]
    assert trainer_steps(client, auth, run_id) == [1, 2, 3, 4, 5]
    assert t_alert - t_stop <= NO_PROGRESS_S + SLACK_S
    assert alert_events(client, auth, run_id) == [("status", "fired", None)]
    assert len(receiver.requests) == 1 and signed_ok(hook["secret"], receiver.requests[0])
    body = json.loads(receiver.requests[0].body)
    assert body["event"] == "status" and body["run"]["id"] == run_id
    assert body["message"].startswith(f"run status stalled: run {run_id} is stalled (no progress for ")
    assert "inference not answering" in body["message"]
    events = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    (stalled,) = [e for e in events if e["kind"] == "stalled"]
    assert (stalled["data"]["component"], stalled["data"]["waiting"]) == ("inference", "orchestrator")
    assert [e["kind"] for e in events].count("progress_resumed") == 1
    assert arrived["status"] == "delivered"
