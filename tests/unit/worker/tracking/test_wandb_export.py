"""W&B export (``worker/tracking/wandb_export.py``) in offline mode, read back from W&B's own transaction log: every
number of ``metrics.jsonl`` reaches the W&B run under ``<source>/<key>`` with its step, rows of different sources out of
step order included; events and live config revisions reach its ``events`` table; a resumed export continues the same
W&B run and logs no row twice."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import wait_for
from tests.support.wandb_offline import history, offline_runs, records
from worker.live_config import LIVE_CONFIG_FILE
from worker.run.rundir import RunDir, append_jsonl, read_jsonl
from worker.spec import RLSpec, SpecError, load_spec_data, validate_spec
from worker.tracking.wandb_export import STATE_FILE, WandbExport, metric_row


def _spec(**wandb: Any) -> RLSpec:
    return RLSpec.model_validate(
        {
            "name": "wb",
            "model": {"name": "m"},
            "monitor": {"wandb": {"project": "asyncrl-tests", "mode": "offline", **wandb}},
        }
    )


def _points(rows: list[dict[str, Any]]) -> set[tuple[int, str, float]]:
    return {
        (int(r["step"]), k, float(v)) for r in rows for k, v in r.items() if k != "step" and not isinstance(v, dict)
    }


def test_metric_row_names_and_drops_what_w_and_b_cannot_chart() -> None:
    row = {"source": "trainer", "step": 3, "time": 1.0, "loss": 0.25, "ok": True, "n": 7, "nan": float("nan"), "s": "x"}
    assert metric_row(row) == {"step": 3, "trainer/loss": 0.25, "trainer/n": 7}


def test_offline_run_holds_every_metric_event_and_revision_and_resume_logs_nothing_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = RunDir(tmp_path / "wb")
    run.create()
    run.log_metrics("orchestrator", 1, {"reward_mean": 0.25, "mismatch_kl": 1e-5})
    run.log_metrics("orchestrator", 2, {"reward_mean": 0.5, "mismatch_kl": 2e-5})  # a step ahead of the trainer
    run.log_metrics("trainer", 1, {"loss": 0.75, "step_time_s": 1.5})
    run.log_event("running", pids={"trainer": 1})
    export = WandbExport(_spec(tags=["a", "b"], group="g"), run)
    assert export.poll() == 3
    run.log_metrics("trainer", 2, {"loss": 0.625, "step_time_s": 1.25})
    run.log_metrics("eval", 2, {"reward_mean": 0.375, "pass_at_k": 0.5, "k": 1})
    append_jsonl(run.root / LIVE_CONFIG_FILE, {"revision": 1, "changes": {"trainer.optim.lr": 5e-5}, "time": 2.0})
    run.log_event("truncated", step=2, reason="8 of 16 rollouts hit max_tokens")
    export.finish("cancelled")
    first_id = json.loads((run.root / STATE_FILE).read_text())["id"]

    time.sleep(1.1)  # W&B names an offline attempt's folder by the second it started: two in one second would clash
    # resumed: the trainer's step 2 is read again (the resume pruned and rewrote the file), step 3 is new
    run.log_metrics("trainer", 3, {"loss": 0.5, "step_time_s": 1.0})
    resumed = WandbExport(_spec(), run)
    assert resumed.wb.id == first_id
    assert resumed.poll() == 1
    resumed.finish("completed")

    runs = offline_runs(run.root)
    assert len(runs) == 2 and all(p.name.endswith(first_id) for p in runs)  # the same W&B run, two attempts
    # W&B's service process writes the log's last records after finish() returned (seen under load: 7 of 8 rows)
    logged = wait_for(lambda: len(rows := [row for p in runs for row in history(p)]) >= 8 and rows, 20, "W&B's log")
    metric_rows = [r for r in logged if not any(k.startswith("events") for k in r)]
    stored = [metric_row(r) for r in read_jsonl(run.metrics)]
    assert _points(metric_rows) == _points(stored)  # every number, once
    assert len(metric_rows) == len(stored) == 6

    tables = [r for r in logged if any(k.startswith("events") for k in r)]
    assert [t.get("events/_type", t.get("events", {}).get("_type")) for t in tables] == ["table-file", "table-file"]
    events = [row for p in runs for row in table_rows(p)]
    assert [(e[0], e[2]) for e in events] == [(None, "running"), (2, "truncated"), (None, "config_revision")]
    assert json.loads(events[2][4])["changes"] == {"trainer.optim.lr": 5e-5}

    first = records(next(runs[0].glob("run-*.wandb")))
    keys = {u.key for r in first if r.HasField("config") for u in r.config.update}
    keys |= {u.key for r in first if r.HasField("run") for u in r.run.config.update}
    assert {"live/trainer.optim.lr", "monitor", "trainer", "orchestrator"} <= keys  # the spec, and the live change


def table_rows(offline_run: Path) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for path in sorted(offline_run.glob("files/media/table/events_*.table.json")):
        rows.extend(json.loads(path.read_text())["data"])
    return rows


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (["--monitor.wandb.mode", "cloud"], "monitor.wandb.mode: Input should be 'online' or 'offline', got 'cloud'"),
        (["--monitor.wandb.tags", '["' + "t" * 65 + '"]'], "monitor.wandb.tags: expected tags of 1-64 characters"),
        (["--monitor.wandb.project", ""], "monitor.wandb.project"),
        (["--monitor.wandb.entity", "a\x07b"], "monitor.wandb.entity: expected 1-128 characters without control"),
        (["--monitor.wandb.projekt", "p"], "unknown key 'monitor.wandb.projekt'"),
    ],
)
def test_bad_wandb_settings_are_one_line_naming_the_key(override: list[str], expected: str) -> None:
    argv = ["--model.name", "m", "--monitor.wandb.project", "p", *override]
    pairs = [(argv[i][2:], argv[i + 1]) for i in range(0, len(argv), 2)]
    with pytest.raises(SpecError) as err:
        validate_spec("rl", load_spec_data([], pairs))
    assert expected in str(err.value) and "\n" not in str(err.value)
