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
    assert 0.0 <= result["reward_after_sft"] <= 1.0 and 0.0 <= result["reward_after_rl"] <= 1.0
    assert "run 1: running -> completed" in done.stdout
