"""``/api/pipelines`` on the real Postgres: an sft -> rl -> eval pipeline walked through its state machine with the
runs' statuses reported by hand (each stage starts from the previous stage's final weights; stopping it stops the
live stage's run, resuming resumes that run from its checkpoint; a failed stage fails the pipeline naming it, and
resuming resumes a failed eval stage's run in place), and every bad input of a pipeline spec answered 422 naming the stage
and field with nothing created."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, func, select

from server.models import Pipeline, Run
from server.services import pipelines
from tests.service.test_lifecycle import checkpoint, set_status
from tests.service.test_run_ids import sqlite_engine  # noqa: F401 (a fixture)
from tests.support.server import BAD_MODEL, new_token, run_token_headers, spec
from tests.support.webui import login


def chained(run_spec: dict[str, Any]) -> dict[str, Any]:
    """A run spec as a later stage's base: without ``model`` (the stage starts from the stage before's weights)."""
    return {k: v for k, v in run_spec.items() if k != "model"}


def body(**overrides: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": "p3",
        "stages": [
            {
                "kind": "sft",
                "base": {"model": {"name": BAD_MODEL}, "max_steps": 4},
                "overrides": {"data.batch_size": 4},
            },
            {"kind": "rl", "base": chained(spec(max_steps=4, ckpt={"interval": 2}))},
            {"kind": "eval", "base": {"eval": {"num_examples": 4, "temperature": 0.0}}},
        ],
    }
    out.update(overrides)
    return out


def final_weights(run: dict[str, Any]) -> Path:
    """Fake ``final/`` weights in the run's directory (what the trainer writes when it completes)."""
    final = Path(run["run_dir"]) / "final"
    final.mkdir(parents=True, exist_ok=True)
    (final / "config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(b"weights")
    return final


def show(client: Any, auth: dict[str, str], pid: int) -> dict[str, Any]:
    resp = client.get(f"/api/pipelines/{pid}", headers=auth)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def log(client: Any, run_id: int, source: str, name: str, values: dict[int, float]) -> None:
    """Metric points of a live run, sent with its run token as its processes send them."""
    points = [{"source": source, "step": k, "name": name, "value": v, "time": 1.0} for k, v in values.items()]
    resp = client.post(f"/api/runs/{run_id}/metrics", json={"points": points}, headers=run_token_headers(run_id))
    assert resp.status_code == 200, resp.text


def states(p: dict[str, Any]) -> tuple[str, list[str]]:
    return p["status"], [s["status"] for s in p["stages"]]


def test_sft_rl_eval_pipeline_runs_stops_resumes_fails_and_completes(
    client: Any, auth: dict[str, str], session: Session
) -> None:
    resp = client.post("/api/pipelines", json=body(), headers=auth)
    assert resp.status_code == 201, resp.text
    p = resp.json()
    pid = p["id"]
    assert states(p) == ("running", ["running", "pending", "pending"])
    assert [(s["kind"], s["from"], s["name"]) for s in p["stages"]] == [
        ("sft", None, "p3-0"),
        ("rl", 0, "p3-1"),
        ("eval", 1, "p3-2"),
    ]
    sft = client.get(f"/api/runs/{p['stages'][0]['run_id']}", headers=auth).json()
    assert (sft["kind"], sft["name"], sft["status"], sft["spec"]["data"]["batch_size"]) == ("sft", "p3-0", "queued", 4)
    events = client.get(f"/api/runs/{sft['id']}/events", headers=auth).json()["data"]
    assert [(e["data"]["pipeline_id"], e["data"]["stage"]) for e in events if e["kind"] == "pipeline"] == [(pid, 0)]
    assert pipelines.tick(session, pid) == []  # its run is queued: nothing to do

    set_status(client, sft["id"], "starting", "running")
    assert pipelines.tick(session, pid) == []
    final = final_weights(sft)
    log(client, sft["id"], "sft", "eval_reward_greedy", {2: 0.5, 4: 0.823})
    set_status(client, sft["id"], "completed")
    done = pipelines.tick(session, pid)
    p = show(client, auth, pid)
    rl_id = p["stages"][1]["run_id"]
    assert done == [f"stage 0 (sft, run {sft['id']}) completed", f"stage 1 (rl): run {rl_id} created"]
    assert states(p) == ("running", ["completed", "running", "pending"])
    rl = client.get(f"/api/runs/{rl_id}", headers=auth).json()
    assert rl["spec"]["model"]["name"] == str(final)  # starts from the SFT stage's final weights

    set_status(client, rl_id, "starting", "running")
    checkpoint(rl, 2)
    stopped = client.post(f"/api/pipelines/{pid}/stop", headers=auth)
    assert stopped.status_code == 200, stopped.text
    assert states(stopped.json()) == ("cancelled", ["completed", "cancelled", "pending"])
    events = client.get(f"/api/runs/{rl_id}/events", headers=auth).json()["data"]
    assert [e["kind"] for e in events if e["kind"] == "stop_requested"] == ["stop_requested"]  # the normal stop path
    early = client.post(f"/api/pipelines/{pid}/resume", headers=auth)
    assert early.status_code == 409, early.text
    assert early.json()["detail"] == (f"pipeline {pid}: stage 1's run {rl_id} is still running; resume once it ended")
    set_status(client, rl_id, "cancelled")  # what the worker's stop_run reports
    assert pipelines.tick(session, pid) == []  # a cancelled pipeline stays as it is
    resumed = client.post(f"/api/pipelines/{pid}/resume", headers=auth)
    assert resumed.status_code == 200, resumed.text
    r = resumed.json()
    assert states(r) == ("running", ["completed", "running", "pending"])
    assert r["stages"][1]["run_id"] == rl_id  # the same run, resumed
    assert r["status_reason"] == f"resumed by {p['owner']}: stage 1's run {rl_id} resumed from checkpoint step 2"
    assert client.get(f"/api/runs/{rl_id}", headers=auth).json()["status"] == "queued"

    set_status(client, rl_id, "starting", "running")
    final_weights(rl)
    log(client, rl_id, "eval", "reward_mean", {0: 0.381, 2: 0.5, 4: 0.6256})
    set_status(client, rl_id, "completed")
    done = pipelines.tick(session, pid)
    p = show(client, auth, pid)
    ev_id = p["stages"][2]["run_id"]
    assert done == [f"stage 1 (rl, run {rl_id}) completed", f"stage 2 (eval): run {ev_id} created"]
    ev = client.get(f"/api/runs/{ev_id}", headers=auth).json()
    assert (ev["spec"]["model"]["run"], ev["spec"]["model"]["step"]) == (rl_id, None)  # the RL stage's final weights

    set_status(client, ev_id, "starting", "running", "failed")
    done = pipelines.tick(session, pid)
    assert done == [f"stage 2 (eval, run {ev_id}) failed: run failed: failed"]
    p = show(client, auth, pid)
    assert states(p) == ("failed", ["completed", "completed", "failed"])
    assert p["status_reason"] == done[0]
    tasks = Path(ev["run_dir"]) / "eval_tasks.jsonl"  # what the failed attempt recorded (worker.evaluation.run_job)
    tasks.write_text('{"env": "reverse_text", "index": 0, "rewards": [1.0], "lengths": [3], "pid": 1}\n')
    resumed = client.post(f"/api/pipelines/{pid}/resume", headers=auth).json()
    assert states(resumed) == ("running", ["completed", "completed", "running"])
    assert resumed["stages"][2]["run_id"] == ev_id  # the same eval run, resumed in place: its tasks are kept
    assert resumed["status_reason"] == (
        f"resumed by {p['owner']}: stage 2's eval run {ev_id} resumed after the tasks it recorded"
    )
    again = client.get(f"/api/runs/{ev_id}", headers=auth).json()
    assert (again["status"], again["run_dir"]) == ("queued", ev["run_dir"]) and tasks.read_text().count("\n") == 1
    set_status(client, ev_id, "starting", "running")
    log(client, ev_id, "eval", "reward_mean", {0: 0.788})
    set_status(client, ev_id, "completed")
    assert pipelines.tick(session, pid) == [
        f"stage 2 (eval, run {ev_id}) completed",
        "every stage completed (3)",
    ]
    p = show(client, auth, pid)
    assert states(p) == ("completed", ["completed", "completed", "completed"])
    assert [s["run_status"] for s in p["stages"]] == ["completed", "completed", "completed"]
    headlines = ["greedy eval reward 0.823", "held-out reward 0.381 → 0.626", "eval reward 0.788"]
    assert [s["headline"] for s in p["stages"]] == headlines
    made = session.exec(select(func.count()).select_from(Run).where(Run.name.startswith("p3-"))).one()  # type: ignore[attr-defined]
    assert made == 3  # sft, rl and eval (each resumed in place, same id)
    assert client.post(f"/api/pipelines/{pid}/resume", headers=auth).status_code == 409
    assert client.post(f"/api/pipelines/{pid}/stop", headers=auth).status_code == 409

    listed = client.get("/api/pipelines", headers=auth).json()
    assert pid in [x["id"] for x in listed["data"]]
    login(client, new_token("pipeline-viewer", role="viewer"))
    html = client.get(f"/pipelines/{pid}").text
    assert f'<a href="/runs/{rl_id}">#{rl_id}</a>' in html and html.count('class="stage-completed"') == 3
    assert re.findall(r'<td class="stage-headline">([^<]*)</td>', html) == headlines
    run_page = client.get(f"/runs/{rl_id}").text
    assert f'<a href="/pipelines/{pid}" id="run-pipeline">stage 1 of pipeline #{pid} p3</a>' in run_page
    assert f'<a href="/pipelines/{pid}">#{pid} p3</a>' in client.get("/pipelines").text


def test_a_stage_that_cannot_start_fails_the_pipeline_naming_it(
    client: Any, auth: dict[str, str], session: Session
) -> None:
    resp = client.post("/api/pipelines", json=body(name="nofinal"), headers=auth)
    assert resp.status_code == 201, resp.text
    p = resp.json()
    sft_id = p["stages"][0]["run_id"]
    set_status(client, sft_id, "starting", "running", "completed")  # no final/ written
    done = pipelines.tick(session, p["id"])
    assert len(done) == 2 and done[1].startswith("stage 1 (rl) failed: could not start: model.name: ")
    after = show(client, auth, p["id"])
    assert states(after) == ("failed", ["completed", "failed", "pending"]) and after["stages"][1]["run_id"] is None
    made = session.exec(select(func.count()).select_from(Run).where(Run.name.startswith("nofinal-"))).one()  # type: ignore[attr-defined]
    assert made == 1  # the refused run left no row


def _stage(i: int, **kw: Any) -> dict[str, Any]:
    return body()["stages"][i] | kw


BAD = {
    "no stages": (
        {"stages": []},
        "stages: empty; give at least one [[stages]] table with kind = 'sft', 'rl' or 'eval'",
    ),
    "no stages key": ({"name": "x"}, "stages: Field required"),
    "unknown kind": (
        {"stages": [_stage(0), _stage(1, kind="dpo")]},
        "stages[1].kind: unknown kind 'dpo'; expected one of sft, rl, eval",
    ),
    "unknown stage key": (
        {"stages": [_stage(0, steps=2)]},
        "stages[0].steps: unknown stage key (did you mean 'step'?); allowed: kind, name, base, overrides, from, step",
    ),
    "from a later stage": (
        {"stages": [_stage(0), _stage(1, **{"from": "stage 5"})]},
        "stages[1].from: no stage 5 before stage 1; earlier stages: 0 to 0",
    ),
    "from on the first stage": (
        {"stages": [_stage(0, **{"from": 0})]},
        "stages[0].from: no stage 0 before stage 0; earlier stages: none: the first stage starts from its own spec",
    ),
    "from an eval stage": (
        {"stages": [_stage(0), _stage(2, **{"from": 0}), _stage(1)]},
        "stages[2].from: stage 1 is an eval stage; it writes no weights to start from",
    ),
    "eval of a checkpoint never kept": (
        {"stages": [_stage(0), _stage(1), _stage(2, step=3)]},
        "stages[2].step: stage 1 keeps no complete checkpoint at step 3 (kept at its end: 2, 4)",
    ),
    "eval of a checkpoint of a stage without checkpoints": (
        {"stages": [_stage(0), _stage(2, step=2)]},
        "stages[1].step: stage 0 keeps no complete checkpoint at step 2 (kept at its end: none (ckpt.interval = 0))",
    ),
    "step on a training stage": (
        {"stages": [_stage(0), _stage(1, step=2)]},
        "stages[1].step: only an eval stage evaluates a checkpoint step; this is 'rl'",
    ),
    "stage spec that does not validate": (
        {"stages": [_stage(0), _stage(1, overrides={"trainer.optim.lr": -1})]},
        "stages[1].trainer.optim.lr: ",
    ),
    "unknown key in a stage spec": (
        {"stages": [_stage(0, overrides={"max_stepz": 3})]},
        "stages[0]: unknown key 'max_stepz' (did you mean 'max_steps'?)",
    ),
    "base of another kind": (
        {"stages": [_stage(0, base={"kind": "rl"})]},
        "stages[0].base.kind: 'rl', but the stage's kind is 'sft'",
    ),
    "rl spec as an eval stage's base": (  # was "unknown key 'inference'" (fresh user)
        {"stages": [_stage(0), _stage(1), _stage(2, base=spec(max_steps=4, inference={}, orchestrator={}))]},
        "stages[2].base: an 'rl' spec ('inference', 'max_steps', 'orchestrator' are keys of 'rl' specs), but stage 2 "
        "is kind 'eval': give an eval spec as its base",
    ),
    "sft spec as an rl stage's base": (
        {"stages": [_stage(0), _stage(1, base={"data": {"batch_size": 4}, "eval_examples": 8})]},
        "stages[1].base: an 'sft' spec ('data', 'eval_examples' are keys of 'sft' specs), but stage 1 is kind 'rl': "
        "give an rl spec as its base",
    ),
    "output_dir in a stage": (  # the service chooses every run's folder (it was dropped without a word)
        {"stages": [_stage(0), _stage(1, overrides={"output_dir": "/tmp/x"})]},
        "stages[1].output_dir: the service chooses the run folder",
    ),
    "kind in a stage's overrides": (  # was dropped without a word (fresh user)
        {"stages": [_stage(0, overrides={"kind": "rl"})]},
        "stages[0].overrides.kind: the stage's own 'kind' key sets it ('sft')",
    ),
    "model.name in a chained eval stage": (  # was kept in the stored spec and not evaluated (fresh user)
        {"stages": [_stage(0), _stage(1), _stage(2, base={"model": {"name": "x"}})]},
        "stages[2].model.name: this eval stage evaluates stage 1's weights",
    ),
    "model.name in a chained rl stage": (  # was replaced by stage 0's final weights without a word (issue 32)
        {"stages": [_stage(0), _stage(1, base=spec(max_steps=4))]},
        "stages[1].model.name: this rl stage starts from stage 0's final weights (<run_dir>/final); leave model.name "
        "out",
    ),
    "model.name in a chained stage's overrides": (
        {"stages": [_stage(0), _stage(1, overrides={"model.name": BAD_MODEL})]},
        "stages[1].model.name: this rl stage starts from stage 0's final weights (<run_dir>/final); leave model.name "
        "out",
    ),
    "model.name in a chained sft stage": (
        {"stages": [_stage(0), {"kind": "sft", "base": {"model": {"name": BAD_MODEL}, "max_steps": 2}}]},
        "stages[1].model.name: this sft stage starts from stage 0's final weights (<run_dir>/final); leave model.name "
        "out",
    ),
    "eval of a run that does not exist": (
        {"stages": [{"kind": "eval", "base": {"model": {"run": 2**31 - 1}}}]},
        f"stages[0].model.run: no run {2**31 - 1}; give the id of a run of this service",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_one_422_line_naming_the_stage_and_field_and_creates_nothing(
    case: str, client: Any, auth: dict[str, str], session: Session
) -> None:
    data, expected = BAD[case]
    before = (
        session.exec(select(func.count()).select_from(Pipeline)).one(),
        session.exec(select(func.count()).select_from(Run)).one(),
    )
    resp = client.post("/api/pipelines", json=body(**data) if "stages" in data else data, headers=auth)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert detail.startswith(expected) and "\n" not in detail, detail
    session.expire_all()
    after = (
        session.exec(select(func.count()).select_from(Pipeline)).one(),
        session.exec(select(func.count()).select_from(Run)).one(),
    )
    assert after == before


def test_the_shipped_example_pipeline_is_accepted(client: Any, auth: dict[str, str]) -> None:
    """``examples/pipelines/reverse_text.toml`` read as ``asyncrl pipeline`` reads it (bases inline) is a valid
    pipeline (its model pointed at a path of these tests)."""
    from server.cli import load_pipeline

    data = load_pipeline(Path(__file__).resolve().parents[2] / "examples/pipelines/reverse_text.toml")
    assert "model" not in data["stages"][1]["base"]  # rl.toml's own model.name: stage 1 starts from stage 0's weights
    data["stages"][0]["base"]["model"]["name"] = BAD_MODEL
    resp = client.post("/api/pipelines", json=data, headers=auth)
    assert resp.status_code == 201, resp.text
    p = resp.json()
    assert [(s["kind"], s["from"], s["status"]) for s in p["stages"]] == [
        ("sft", None, "running"),
        ("rl", 0, "pending"),
        ("eval", 1, "pending"),
    ]
    assert client.post(f"/api/pipelines/{p['id']}/stop", headers=auth).json()["status"] == "cancelled"


def test_dashboard_stop_and_resume_forms_follow_the_pipeline_state(
    client: Any, auth: dict[str, str], session: Session
) -> None:
    """The pipeline page's Stop (running) and Resume (failed, cancelled) forms: the same services as the REST routes,
    CSRF-checked, refused to a viewer; a resume the state does not allow is a 409 with its one line on the page."""
    one = {"name": "web1", "stages": [body()["stages"][0]]}
    p = client.post("/api/pipelines", json=one, headers=auth).json()
    pid, first = p["id"], p["stages"][0]["run_id"]
    csrf = login(client, new_token("pipeline-web-admin"))
    html = client.get(f"/pipelines/{pid}").text
    assert 'id="pipeline-stop"' in html and 'id="pipeline-resume"' not in html
    assert client.post(f"/pipelines/{pid}/stop", data={}).status_code == 403  # no CSRF token
    assert show(client, auth, pid)["status"] == "running"

    resp = client.post(f"/pipelines/{pid}/stop", data={"csrf": csrf}, follow_redirects=False)
    assert (resp.status_code, resp.headers["location"]) == (303, f"/pipelines/{pid}")
    assert states(show(client, auth, pid)) == ("cancelled", ["cancelled"])
    assert client.get(f"/api/runs/{first}", headers=auth).json()["status"] == "cancelled"  # queued: cancelled at once
    html = client.get(f"/pipelines/{pid}").text
    assert 'id="pipeline-resume"' in html and 'id="pipeline-stop"' not in html

    viewer_csrf = login(client, new_token("pipeline-web-viewer", role="viewer"))
    html = client.get(f"/pipelines/{pid}").text
    assert 'id="pipeline-resume"' not in html and 'id="pipeline-stop"' not in html
    resp = client.post(f"/pipelines/{pid}/resume", data={"csrf": viewer_csrf})
    assert resp.status_code == 403 and resp.json()["detail"].endswith("viewers may only read")

    csrf = login(client, new_token("pipeline-web-admin"))
    resp = client.post(f"/pipelines/{pid}/resume", data={"csrf": csrf}, follow_redirects=False)
    assert resp.status_code == 303, resp.text
    p = show(client, auth, pid)
    again = p["stages"][0]["run_id"]
    assert states(p) == ("running", ["running"]) and again != first  # no checkpoint: a new run
    resp = client.post(f"/pipelines/{pid}/resume", data={"csrf": csrf})
    assert resp.status_code == 409
    assert f'id="page-error">pipeline {pid} is running: only failed or cancelled pipelines resume</p>' in resp.text

    set_status(client, again, "starting", "running", "completed")
    assert pipelines.tick(session, pid)[-1] == "every stage completed (1)"
    resp = client.post(f"/pipelines/{pid}/resume", data={"csrf": csrf})
    assert resp.status_code == 409
    assert f'id="page-error">pipeline {pid} is completed: only failed or cancelled pipelines resume</p>' in resp.text
    assert 'id="pipeline-status">completed<' in resp.text and 'id="pipeline-resume"' not in resp.text
    resp = client.post(f"/pipelines/{pid}/stop", data={"csrf": csrf})
    assert resp.status_code == 409 and f"pipeline {pid} is completed: cannot go to cancelled" in resp.text


def test_a_stage_in_another_users_run_folder_is_403_at_create_as_in_sweeps(
    client: Any, auth: dict[str, str], session: Session
) -> None:
    theirs = client.post("/api/runs", json=spec(), headers=auth).json()
    member = {"Authorization": f"Bearer {new_token('pipeline-member-' + str(theirs['id']), role='member')}"}
    weights = f"{Path(theirs['run_dir']).parent}/final"
    before = session.exec(select(func.count()).select_from(Pipeline)).one()
    line = (
        f"stages[0].model.name: {weights!r} is inside the folder of run {theirs['id']}, which is not yours: only a "
        "run's owner or an admin may use its files (an eval job of its weights: model.run)"
    )
    for first in ("rl", "sft"):
        base = spec(model={"name": weights}) if first == "rl" else {"model": {"name": weights}, "max_steps": 4}
        stages = [{"kind": first, "base": base}, {"kind": "eval", "base": {"eval": {"num_examples": 4}}}]
        resp = client.post("/api/pipelines", json={"name": "foreign", "stages": stages}, headers=member)
        assert (resp.status_code, resp.json()) == (403, {"detail": line})
    session.expire_all()
    assert session.exec(select(func.count()).select_from(Pipeline)).one() == before


def test_two_ticks_at_once_on_sqlite_create_the_first_stages_run_once(sqlite_engine: Any, monkeypatch: Any) -> None:
    """SQLite has no ``FOR UPDATE``: a tick's lock on its pipeline is the database's write lock, so the tick the
    submit runs and beat's tick (the embedded demo once saw both create stage 0's run, and train it twice) create one
    run between them; the second waits for the first's commit and finds the stage running."""
    import threading
    import time

    from server.services import runs

    with Session(sqlite_engine) as s:
        pid = pipelines.create(s, data=body(), owner="alice").id
        s.commit()
    start = pipelines._start

    def slow_start(*args: Any, **kwargs: Any) -> Run:  # widens the window between the stage's read and the commit
        run = start(*args, **kwargs)
        time.sleep(0.5)
        return run

    monkeypatch.setattr(pipelines, "_start", slow_start)
    monkeypatch.setattr(runs, "enqueue_launch", lambda session, run_id: None)  # no broker in this test
    done: list[list[str]] = []

    def tick() -> None:
        with Session(sqlite_engine) as s:
            done.append(pipelines.tick(s, pid))

    ticks = [threading.Thread(target=tick) for _ in range(2)]
    for t in ticks:
        t.start()
    for t in ticks:
        t.join(timeout=60)
    with Session(sqlite_engine) as s:
        (run_id,) = s.exec(select(Run.id)).all()
        assert pipelines.stages(s, pid)[0].run_id == run_id
    assert sorted(done) == [[], [f"stage 0 (sft): run {run_id} created"]]
