"""Eval jobs through the service (issue 22): ``POST /api/runs`` with ``kind = "eval"`` of a model path or of a run's
checkpoint / final weights, ``POST /api/runs/{id}/evals`` (one click), ``GET /api/runs/{id}/evals`` (eval reward
over checkpoints), and the run page's Evaluate button and chart; bad input and refusals start nothing. The job's own
process is tested end to end with vLLM in ``tests/e2e/service/test_eval_service_run.py``; here its model folder
(``worker.evaluation.job_model``) is checked against the checkpoint's logits."""

from __future__ import annotations

import json
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlmodel import Session, func, select
from transformers import AutoModelForCausalLM

from tests.support.checkpoints import full_checkpoint, logits
from tests.support.server import new_token, run_token_headers, spec
from tests.support.webui import login

People = dict[str, tuple[str, dict[str, str]]]
SUFFIX = secrets.token_hex(3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.policy.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "base", size="tiny", seed=0)


@pytest.fixture(scope="module")
def people() -> People:
    """who -> (token, headers): the training run's owner (a member), another member, a viewer and an admin."""
    out = {}
    for who, role in (("owner", "member"), ("other", "member"), ("viewer", "viewer"), ("admin", "admin")):
        token = new_token(f"evaljob-{who}-{SUFFIX}", role=role)
        out[who] = (token, {"Authorization": f"Bearer {token}"})
    return out


def training_run(model_dir: Path, *, step: int) -> tuple[dict[str, Any], Any]:
    """A cancelled RL run of the owner (no launch enqueued) with a complete checkpoint at ``step`` and an incomplete
    one at ``step + 1``; returns its public form and the checkpoint's model."""
    from server.core.db import engine
    from server.models import RunPublic, RunStatus
    from server.services import runs

    data = spec(model={"name": str(model_dir)}, env=[{"id": "reverse_text", "name": "rt", "args": {"max_chars": 12}}])
    data["orchestrator"] = {"max_tokens": 24, "eval": {"num_examples": 5, "temperature": 0.0}}
    with Session(engine) as s:
        run = runs.create(s, data=data, owner=f"evaljob-owner-{SUFFIX}")
        runs.transition(s, run, RunStatus.cancelled, reason="test")
        s.commit()
        public = RunPublic.model_validate(run).model_dump()
    run_dir = Path(public["run_dir"])
    run_dir.mkdir(parents=True)
    trained = full_checkpoint(run_dir, model_dir, step, seed=0)
    (run_dir / "checkpoints" / f"step_{step + 1}" / "trainer").mkdir(parents=True)  # incomplete
    return public, trained


def count_runs() -> int:
    from server.core.db import engine
    from server.models import Run

    with Session(engine) as s:
        return int(s.exec(select(func.count()).select_from(Run)).one())


def evaluation_events(client: Any, headers: dict[str, str], run_id: int) -> list[dict[str, Any]]:
    data = client.get(f"/api/runs/{run_id}/events", headers=headers).json()["data"]
    return [e for e in data if e["kind"] == "evaluation"]


def test_eval_job_bad_input_and_refusals_start_nothing(client: Any, people: People, model_dir: Path) -> None:
    run, _ = training_run(model_dir, step=2)
    rid, h = run["id"], people["owner"][1]

    def job(**model: Any) -> dict[str, Any]:
        return {"kind": "eval", "name": f"e-{secrets.token_hex(3)}", "model": model, "env": {"id": "reverse_text"}}

    before = count_runs()
    cases = [
        (job(run=2**31 - 2, step=2), h, 422, "model.run: no run 2147483646; give the id of a run of this service"),
        (job(run=rid, step=3), h, 422, f"model.step: run {rid} has no complete checkpoint at step 3 (complete: 2)"),
        (job(run=rid, step=7), h, 422, f"model.step: run {rid} has no complete checkpoint at step 7 (complete: 2)"),
        (job(run=rid), h, 422, f"model.step: run {rid} has no final weights"),
        (job(run=rid, step=2, name="other/model"), h, 422, "model.name: with model.run the base model is run"),
        (job(name=str(model_dir), step=2), h, 422, "model.step: a checkpoint step needs model.run"),
        (job(), h, 422, "model.name: give a model path or hub id, or model.run"),
        (job(run=rid, step=2), people["other"][1], 403, f"run {rid} belongs to evaljob-owner-{SUFFIX}: only its owner"),
        (job(run=rid, step=2), people["viewer"][1], 403, f"user 'evaljob-viewer-{SUFFIX}' is a viewer"),
    ]
    # an eval job (or an SFT run) as a Slurm job: one node, no RL layout or placement keys, the service's sbatch rules
    path = {"name": str(model_dir)}
    for slurm, code, line in [
        (
            {"nodes": 2, "inference_nodes": 1},
            422,
            "launcher.slurm.nodes: an eval job runs on one node, so use 1, got 2",
        ),
        (  # nodes alone: named first, not the RL layout's missing inference_nodes (fresh user)
            {"nodes": 2},
            422,
            "launcher.slurm.nodes: an eval job runs on one node, so use 1, got 2",
        ),
        (
            {"rdzv_port": 29600},
            422,
            "launcher.slurm.rdzv_port: a key of an RL run's multi-node layout; an eval job runs on one node, so leave "
            "it at 29500, got 29600",
        ),
        (
            {"extra_sbatch": ["--output=/etc/x"]},
            422,
            "launcher.slurm.extra_sbatch: '--output' is not allowed in a run submitted",
        ),
        ({"allocation": "12"}, 403, "launcher.slurm.allocation: only an admin may run inside an existing allocation"),
    ]:
        cases.append(({**job(**path), "launcher": {"kind": "slurm", "slurm": slurm}}, h, code, line))
    cases.append(
        (
            {**job(**path), "launcher": {"local": {"inference_gpus": [0]}}},
            h,
            422,
            "launcher.local.inference_gpus: places an RL run's vLLM and trainer processes; an eval job is one process, "
            "so leave it unset, got [0]",
        )
    )
    sft = spec(kind="sft", model=path, launcher={"kind": "slurm", "slurm": {"nodes": 3, "inference_nodes": 1}})
    cases.append((sft, h, 422, "launcher.slurm.nodes: an SFT run runs on one node, so use 1, got 3"))
    sft = spec(kind="sft", model=path, launcher={"kind": "slurm", "slurm": {"nodes": 2}})
    cases.append((sft, h, 422, "launcher.slurm.nodes: an SFT run runs on one node, so use 1, got 2"))
    for body, headers, code, start in cases:
        resp = client.post("/api/runs", json=body, headers=headers)
        assert (resp.status_code, resp.json()["detail"][: len(start)]) == (code, start), body
    one_click = {
        ("owner", 3): (422, f"model.step: run {rid} has no complete checkpoint at step 3 (complete: 2)"),
        ("other", 2): (403, f"run {rid} belongs to evaljob-owner-{SUFFIX}: only its owner or an admin may evaluate"),
        ("viewer", 2): (403, f"user 'evaljob-viewer-{SUFFIX}' is a viewer: viewers may only read"),
    }
    for (who, step), (code, start) in one_click.items():
        resp = client.post(f"/api/runs/{rid}/evals", json={"step": step}, headers=people[who][1])
        assert (resp.status_code, resp.json()["detail"][: len(start)]) == (code, start)
    assert client.post(f"/api/runs/{rid}/evals", json={"step": 2}, headers=run_token_headers(rid)).status_code == 403
    assert client.post(f"/api/runs/{rid}/evals", json={"step": -1}, headers=h).status_code == 422
    assert count_runs() == before  # nothing created
    assert evaluation_events(client, h, rid) == []
    assert client.get(f"/api/runs/{rid}/evals", headers=people["viewer"][1]).json() == {
        "run_id": rid,
        "data": [],
        "count": 0,
    }


def test_eval_job_of_a_checkpoint_copies_its_weights_and_is_drawn_over_steps(
    client: Any, people: People, model_dir: Path, tmp_path: Path
) -> None:
    from worker.evaluation import job_model
    from worker.run.rundir import RunDir
    from worker.spec import validate_spec

    run, trained = training_run(model_dir, step=2)
    rid, h = run["id"], people["owner"][1]
    resp = client.post(
        "/api/runs",
        json={"kind": "eval", "name": "rest-eval", "model": {"run": rid, "step": 2}, "eval": {"temperature": 0}},
        headers=h,
    )
    assert resp.status_code == 201, resp.text
    job = resp.json()
    assert (job["kind"], job["status"], job["owner"]) == ("eval", "queued", f"evaljob-owner-{SUFFIX}")
    assert job["spec"]["model"] == {
        "name": str(model_dir),
        "run": rid,
        "step": 2,
        "dtype": "float32",
        "final_step": None,
    }
    source = RunDir(job["run_dir"]).eval_source
    ckpt = Path(run["run_dir"]) / "checkpoints" / "step_2" / "trainer"
    assert sorted(p.name for p in source.iterdir()) == ["model.safetensors"]  # no state.pt, no marker
    assert (source / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    assert (source / "model.safetensors").stat().st_ino != (ckpt / "model.safetensors").stat().st_ino  # a copy
    [event] = evaluation_events(client, h, rid)
    assert event["data"] == {"eval_run_id": job["id"], "step": 2}

    # the job's process serves the model made from its copy: the checkpoint's logits
    spec = validate_spec("eval", {**job["spec"], "output_dir": str(tmp_path)})
    local = RunDir(tmp_path / spec.name)
    local.eval_source.parent.mkdir(parents=True)
    local.eval_source.symlink_to(source)
    made = AutoModelForCausalLM.from_pretrained(job_model(spec, local)).eval()
    assert torch.equal(logits(made), logits(trained))

    # one click from the run: the run's environments and eval settings
    clicked = client.post(f"/api/runs/{rid}/evals", json={"step": 2}, headers=people["admin"][1])
    assert clicked.status_code == 201, clicked.text
    second = clicked.json()
    assert second["owner"] == f"evaljob-admin-{SUFFIX}" and second["name"] == f"{run['name']}-eval-2"
    assert second["spec"]["env"] == [{"id": "reverse_text", "args": {"max_chars": 12}, "name": "rt", "weight": 1.0}]
    assert second["spec"]["eval"] == {
        "num_examples": 5,
        "temperature": 0.0,
        "max_tokens": 24,
        "pass_k": 1,
        "pass_threshold": 1.0,
        "num_samples": None,
    }

    # eval metrics reported by the first job (its run token) are its point at step 2
    points = [
        {"source": "eval", "step": 2, "name": n, "value": v, "time": time.time()}
        for n, v in (("reward_mean", 0.25), ("pass_at_k", 0.0), ("completion_len_mean", 11.0), ("num_examples", 5))
    ]
    posted = client.post(
        f"/api/runs/{job['id']}/metrics", json={"points": points}, headers=run_token_headers(job["id"])
    )
    assert posted.status_code == 200, posted.text
    listed = client.get(f"/api/runs/{rid}/evals", headers=people["viewer"][1]).json()
    assert listed["count"] == 2
    assert listed["data"][0] == {
        "run_id": job["id"],
        "step": 2,
        "x": 2,
        "status": "queued",
        "metrics": {"reward_mean": 0.25, "pass_at_k": 0.0, "completion_len_mean": 11.0},
    }
    assert listed["data"][1]["run_id"] == second["id"] and listed["data"][1]["metrics"] == {}


def test_run_page_evaluates_a_checkpoint_in_one_click_and_charts_eval_reward(
    client: Any, people: People, model_dir: Path
) -> None:
    from worker.run.rundir import RunDir

    run, _ = training_run(model_dir, step=4)
    rid = run["id"]
    login(client, people["viewer"][0])
    page = client.get(f"/runs/{rid}").text
    assert 'id="checkpoints"' in page and 'id="evaluate-4"' not in page and 'id="chart-checkpoint-evals"' in page

    csrf = login(client, people["other"][0])
    refused = client.post(f"/runs/{rid}/evaluate", data={"csrf": csrf, "step": "4"})
    assert refused.status_code == 403 and "only its owner or an admin may evaluate its weights" in refused.text

    csrf = login(client, people["owner"][0])
    page = client.get(f"/runs/{rid}").text
    assert 'id="evaluate-4"' in page and '<td id="evals-4">none</td>' in page
    wrong = client.post(f"/runs/{rid}/evaluate", data={"csrf": csrf, "step": "5"})
    assert wrong.status_code == 422 and "no complete checkpoint at step 5 (complete: 4)" in wrong.text
    done = client.post(f"/runs/{rid}/evaluate", data={"csrf": csrf, "step": "4"}, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"] == f"/runs/{rid}"
    [job] = client.get(f"/api/runs/{rid}/evals", headers=people["owner"][1]).json()["data"]
    shown = client.get(f"/api/runs/{job['run_id']}", headers=people["owner"][1]).json()
    assert job["step"] == 4 and (RunDir(shown["run_dir"]).eval_source / "model.safetensors").is_file()

    point = {"source": "eval", "step": 4, "name": "reward_mean", "value": 0.5, "time": time.time()}
    headers = run_token_headers(job["run_id"])
    assert client.post(f"/api/runs/{job['run_id']}/metrics", json={"points": [point]}, headers=headers).is_success
    page = client.get(f"/runs/{rid}").text
    assert f'<a href="/runs/{job["run_id"]}">#{job["run_id"]}</a> reward 0.500' in page
    chunks = [c for c in page.split("<script")[1:] if c.startswith(' type="application/json" data-figures>')]
    figures = [json.loads(c.split(">", 1)[1].split("</script>", 1)[0]) for c in chunks]
    [fig] = [f["checkpoint-evals"] for f in figures if "checkpoint-evals" in f]
    assert [(t["name"], t["x"], t["y"]) for t in fig["data"]] == [("reward_mean", [4], [0.5])]
    # a NaN eval metric (stored as logged) is not drawn, and the page still renders
    nan = json.dumps({"points": [{**point, "name": "pass_at_k", "value": float("nan")}]})  # the bare token NaN
    typed = {**headers, "Content-Type": "application/json"}
    assert client.post(f"/api/runs/{job['run_id']}/metrics", content=nan, headers=typed).is_success
    page = client.get(f"/runs/{rid}")
    assert page.status_code == 200 and f'<a href="/runs/{job["run_id"]}">#{job["run_id"]}</a> reward 0.500' in page.text
    client.cookies.clear()


def test_a_path_inside_another_users_run_folder_is_refused_for_every_kind(
    client: Any, people: People, model_dir: Path, tmp_path: Path
) -> None:
    """``model.name`` (and an SFT run's data paths) may not reach into another user's run folder, directly or
    through a symlink: the weights there are that run's owner's, as with ``model.run``."""
    run, _ = training_run(model_dir, step=2)
    rid, final = run["id"], Path(run["run_dir"]) / "final"
    shutil.copytree(model_dir, final)  # the run's final weights: a model folder
    link = tmp_path / "innocent-model"
    link.symlink_to(final)
    row = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}
    (final / "sft.jsonl").write_text(json.dumps(row) + "\n")

    def named(kind: str, name: str) -> dict[str, Any]:
        body = spec(model={"name": name}) if kind == "rl" else {"kind": kind, "model": {"name": name}}
        body["name"] = f"{kind}-{secrets.token_hex(3)}"
        if kind == "eval":
            body["env"] = {"id": "reverse_text"}
        return body

    sft = {
        "kind": "sft",
        "name": "sft-other",
        "model": {"name": str(model_dir)},
        "data": {"path": str(final / "sft.jsonl")},
    }
    before = count_runs()
    for body, key, value in [
        (named("eval", str(final)), "model.name", str(final)),
        (named("rl", str(final)), "model.name", str(final)),
        (named("eval", str(link)), "model.name", str(link)),
        (sft, "data.path", str(final / "sft.jsonl")),
    ]:
        resp = client.post("/api/runs", json=body, headers=people["other"][1])
        assert (resp.status_code, resp.json()["detail"]) == (
            403,
            f"{key}: {value!r} is inside the folder of run {rid}, which is not yours: only a run's owner or an admin "
            "may use its files (an eval job of its weights: model.run)",
        ), body
    assert count_runs() == before
    # nor through a sweep's trials (refused when the sweep is made, not at each tick)
    grid = {"trainer.optim.lr": [1e-4, 3e-4]}
    sweep = {"name": "s", "base": named("rl", str(final)), "grid": grid, "metric": "eval/reward_mean"}
    resp = client.post("/api/sweeps", json=sweep, headers=people["other"][1])
    assert resp.json() == {
        "detail": f"base.model.name: {str(final)!r} is inside the folder of run {rid}, which is not yours: only a run's "
        "owner or an admin may use its files (an eval job of its weights: model.run)"
    }
    assert resp.status_code == 403
    for who in ("owner", "admin"):  # the run's owner and an admin may
        resp = client.post("/api/runs", json=named("eval", str(final)), headers=people[who][1])
        assert resp.status_code == 201, resp.text
    assert count_runs() == before + 2


def test_an_eval_job_resumes_without_a_checkpoint(model_dir: Path) -> None:
    """An eval job has no checkpoints: a cancelled one resumes (it goes on after the tasks it recorded,
    ``worker.evaluation.run_job``) and its eval metrics are measured again; a training run without a checkpoint is
    still refused."""
    from server.core.db import engine
    from server.models import Metric, RunStatus
    from server.services import runs

    owner = f"evaljob-owner-{SUFFIX}"
    job = {"kind": "eval", "name": f"e-{secrets.token_hex(3)}", "model": {"name": str(model_dir)}}
    with Session(engine) as s:
        ev = runs.create(s, data=job, owner=owner)
        rl = runs.create(s, data=spec(model={"name": str(model_dir)}), owner=owner)
        for run in (ev, rl):
            runs.transition(s, run, RunStatus.cancelled, reason="test")
        s.add(Metric(run_id=ev.id, source="eval", step=0, name="reward_mean", value=0.5, time=1e9))
        s.commit()
        assert runs.resume(s, ev, by=owner) == 0
        s.commit()
        with pytest.raises(runs.InvalidTransition, match=rf"^run {rl.id}: no complete checkpoint in "):
            runs.resume(s, rl, by=owner)
        s.rollback()
        ev = runs.get(s, ev.id)
        assert ev.status == RunStatus.queued
        assert s.exec(select(func.count()).select_from(Metric).where(Metric.run_id == ev.id)).one() == 0
        resumed = [e for e in runs.events(s, ev.id)[0] if e.kind == "resumed"]
        assert [(e.reason, e.data["step"]) for e in resumed] == [
            (f"resumed by {owner}: continues after the eval tasks it recorded", 0)
        ]


def test_a_final_weights_eval_stores_its_metrics_where_evals_draws_them(
    client: Any, people: People, model_dir: Path
) -> None:
    """The eval of a run's final weights: its metrics are stored at the run's ``max_steps`` (the step ``final/`` comes
    from), the step ``/api/runs/{id}/evals`` draws it at (they were stored at 0, drawn at ``max_steps``: fresh
    user)."""
    from worker.evaluation import job_step
    from worker.run.rundir import RunDir
    from worker.spec import validate_spec

    run, _ = training_run(model_dir, step=2)
    rid, h = run["id"], people["owner"][1]
    assert run["spec"]["max_steps"] == 3
    final = Path(run["run_dir"]) / "final"
    shutil.copytree(Path(run["run_dir"]) / "checkpoints" / "step_2" / "trainer", final)  # what completing writes
    resp = client.post(
        "/api/runs",
        json={"kind": "eval", "name": "final-eval", "model": {"run": rid}, "eval": {"num_examples": 3}},
        headers=h,
    )
    assert resp.status_code == 201, resp.text
    job = resp.json()
    assert job["spec"]["model"] == {
        "name": str(model_dir),
        "run": rid,
        "step": None,
        "dtype": "float32",
        "final_step": 3,
    }
    assert (RunDir(job["run_dir"]).eval_source / "model.safetensors").is_file()
    step = job_step(validate_spec("eval", job["spec"]))  # where the job's process logs its eval metrics
    assert step == 3

    points = [{"source": "eval", "step": step, "name": "reward_mean", "value": 0.5, "time": time.time()}]
    posted = client.post(
        f"/api/runs/{job['id']}/metrics", json={"points": points}, headers=run_token_headers(job["id"])
    )
    assert posted.status_code == 200, posted.text
    [drawn] = client.get(f"/api/runs/{rid}/evals", headers=h).json()["data"]
    assert (drawn["run_id"], drawn["step"], drawn["x"], drawn["metrics"]) == (job["id"], None, 3, {"reward_mean": 0.5})
    stored = client.get(f"/api/runs/{job['id']}/metrics", params={"name": "reward_mean"}, headers=h).json()
    assert [(x["source"], x["step"], x["value"]) for x in stored["series"]] == [("eval", [drawn["x"]], [0.5])]

    refused = client.post(
        "/api/runs", json={"kind": "eval", "model": {"name": str(model_dir), "final_step": 3}}, headers=h
    )
    assert refused.status_code == 422
    assert refused.json()["detail"] == (
        "model.final_step: only with model.run and no model.step (the service sets it to that run's max_steps), got 3"
    )


def test_an_eval_job_of_more_tasks_than_its_environment_has_fails_at_start_naming_the_key(
    model_dir: Path, tmp_path: Path
) -> None:
    """``eval.num_examples`` above the eval split's size: the job fails before vLLM starts, its reason one line naming
    the key and the size (it evaluated 200 of 512 without a word: fresh user); the CLI's ``--num-examples`` is
    ``tests/unit/worker/test_cli.py``'s."""
    from worker.evaluation import main
    from worker.run.rundir import RunDir, read_jsonl

    run = RunDir(tmp_path / "job")
    run.create()
    spec = {"kind": "eval", "model": {"name": str(model_dir)}, "env": [{"id": "reverse_text", "name": "rt"}]}
    spec["env"].append({"id": "reverse_text", "name": "small", "args": {"num_eval": 50}})
    spec["eval"] = {"num_examples": 64}
    run.config.write_text(json.dumps(spec))
    assert main(["--run-dir", str(run.root)]) == 2
    [failed] = [e for e in read_jsonl(run.events) if e["event"] == "failed"]
    assert failed["reason"] == (
        "eval.num_examples: 64 eval tasks asked, but environment 'reverse_text' has 50 (its eval split); use at most 50"
    )
    assert not (run.logs / "inference.log").exists() and not run.eval_tasks.exists()  # nothing started or sampled
