"""``worker/launchers/local.py``: the run summary."""

from __future__ import annotations

import math
from pathlib import Path

from worker.launchers.local import summarize
from worker.rundir import RunDir


def test_summary_mismatch_kl_leaves_out_steps_that_trained_nothing(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    for step, kl in enumerate([1e-6, 2e-6, 4e-6, math.nan, math.nan], start=1):  # steps 4, 5: every rollout dropped
        run.log_metrics("trainer", step, {"mismatch_kl": kl, "mismatch_kl_on_policy": kl})
    summary = summarize(run, 12.0, "completed")
    assert summary["mismatch_kl"] == (1e-6 + 2e-6 + 4e-6) / 3
    assert summary["mismatch_kl_on_policy"] == (1e-6 + 2e-6 + 4e-6) / 3 and summary["mismatch_kl_on_policy_steps"] == 3
    assert summary["steps"] == 5
