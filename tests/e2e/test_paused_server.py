"""A run started against a vLLM server left paused (an orchestrator killed between the pause and the resume of a
weight update never resumes it) resumes the server once no update can own the pause, records ``inference_resumed``
and completes, instead of waiting on its first request forever (the CI hang of the curriculum kill/resume test)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from worker.inference.client import InferenceClient
from worker.run.rundir import RunDir, read_jsonl

pytestmark = pytest.mark.vllm
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "reverse_text"


def test_a_run_resumes_a_server_left_paused_and_completes(tiny_model: Path, vllm_server: Any, tmp_path: Path) -> None:
    async def pause() -> bool:
        async with InferenceClient(vllm_server.url) as client:
            await client.pause("keep")
            return await client.is_paused()

    assert asyncio.run(pause())  # as a killed orchestrator leaves it: paused, nobody to resume it
    cmd = [
        sys.executable, "-m", "worker.cli", "rl", "@", str(CONFIGS / "rl.toml"),
        "--model.name", str(tiny_model), "--inference.url", vllm_server.url,
        "--output_dir", str(tmp_path), "--name", "paused", "--max_steps", "2",
        "--orchestrator.batch_size", "2", "--orchestrator.group_size", "2", "--orchestrator.max_tokens", "8",
        "--orchestrator.eval.interval", "0", "--env.args.num_train", "8",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, timeout=400)
    out = done.stdout.decode()[-3000:] + done.stderr.decode()[-2000:]
    assert done.returncode == 0, out
    events = read_jsonl(RunDir(tmp_path / "paused").events)
    resumed = [e for e in events if e["event"] == "inference_resumed"]
    assert [e["url"] for e in resumed] == [vllm_server.url], events
    assert "left paused" in resumed[0]["reason"]
    assert events[-1]["event"] == "completed", events[-1]

    async def paused_now() -> bool:
        async with InferenceClient(vllm_server.url) as client:
            return await client.is_paused()

    assert not asyncio.run(paused_now())
