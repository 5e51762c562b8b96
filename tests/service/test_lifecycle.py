"""Resume, fork, logs and reconcile: REST routes, the launch they lead to, the CLI, and Celery beat.

Checkpoints here are written with ``worker.run.checkpoint.write_part`` (the trainer's own atomic writer) holding
small stand-in files; the launched supervisors then fail in preflight on the test model path, which comes
*after* the run-directory check: a reason ``preflight: model.name`` (not "run directory exists") shows the
supervisor was started with ``--resume``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import BAD_MODEL, run_token_headers, stop_process_group, stored, wait_for
from worker.run.checkpoint import write_part
from worker.run.rundir import RunDir


def events(client: Any, auth: dict[str, str], run_id: int) -> list[dict[str, Any]]:
    return list(client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"])


def set_status(client: Any, run_id: int, *statuses: str) -> None:
    for status in statuses:
        resp = client.post(
            f"/api/runs/{run_id}/status", json={"status": status, "reason": status}, headers=run_token_headers(run_id)
        )
        assert resp.status_code == 200, resp.text


def checkpoint(run: dict[str, Any], step: int, *, parts: tuple[str, ...] = ("trainer", "orchestrator")) -> None:
    """A checkpoint of ``step`` in the run's directory (parts written by the real writer) plus its config.json."""
    rd = RunDir(run["run_dir"])
    rd.create()
    rd.config.write_text(json.dumps(run["spec"]))
    for part in parts:
        write_part(rd, step, part, lambda d, p=part: (d / "state.bin").write_bytes(f"{p}-{step}".encode()))


def dead_pid() -> int:
    proc = subprocess.Popen(["sleep", "60"])
    proc.kill()
    proc.wait()
    return proc.pid


@pytest.fixture
def server_url(live_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    from server.core.config import settings

    monkeypatch.setattr(settings, "ASYNCRL_SERVER_URL", live_server)
    return live_server


# ----------------------------------------------------------------------------- resume


def test_resume_requires_failed_or_cancelled_and_a_complete_checkpoint(
    client: Any, auth: dict[str, str], make_run: Any
) -> None:
    run = make_run()
    resp = client.post(f"/api/runs/{run['id']}/resume", headers=auth)
    assert resp.status_code == 409 and resp.json()["detail"] == (
        f"run {run['id']} is queued: only failed or cancelled runs resume"
    )
    set_status(client, run["id"], "starting", "failed")
    checkpoint(run, 2, parts=("trainer",))  # incomplete: no orchestrator part
    resp = client.post(f"/api/runs/{run['id']}/resume", headers=auth)
    ckpts = f"{run['name']}/checkpoints"  # relative to the run's folder: no server path in a message
    assert resp.status_code == 409 and resp.json()["detail"] == f"run {run['id']}: no complete checkpoint in {ckpts}"
    done = make_run()
    set_status(client, done["id"], "starting", "running", "completed")
    checkpoint(done, 1)
    resp = client.post(f"/api/runs/{done['id']}/resume", headers=auth)
    assert resp.status_code == 409 and "is completed: only failed or cancelled runs resume" in resp.json()["detail"]
    rt = client.post(f"/api/runs/{done['id']}/resume", headers=run_token_headers(done["id"]))
    assert rt.status_code == 403
    # resume is the only way back: a status report cannot move a failed run to queued
    back = client.post(f"/api/runs/{run['id']}/status", json={"status": "queued"}, headers=auth)
    assert back.status_code == 409 and "failed: cannot go to queued" in back.json()["detail"]
    back = client.post(f"/api/runs/{run['id']}/status", json={"status": "queued"}, headers=run_token_headers(run["id"]))
    assert back.status_code == 401  # and the run's own token no longer writes at all


def test_state_machine_resume_edge(session: Any, make_run: Any) -> None:
    from server.models import RunStatus as S
    from server.services import runs

    failed, done = runs.get(session, make_run()["id"]), runs.get(session, make_run()["id"])
    runs.transition(session, failed, S.failed, reason="crash")
    for to in (S.starting, S.running, S.completed):
        runs.transition(session, done, to)
    with pytest.raises(runs.InvalidTransition, match="is failed: cannot go to queued"):
        runs.transition(session, failed, S.queued)
    with pytest.raises(runs.InvalidTransition, match="is completed: cannot go to queued"):
        runs.transition(session, done, S.queued, _resume=True)
    with pytest.raises(runs.InvalidTransition, match="is failed: cannot go to running"):
        runs.transition(session, failed, S.running, _resume=True)
    assert runs.transition(session, failed, S.queued, _resume=True) and failed.status == S.queued
    assert failed.finished_at is None and runs.RESUMABLE == {S.failed, S.cancelled}
    session.rollback()


@pytest.mark.usefixtures("server_url")
def test_resume_relaunches_the_same_run_from_its_newest_checkpoint(
    client: Any, auth: dict[str, str], make_run: Any
) -> None:
    from server.jobs.tasks import launch

    run = make_run()
    set_status(client, run["id"], "starting", "running", "failed")
    for step in (2, 4):
        checkpoint(run, step)
    checkpoint(run, 6, parts=("trainer",))  # newer but incomplete: ignored
    points = [{"source": "trainer", "step": s, "name": "loss", "value": 1.0 / s, "time": 1.0} for s in range(1, 7)]
    ingest = client.post(f"/api/runs/{run['id']}/metrics", json={"points": points}, headers=auth)
    assert ingest.json()["inserted"] == 6

    resp = client.post(f"/api/runs/{run['id']}/resume", headers=auth)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert (body["id"], body["run_dir"], body["status"]) == (run["id"], run["run_dir"], "queued")
    assert body["launcher_handle"] is None and body["finished_at"] is None
    assert stored(run["id"]) == 4  # steps 5 and 6 are measured again by the resumed run
    evs = events(client, auth, run["id"])
    assert (evs[-2]["from_status"], evs[-2]["to_status"]) == ("failed", "queued")
    assert evs[-1]["kind"] == "resumed" and evs[-1]["data"]["step"] == 4
    assert evs[-1]["reason"].endswith("from checkpoint step 4")

    assert launch(run["id"]).startswith(f"launched: run {run['id']} pid")
    done = wait_for(
        lambda: (r := client.get(f"/api/runs/{run['id']}", headers=auth).json())["status"] == "failed" and r,
        60,
        "resumed run failed in preflight",
    )
    assert done["status_reason"].startswith("preflight: model.name"), done["status_reason"]
    supervisor_log = (Path(run["run_dir"]).parent / "supervisor.log").read_text()
    assert "run directory" not in done["status_reason"] and supervisor_log.count("ended failed preflight") == 1


# ----------------------------------------------------------------------------- fork


@pytest.mark.usefixtures("server_url")
def test_fork_makes_a_new_run_from_a_checkpoint_with_changes(client: Any, auth: dict[str, str], make_run: Any) -> None:
    from server.jobs.tasks import launch

    parent = make_run(max_steps=8)
    for step in (2, 4):
        checkpoint(parent, step)
    body = {"step": 2, "changes": {"trainer.optim.lr": 5e-5, "max_steps": 12}, "name": "forked"}
    resp = client.post(f"/api/runs/{parent['id']}/fork", json=body, headers=auth)
    assert resp.status_code == 201, resp.text
    child = resp.json()
    assert child["id"] != parent["id"] and child["status"] == "queued" and child["name"] == "forked"
    assert child["spec"]["trainer"]["optim"]["lr"] == 5e-5 and child["spec"]["max_steps"] == 12
    assert child["spec"]["orchestrator"] == parent["spec"]["orchestrator"]
    assert child["run_dir"].endswith(f"runs/{child['id']}/forked")
    src, dst = RunDir(parent["run_dir"]).checkpoint_dir(2), RunDir(child["run_dir"]).checkpoint_dir(2)
    for part in ("trainer", "orchestrator"):
        assert (dst / part / "state.bin").read_bytes() == f"{part}-2".encode()
        assert (dst / part / "state.bin").stat().st_ino == (src / part / "state.bin").stat().st_ino  # hard link
    assert not RunDir(child["run_dir"]).checkpoint_dir(4).exists()
    assert json.loads(RunDir(child["run_dir"]).config.read_text()) == child["spec"]
    forked = events(client, auth, child["id"])[-1]
    assert forked["kind"] == "forked" and forked["data"] == {
        "parent_run_id": parent["id"],
        "step": 2,
        "changes": body["changes"],
    }
    assert events(client, auth, parent["id"])[-1]["data"] == {"child_run_id": child["id"], "step": 2}

    default = client.post(f"/api/runs/{parent['id']}/fork", json={}, headers=auth)
    assert default.status_code == 201 and default.json()["name"] == parent["name"]
    assert RunDir(default.json()["run_dir"]).checkpoint_dir(4).is_dir()  # newest complete by default

    assert launch(child["id"]).startswith("launched")  # resumes from the copied checkpoint
    done = wait_for(
        lambda: (r := client.get(f"/api/runs/{child['id']}", headers=auth).json())["status"] == "failed" and r,
        60,
        "forked run failed in preflight",
    )
    assert done["status_reason"].startswith("preflight: model.name"), done["status_reason"]


@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        (
            {"changes": {"trainer.optim.lrr": 1}},
            422,
            "unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)",
        ),
        ({"changes": {"trainer.optim.lr": "fast"}}, 422, "trainer.optim.lr: "),
        ({"changes": {"max_steps.x": 1}}, 422, "changes.max_steps.x: max_steps is not a table"),
        ({"changes": {"output_dir": "/tmp"}}, 422, "changes.output_dir: set by the service"),
        ({"step": 3}, 422, "step: run {id} has no complete checkpoint at step 3 (complete: [2])"),
        ({"changes": {"max_steps": 2}}, 422, "max_steps: 2 leaves nothing to train after the fork step 2"),
        ({"chnages": {}}, 422, "body.chnages: Extra inputs are not permitted"),
        (  # the API's own words, not the CLI's ("this command runs 'rl' specs")
            {"changes": {"kind": "sft"}},
            422,
            "kind: a fork of an 'rl' run is an 'rl' run; leave 'kind' out of changes, got 'sft'",
        ),
        (  # the parent is a full fine-tune: its checkpoint holds no adapter for a LoRA child to load
            {"changes": {"trainer.lora": {"rank": 16}}},
            422,
            "trainer.lora: a fork keeps its parent's setting: the checkpoint holds full weights (no trainer.lora), the "
            "changes ask for rank = 16, alpha = 16.0, dropout = 0.0, target_modules = ['q_proj', 'k_proj', 'v_proj', "
            "'o_proj', 'gate_proj', 'up_proj', 'down_proj']; start a new run instead",
        ),
        (  # a full fine-tune's checkpoint holds weights trained from its model: another name would mislabel them
            {"changes": {"model.name": "other/model"}},
            422,
            "model.name: a fork keeps its parent's model (",
        ),
    ],
)
def test_fork_bad_input_names_the_field(
    client: Any, auth: dict[str, str], make_run: Any, body: dict[str, Any], status: int, detail: str
) -> None:
    parent = make_run()
    checkpoint(parent, 2)
    before = client.get("/api/runs", params={"limit": 1}, headers=auth).json()["count"]
    resp = client.post(f"/api/runs/{parent['id']}/fork", json=body, headers=auth)
    assert resp.status_code == status and resp.json()["detail"].startswith(detail.format(id=parent["id"])), resp.text
    assert client.get("/api/runs", params={"limit": 1}, headers=auth).json()["count"] == before


def test_fork_of_a_lora_run_keeps_its_lora_setting(client: Any, auth: dict[str, str], make_run: Any) -> None:
    """A LoRA parent's checkpoint holds an adapter of rank 4 on q_proj/v_proj: a child of another rank, or a full
    fine-tune, cannot load it (422 naming trainer.lora, no run made); other changes fork as usual."""
    parent = make_run(max_steps=8, trainer={"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}})
    checkpoint(parent, 2)
    held = "a LoRA adapter (rank = 4, alpha = 16.0, dropout = 0.0, target_modules = ['q_proj', 'v_proj'])"
    for changes, wanted in (
        ({"trainer.lora.rank": 8}, "rank = 8, alpha = 16.0, dropout = 0.0, target_modules = ['q_proj', 'v_proj']"),
        ({"trainer.lora": None}, "a full fine-tune"),
    ):
        resp = client.post(f"/api/runs/{parent['id']}/fork", json={"changes": changes}, headers=auth)
        assert resp.status_code == 422, resp.text
        assert resp.json()["detail"] == (
            f"trainer.lora: a fork keeps its parent's setting: the checkpoint holds {held}, the changes ask for "
            f"{wanted}; start a new run instead"
        )
    # the adapter is a delta on its base: another base model cannot take it
    resp = client.post(f"/api/runs/{parent['id']}/fork", json={"changes": {"model.name": "other/base"}}, headers=auth)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"].startswith("model.name: a fork keeps its parent's model ("), resp.text
    assert resp.json()["detail"].endswith(
        "checkpoint's adapter, trained from it, not from other/base; start a new run for another model"
    )
    resp = client.post(
        f"/api/runs/{parent['id']}/fork",
        json={"changes": {"trainer.optim.lr": 1e-5, "trainer.lora.rank": 4}},
        headers=auth,
    )
    assert resp.status_code == 201, resp.text
    assert resp.json()["spec"]["trainer"]["lora"]["rank"] == 4


def test_fork_takes_the_parents_policy_check_probe(client: Any, auth: dict[str, str], make_run: Any) -> None:
    """The served-policy check of a fork compares against its parent's probe and base
    (worker/orchestrator/policy_check.py): the probe, the base log-probs and the fork step's are copied, no later
    version's; a parent with none gives none."""
    parent, bare = make_run(max_steps=8), make_run(max_steps=8)
    checkpoint(parent, 2)
    checkpoint(bare, 2)
    folder = RunDir(parent["run_dir"]).policy_check
    folder.mkdir(parents=True)
    for name in ("probe.json", "step_0.json", "step_1.json", "step_2.json", "step_3.json"):
        (folder / name).write_text(f'{{"file": "{name}"}}')
    child = client.post(f"/api/runs/{parent['id']}/fork", json={}, headers=auth).json()
    copied = RunDir(child["run_dir"]).policy_check
    assert sorted(p.name for p in copied.iterdir()) == ["probe.json", "step_0.json", "step_2.json"]
    assert (copied / "step_2.json").read_text() == '{"file": "step_2.json"}'
    other = client.post(f"/api/runs/{bare['id']}/fork", json={}, headers=auth).json()
    assert not RunDir(other["run_dir"]).policy_check.exists()


def ack(client: Any, run_id: int, revision: int, process: str, step: int) -> None:
    body = {"process": process, "step": step}
    resp = client.post(f"/api/runs/{run_id}/config/{revision}/ack", json=body, headers=run_token_headers(run_id))
    assert resp.status_code == 200, resp.text


def test_fork_resume_and_compare_use_the_config_in_effect_at_the_step(
    web: tuple[Any, str], auth: dict[str, str], make_run: Any
) -> None:
    """The parent (spec lr 1.5e-4, temperature 1.0) is switched live: r1 lr 5e-5 taken up by the trainer at step 3;
    r2 temperature 1.3 + lr 3e-5, taken up by the orchestrator at step 5 and by the trainer at step 7; r3 lr 1e-5
    sent as the run ended, never applied. Checkpoints at 2, 4 and 6. Hand-checked:

    fork at 2 -> lr 1.5e-4, temperature 1.0 (nothing in effect yet); at 4 -> lr 5e-5, 1.0; at 6 -> lr 5e-5 (r2's lr
    came at 7), 1.3; at 6 with lr 2e-5 asked -> 2e-5, 1.3. The compare page shows the parent at its end: lr 3e-5
    (r3 never applied), temperature 1.3. Resumed from 6: r2's trainer ack at 7 is forgotten (step 7 is re-done), and
    the resumed trainer starts with every revision replayed, lr 1e-5 (r3 included), as the ``resumed`` event says."""
    from worker.live_config import ACKS_FILE, LiveConfig, append_revision
    from worker.spec import validate_spec

    client = web[0]
    parent = make_run(max_steps=12, trainer={"optim": {"lr": 1.5e-4}}, orchestrator={"temperature": 1.0})
    pid = parent["id"]
    set_status(client, pid, "starting", "running")
    for step in (2, 4, 6):
        checkpoint(parent, step)
    for changes in (
        {"trainer.optim.lr": 5e-5},
        {"orchestrator.temperature": 1.3, "trainer.optim.lr": 3e-5},
        {"trainer.optim.lr": 1e-5},
    ):
        assert client.patch(f"/api/runs/{pid}/config", json={"changes": changes}, headers=auth).status_code == 201
    ack(client, pid, 1, "trainer", 3)
    ack(client, pid, 2, "orchestrator", 5)
    ack(client, pid, 2, "trainer", 7)
    set_status(client, pid, "failed")

    def fork(**body: Any) -> dict[str, Any]:
        resp = client.post(f"/api/runs/{pid}/fork", json=body, headers=auth)
        assert resp.status_code == 201, resp.text
        return dict(resp.json())

    expected = {2: (1.5e-4, 1.0), 4: (5e-5, 1.0), 6: (5e-5, 1.3)}
    children = {}
    for step, (lr, temperature) in expected.items():
        child = children[step] = fork(step=step)
        assert (child["spec"]["trainer"]["optim"]["lr"], child["spec"]["orchestrator"]["temperature"]) == (
            lr,
            temperature,
        )
        assert json.loads(RunDir(child["run_dir"]).config.read_text()) == child["spec"]  # what its trainer reads
    inherited = [events(client, auth, children[s]["id"])[-1]["data"].get("in_effect") for s in expected]
    assert inherited == [None, {"trainer.optim.lr": 5e-5}, {"trainer.optim.lr": 5e-5, "orchestrator.temperature": 1.3}]
    asked = fork(changes={"trainer.optim.lr": 2e-5})  # the newest checkpoint (6), the change on top
    assert (asked["spec"]["trainer"]["optim"]["lr"], asked["spec"]["orchestrator"]["temperature"]) == (2e-5, 1.3)

    page = client.get("/compare", params={"run": [pid, children[2]["id"]]}).text
    rows = dict(re.findall(r"<tr><th scope=\"row\"><code>([^<]+)</code></th><td>([^<]*)</td>", page))
    assert rows["trainer.optim.lr"] == "3e-05" and rows["orchestrator.temperature"] == "1.3", page

    resp = client.post(f"/api/runs/{pid}/resume", headers=auth)
    assert resp.status_code == 200, resp.text
    resumed = events(client, auth, pid)[-1]
    assert resumed["kind"] == "resumed" and resumed["data"]["step"] == 6
    assert resumed["data"]["live_config"] == {"trainer.optim.lr": 1e-5, "orchestrator.temperature": 1.3}
    revs = client.get(f"/api/runs/{pid}/config", headers=auth).json()["data"]
    assert [r["applied"] for r in revs] == [{"trainer": 3}, {"orchestrator": 5}, {}]
    assert [r["state"] for r in revs] == ["in effect", "pending (trainer)", "pending"]
    # the engine agrees: the resumed trainer's live config (the run's file, acks of the first life) gives lr 1e-5
    rd = RunDir(parent["run_dir"])
    for rev in revs:
        append_revision(rd.root, rev["revision"], rev["changes"])
    acks = [(1, "trainer", 3), (2, "orchestrator", 5), (2, "trainer", 7)]
    lines = [{"revision": r, "process": p, "step": s} for r, p, s in acks]
    (rd.root / ACKS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    spec, changed = LiveConfig(rd.root, "trainer", start_step=6).apply(validate_spec("rl", parent["spec"]), 7)
    assert spec.trainer.optim.lr == 1e-5 and changed == {"trainer.optim.lr": 1e-5}


def test_fork_without_checkpoint_is_409(client: Any, auth: dict[str, str], make_run: Any) -> None:
    parent = make_run()
    resp = client.post(f"/api/runs/{parent['id']}/fork", json={}, headers=auth)
    assert resp.status_code == 409 and resp.json()["detail"].startswith(f"run {parent['id']}: no complete checkpoint")
    # a bad key is named first, with or without a checkpoint (the request itself is wrong)
    resp = client.post(f"/api/runs/{parent['id']}/fork", json={"changes": {"trainer.optim.lrr": 1}}, headers=auth)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"] == "unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)"


# ----------------------------------------------------------------------------- logs


def test_logs_tail_process_and_access(client: Any, auth: dict[str, str], make_run: Any) -> None:
    run, other = make_run(), make_run()
    url = f"/api/runs/{run['id']}/logs"
    resp = client.get(url, params={"process": "trainer"}, headers=auth)
    assert resp.status_code == 404 and resp.json()["detail"].startswith(f"process: run {run['id']} has no trainer log")
    logs = RunDir(run["run_dir"]).logs
    logs.mkdir(parents=True)
    (logs / "trainer.log").write_text("".join(f"line {i}\n" for i in range(100_000)))
    (Path(run["run_dir"]).parent / "supervisor.log").write_bytes(b"started\nbad byte \xff\n")
    resp = client.get(url, params={"tail": 3}, headers=auth)
    assert resp.status_code == 200 and resp.json()["lines"] == ["line 99997", "line 99998", "line 99999"]
    assert resp.json()["process"] == "trainer" and resp.json()["path"] == str(logs / "trainer.log")
    assert len(client.get(url, params={"tail": 5000}, headers=auth).json()["lines"]) == 5000
    sup = client.get(url, params={"process": "supervisor"}, headers=run_token_headers(run["id"]))
    assert sup.status_code == 200 and sup.json()["lines"] == ["started", "bad byte \ufffd"]
    bad = client.get(url, params={"process": "vllm"}, headers=auth)
    assert bad.status_code == 422 and bad.json()["detail"] == (
        "query.process: expected 'trainer', 'orchestrator', 'inference', 'inference-<i>' (replica i, 1-63, of several), "
        "'eval' or 'supervisor', got 'vllm'"
    )
    (logs / "inference-1.log").write_text("replica 1 ready\n")  # a run with inference.replicas = 2
    replica = client.get(url, params={"process": "inference-1"}, headers=auth)
    assert replica.status_code == 200 and replica.json()["lines"] == ["replica 1 ready"]
    assert client.get(url, params={"process": "inference-0"}, headers=auth).status_code == 422  # replica 0: inference
    assert client.get(url, params={"tail": 5001}, headers=auth).status_code == 422
    assert client.get(url, params={"tail": 0}, headers=auth).status_code == 422
    assert client.get(url, headers=run_token_headers(other["id"])).status_code == 403
    assert client.get("/api/runs/999999/logs", headers=auth).status_code == 404


# ----------------------------------------------------------------------------- reconcile


def launched_run(make_run: Any, status: str, pid: int) -> int:
    """A run in ``status`` that a local launch recorded with supervisor ``pid``."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.models import RunStatus
    from server.services import runs

    run_id = make_run()["id"]
    with Session(engine) as s:
        run = runs.get(s, run_id, lock=True)
        run.launcher, run.launcher_handle = "local", str(pid)
        path = ["starting", "running", "paused"]
        for to in path[: path.index(status) + 1]:
            runs.transition(s, run, RunStatus(to), reason="test")
        s.commit()
    return run_id


def test_reconcile_fails_runs_whose_supervisor_is_gone(client: Any, auth: dict[str, str], make_run: Any) -> None:
    from server.jobs.tasks import reconcile

    gone = dead_pid()
    crashed = launched_run(make_run, "running", gone)
    paused = launched_run(make_run, "paused", gone)
    run_dir = Path(client.get(f"/api/runs/{crashed}", headers=auth).json()["run_dir"])
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text('{"event": "starting"}\n{"event": "running", "pids": {}}\n')
    # measured, never forwarded (the supervisor was killed before its next send): stored by reconcile
    rows = [{"source": "trainer", "step": s, "time": 1.0 + s, "loss": 0.5 / s} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    alive = subprocess.Popen(["sleep", "60"])
    try:
        healthy = launched_run(make_run, "running", alive.pid)
        first = reconcile()
        assert crashed in first and paused in first and healthy not in first
        assert reconcile() == []  # idempotent
        run = client.get(f"/api/runs/{crashed}", headers=auth).json()
        assert run["status"] == "failed" and run["finished_at"]
        assert run["status_reason"].startswith(f"supervisor {gone} is gone; last lines:\n")
        assert '{"event": "running", "pids": {}}' in run["status_reason"]
        assert client.get(f"/api/runs/{paused}", headers=auth).json()["status_reason"] == f"supervisor {gone} is gone"
        [series] = client.get(f"/api/runs/{crashed}/metrics", params={"name": "loss"}, headers=auth).json()["series"]
        assert (series["step"], series["value"]) == ([1, 2, 3], [0.5, 0.25, 0.5 / 3])
        assert client.get(f"/api/runs/{healthy}", headers=auth).json()["status"] == "running"
        last = events(client, auth, crashed)[-1]
        assert (last["from_status"], last["to_status"], last["data"]) == (
            "running",
            "failed",
            {"pid": gone, "by": "reconcile"},
        )
    finally:
        alive.kill()
        alive.wait()


def test_asyncrl_worker_embeds_beat_that_reconciles(
    client: Any, auth: dict[str, str], make_run: Any, tmp_path: Path
) -> None:
    """``asyncrl worker`` (beat embedded) on its own queue, reconcile every second: a crashed run turns failed."""
    gone = dead_pid()
    run_id = launched_run(make_run, "starting", gone)
    log = tmp_path / "worker.log"
    env = {
        **os.environ,
        "RECONCILE_INTERVAL_S": "1",
        "CELERY_QUEUE": f"{os.environ['CELERY_QUEUE']}-beat",
        "ASYNCRL_HOME": str(tmp_path / "home"),
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "worker", "--concurrency", "1"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        run = wait_for(
            lambda: (r := client.get(f"/api/runs/{run_id}", headers=auth).json())["status"] == "failed" and r,
            60,
            f"beat reconcile (log: {log.read_text()[-2000:]})",
        )
    finally:
        stop_process_group(proc)
    assert run["status_reason"] == f"supervisor {gone} is gone"
    assert "asyncrl.reconcile" in log.read_text() and any((tmp_path / "home").glob("celerybeat-schedule*"))


# ----------------------------------------------------------------------------- CLI


def test_cli_runs_resume_fork_logs(
    capsys: pytest.CaptureFixture[str],
    live_server: str,
    make_run: Any,
    client: Any,
    auth: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.cli import main

    def cli(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    monkeypatch.setenv("ASYNCRL_URL", live_server)
    monkeypatch.setenv("ASYNCRL_TOKEN", auth["Authorization"].split()[1])
    parent = make_run(max_steps=6)
    checkpoint(parent, 3)
    code, out, _ = cli(
        "runs",
        "fork",
        str(parent["id"]),
        "--set",
        "trainer.optim.lr=2e-5",
        "--set",
        "orchestrator.group_size=4",
        "--name",
        "cli-fork",
    )
    child = json.loads(out)
    assert code == 0 and child["name"] == "cli-fork" and child["status"] == "queued"
    spec = client.get(f"/api/runs/{child['id']}", headers=auth).json()["spec"]
    assert spec["trainer"]["optim"]["lr"] == 2e-5 and spec["orchestrator"]["group_size"] == 4
    code, _, err = cli("runs", "fork", str(parent["id"]), "--set", "trainer.optim.lr")
    assert (
        code == 2
        and err.strip() == "error: --set: expected key=value such as trainer.optim.lr=5e-5, got 'trainer.optim.lr'"
    )
    code, _, err = cli("runs", "fork", str(parent["id"]), "--set", "trainer.optim.lrr=1")
    assert code == 2 and err.strip() == "error: 422: unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)"

    code, _, err = cli("runs", "resume", str(parent["id"]))
    assert (
        code == 2 and err.strip() == f"error: 409: run {parent['id']} is queued: only failed or cancelled runs resume"
    )
    set_status(client, parent["id"], "cancelled")
    code, out, _ = cli("runs", "resume", str(parent["id"]))
    assert code == 0 and json.loads(out)["status"] == "queued"

    logs = RunDir(parent["run_dir"]).logs
    (logs / "orchestrator.log").write_text("a\nb\nc\n")
    code, out, _ = cli("runs", "logs", str(parent["id"]), "--process", "orchestrator", "--tail", "2")
    assert code == 0 and out == "b\nc\n"
    code, _, err = cli("runs", "logs", str(parent["id"]), "--process", "gpu")
    assert code == 2 and err.strip() == (
        "error: 422: query.process: expected 'trainer', 'orchestrator', 'inference', 'inference-<i>' (replica i, 1-63, "
        "of several), 'eval' or 'supervisor', got 'gpu'"
    )
    code, _, err = cli("runs", "logs", str(parent["id"]))
    assert code == 2 and err.strip().startswith(f"error: 404: process: run {parent['id']} has no trainer log yet")


def test_a_stop_still_finishing_does_not_cancel_the_resumed_run(
    client: Any, auth: dict[str, str], make_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race a real run showed: stop's terminate() waits for the process group; meanwhile the supervisor reports
    ``cancelled`` and the user resumes. The stop task must then leave the new launch alone."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.jobs import tasks
    from server.models import RunStatus
    from server.services import runs

    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    run_id = launched_run(make_run, "running", sleeper.pid)
    run = client.get(f"/api/runs/{run_id}", headers=auth).json()
    checkpoint(run, 2)

    def terminate_then_resume(pid: int, grace_s: float, cgroup: object = None) -> None:  # noqa: ARG001 - terminate's signature
        sleeper.kill()
        sleeper.wait()
        with Session(engine) as s:
            row = runs.get(s, run_id, lock=True)
            runs.transition(s, row, RunStatus.cancelled, reason="terminated")  # the supervisor's own report
            runs.resume(s, row, by="user")
            s.commit()

    monkeypatch.setattr(tasks.supervisor, "terminate", terminate_then_resume)
    assert tasks.stop(run_id) == f"stopped: run {run_id} was relaunched (handle None)"
    assert client.get(f"/api/runs/{run_id}", headers=auth).json()["status"] == "queued"


def test_cli_submit_takes_set_overrides(
    capsys: pytest.CaptureFixture[str],
    live_server: str,
    client: Any,
    auth: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``asyncrl submit SPEC --set k=v`` stores the spec with the changes (values as TOML literals); without ``--set``
    the file goes as it is; a key the server refuses is one line, exit 2, no run made."""
    from worker.cli import main

    monkeypatch.setenv("ASYNCRL_URL", live_server)
    monkeypatch.setenv("ASYNCRL_TOKEN", auth["Authorization"].split()[1])
    config = str(Path(__file__).resolve().parents[2] / "configs/reverse_text/rl.toml")
    sets = ["trainer.optim.lr=5e-5", "name=cli-set", "max_steps=7", f"model.name={BAD_MODEL}"]
    code = main(["submit", config, *(a for s in sets for a in ("--set", s))])
    out, err = capsys.readouterr()
    assert code == 0, err
    run = client.get(f"/api/runs/{json.loads(out)['id']}", headers=auth).json()
    assert (run["name"], run["spec"]["trainer"]["optim"]["lr"], run["spec"]["max_steps"]) == ("cli-set", 5e-5, 7)
    assert run["spec"]["orchestrator"]["temperature"] == 1.5  # the file's other values stay
    before = client.get("/api/runs", params={"limit": 1}, headers=auth).json()["count"]
    code = main(["submit", config, "--set", "trainer.optim.lr=-1", "--set", f"model.name={BAD_MODEL}"])
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("error: 422: trainer.optim.lr: "), err
    code = main(["submit", config, "--set", 'kind=["rl"]'])  # not a string: one line, not a TypeError
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("error: kind: expected one of ['eval', 'rl', 'sft'], got ['rl']"), err
    assert client.get("/api/runs", params={"limit": 1}, headers=auth).json()["count"] == before
