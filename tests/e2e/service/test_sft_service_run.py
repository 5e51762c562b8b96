"""SFT through the service (issue 22): an SFT spec submitted by REST runs on a real Celery worker (Redis) under its
supervisor as one process, the SFT trainer, on the tiny random-init Qwen3 and a JSONL file of chat messages under
``DATA_ROOTS``. Stopped after its first complete checkpoint, resumed through the API (same id and run directory),
it completes; every step's loss is stored as the run directory's ``metrics.jsonl`` has it (the steps the stopped
attempt measured after its checkpoint are replaced by the resumed attempt's), the held-out loss of the last step
too, and the trainer's log is read through the logs route.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import ended
from tests.support.server import wait_for
from worker.run.checkpoint import complete_steps
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import load_spec_data

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
MAX_STEPS = 40


def _rows(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for split, n in (("train", 24), ("eval", 8)):
        path = folder / f"{split}.jsonl"
        argv = ["--args", '{"system_message": false}', "--split", split, "--num-examples", str(n), "--out", str(path)]
        subprocess.run([sys.executable, "scripts/sft_rows_from_env.py", *argv], check=True, cwd=REPO)
        out.append(path)
    return out[0], out[1]


def _series(client: Any, auth: dict[str, str], run_id: int, name: str) -> dict[int, float]:
    body = client.get(f"/api/runs/{run_id}/metrics", params={"name": name}, headers=auth).json()
    return {s: v for x in body["series"] if x["source"] == "sft" for s, v in zip(x["step"], x["value"], strict=True)}


def test_sft_run_submitted_by_rest_stops_resumes_and_completes(client: Any, auth: dict[str, str], service: str) -> None:
    train, held_out = _rows(Path(os.environ["ASYNCRL_OUTPUT_DIR"]) / "data" / "sft-service")
    overrides = {
        "name": "sft-svc",
        "model.name": service,
        "data.path": str(train),
        "data.eval_path": str(held_out),
        "data.batch_size": "4",
        "data.shuffle": "true",
        "max_steps": str(MAX_STEPS),
        "scheduler.warmup_steps": "2",
        "ckpt.interval": "2",
        "eval_examples": "4",
        "threads": "1",
    }
    spec = load_spec_data([REPO / "configs/reverse_text/sft.toml"], list(overrides.items()))
    resp = client.post("/api/runs", json=spec, headers=auth)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    assert run["kind"] == "sft"
    rd = RunDir(run["run_dir"])
    wait_for(lambda: complete_steps(rd), 120, "first complete checkpoint")
    assert client.post(f"/api/runs/{run['id']}/stop", headers=auth).status_code == 200
    stopped = ended(client, auth, run["id"], 60)
    assert stopped["status"] == "cancelled", stopped["status_reason"]
    assert not rd.summary.exists() or '"completed"' not in rd.summary.read_text()
    ckpt = complete_steps(rd)[-1]
    assert ckpt < MAX_STEPS, "the run completed before it was stopped: raise MAX_STEPS"

    resp = client.post(f"/api/runs/{run['id']}/resume", headers=auth)
    assert resp.status_code == 200 and resp.json()["status"] == "queued", resp.text
    try:
        done = ended(client, auth, run["id"], 120)
    except AssertionError:
        home = rd.root.parent
        logs = [home / "supervisor.log", rd.events]
        raise AssertionError("\n".join(p.read_text()[-3000:] for p in logs if p.exists())) from None
    assert done["status"] == "completed", done["status_reason"]
    starts = [e["resume_step"] for e in read_jsonl(rd.events) if e["event"] == "starting"]
    assert starts == [None, ckpt]
    rows = {r["step"]: r for r in read_jsonl(rd.metrics) if r["source"] == "sft"}
    assert sorted(rows) == list(range(1, MAX_STEPS + 1))
    stored = _series(client, auth, run["id"], "loss")
    assert stored == pytest.approx({s: r["loss"] for s, r in rows.items()}, rel=1e-12)
    assert _series(client, auth, run["id"], "eval_loss") == pytest.approx({MAX_STEPS: rows[MAX_STEPS]["eval_loss"]})
    assert (rd.final / "model.safetensors").is_file()
    events = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
    assert [e["to_status"] for e in events if e["kind"] == "status"] == [
        "queued",
        "starting",
        "running",
        "cancelled",
        "queued",
        "starting",
        "running",
        "completed",
    ]
    log = client.get(f"/api/runs/{run['id']}/logs", params={"process": "trainer"}, headers=auth).json()
    assert any(f"sft step {MAX_STEPS:>4}/{MAX_STEPS}" in line for line in log["lines"]), log
