"""SFT from a JSONL file of chat messages (issue 22): killed with SIGKILL mid-run, ``asyncrl sft --resume`` continues
from the newest complete checkpoint and the loss curve after it is the uninterrupted run's (same seed; the data
cursor crosses an epoch end with a reshuffle, so a wrong cursor or shuffle order shows as a different loss).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.run.procs import free_port
from worker.run.rundir import read_jsonl

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 10
TOLERANCE = 1e-6
"""Relative difference allowed between the resumed and the uninterrupted loss of a step (float32 on CPU, one thread
count: measured 0, i.e. bit-identical; the bound leaves room for another BLAS)."""


def _sft(tmp: Path, model: Path, name: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "worker.cli",
        "sft",
        "@",
        str(REPO / "configs/reverse_text/sft.toml"),
        "--model.name",
        str(model),
        "--output_dir",
        str(tmp / "outputs"),
        "--name",
        name,
        "--data.path",
        str(tmp / "train.jsonl"),
        "--data.eval_path",
        str(tmp / "eval.jsonl"),
        "--data.shuffle",
        "true",
        "--data.eval_reward",
        "true",
        "--data.batch_size",
        "4",
        "--max_steps",
        str(MAX_STEPS),
        "--scheduler.warmup_steps",
        "2",
        "--ckpt.interval",
        "2",
        "--ckpt.keep",
        "2",
        "--eval_interval",
        "5",
        "--eval_examples",
        "4",
        *extra,
    ]


def _rows(tmp: Path) -> None:
    for split, n, out in (("train", 24, "train.jsonl"), ("eval", 8, "eval.jsonl")):
        argv = ["--args", '{"system_message": false}', "--split", split, "--num-examples", str(n)]
        subprocess.run(
            [sys.executable, "scripts/sft_rows_from_env.py", *argv, "--out", str(tmp / out)],
            check=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
        )


def test_kill_9_then_resume_repeats_the_uninterrupted_loss_curve(tmp_path: Path, tiny_model: Path) -> None:
    _rows(tmp_path)
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 24  # 6 steps of 4 rows per epoch
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(_sft(tmp_path, tiny_model, "whole"), cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    whole = {r["step"]: r for r in read_jsonl(tmp_path / "outputs/whole/metrics.jsonl")}
    assert sorted(whole) == list(range(1, MAX_STEPS + 1))
    assert [whole[s]["epoch"] for s in (5, 6, 7)] == [0, 1, 1]  # step 6 ends the first epoch

    killed_dir = tmp_path / "outputs/killed"
    proc = subprocess.Popen(_sft(tmp_path, tiny_model, "killed"), cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = killed_dir / "metrics.jsonl"
        if metrics.exists() and any(r["step"] >= 5 for r in read_jsonl(metrics)):
            break
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed_dir / "summary.json").exists()
    last = max(r["step"] for r in read_jsonl(killed_dir / "metrics.jsonl"))
    assert 5 <= last < MAX_STEPS

    resumed = subprocess.run(
        _sft(tmp_path, tiny_model, "killed", "--resume"), cwd=REPO, env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((killed_dir / "summary.json").read_text())
    k = summary["resumed_from"]
    assert summary["status"] == "completed" and k % 2 == 0 and 4 <= k <= last
    rows = read_jsonl(killed_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))  # steps after k dropped, then written again
    for r in rows:
        w = whole[r["step"]]
        for key in ("loss", "grad_norm", "lr", "epoch", "eval_loss", "eval_reward_greedy"):
            assert (key in r) == (key in w), (r["step"], key)
            if key in r:
                assert abs(r[key] - w[key]) <= TOLERANCE * max(abs(w[key]), 1.0), (r["step"], key, r[key], w[key])
    assert "eval_loss" in rows[4] and "eval_reward_greedy" in rows[-1]
    # two complete checkpoints kept (ckpt.keep), the newest at the last step, each with its data cursor
    steps = sorted(int(p.name.split("_")[1]) for p in (killed_dir / "checkpoints").iterdir())
    assert steps == [MAX_STEPS - 2, MAX_STEPS]
    cursor = json.loads((killed_dir / f"checkpoints/step_{MAX_STEPS}/orchestrator/data_cursor.json").read_text())
    assert (cursor["epoch"], cursor["offset"], cursor["num_rows"]) == (1, 16, 24)  # 40 rows = 24 + 16


def test_two_fsdp2_ranks_train_as_one_process(tmp_path: Path, tiny_model: Path) -> None:
    """``torchrun --nproc-per-node 2 -m worker.cli sft``: FSDP2 over two CPU ranks (gloo), each packing its share of
    the rows, logs the loss curve of the same run in one process (float32; measured difference 2.2e-7 at most)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    common = ["--data.num_examples", "64", "--data.batch_size", "8", "--eval_examples", "4", "--threads", "1"]
    torchrun = [
        str(Path(sys.executable).with_name("torchrun")),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    runs = {}
    for name, prefix in (("two", [*torchrun, "-m"]), ("one", [sys.executable, "-m"])):
        argv = [*prefix, "worker.cli", "sft", "@", str(REPO / "configs/reverse_text/sft.toml")]
        argv += ["--model.name", str(tiny_model), "--output_dir", str(tmp_path), "--name", name, "--max_steps", "4"]
        done = subprocess.run([*argv, *common], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = read_jsonl(tmp_path / name / "metrics.jsonl")
    assert [r["step"] for r in runs["two"]] == [1, 2, 3, 4]  # rank 0 alone writes metrics
    for a, b in zip(runs["two"], runs["one"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert runs["two"][-1]["eval_loss"] == pytest.approx(runs["one"][-1]["eval_loss"], rel=1e-5)
    assert (tmp_path / "two/final/model.safetensors").is_file()
