"""The README's first command, ``asyncrl demo``, run as a user runs it (a subprocess, its own embedded service), cut
to a few steps: SFT writes its model outside the service's folder and the service must still take the RL run that
names it (a 422 there once made the demo fail after its whole SFT stage), and the summary must say ``completed``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def test_the_demo_completes_through_its_own_service(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    argv = ["demo", "--output-dir", str(tmp_path / "demo"), "--summary", str(summary), "--sft-steps", "4"]
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", *argv, "--rl-steps", "2"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["status"] == "completed" and result["steps"] == 2 and result["sft_steps"] == 4
    assert result["run_dir"].startswith(str(tmp_path / "demo" / "service" / "outputs"))
    assert "run 1: running -> completed" in done.stdout
    # the summary's numbers are the runs' own records: the RL run's online evals at version 0 and at its last version
    # (metrics.jsonl), the SFT run's greedy eval and the eval stage's reward (their summary.json)
    rows = [json.loads(line) for line in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    evals = sorted((r for r in rows if r["source"] == "eval"), key=lambda r: r["step"])
    assert [e["step"] for e in evals][0] == 0 and evals[-1]["step"] == 2
    assert (result["reward_after_sft"], result["reward_after_rl"]) == (
        evals[0]["reward_mean"],
        evals[-1]["reward_mean"],
    )
    assert result["reward_gain"] == evals[-1]["reward_mean"] - evals[0]["reward_mean"]
    assert all(0.0 <= e["reward_mean"] <= 1.0 for e in evals)
    runs = Path(result["run_dir"]).parents[1]  # <outputs>/runs/<id>/<name>
    stage = {
        k: json.loads(next((runs / str(result[k])).glob("*/summary.json")).read_text())
        for k in ("sft_run_id", "eval_run_id")
    }
    assert result["sft_greedy_eval_reward"] == stage["sft_run_id"]["eval_reward_greedy"]
    assert result["eval_reward_greedy"] == stage["eval_run_id"]["reward_mean"] and result["eval_temperature"] == 0.0
    assert stage["sft_run_id"]["status"] == stage["eval_run_id"]["status"] == "completed"
    # trained on policy at fp32 on the CPU: the served and trained log-probs agree (mismatch_kl ~1e-13 on policy)
    assert result["mismatch_kl_on_policy"] is not None and 0.0 <= result["mismatch_kl_on_policy"] <= 1e-3
