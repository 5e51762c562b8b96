"""Exports through the service: ``GET /api/runs/{id}/checkpoints``, ``POST /api/runs/{id}/exports`` (owner or
admin; 202), the dashboard's checkpoint list and export form, and the ``export_run`` Celery task through a real worker
on the real Redis and Postgres writing a folder that loads with transformers and gives the checkpoint's logits."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.checkpoints import base_model, full_checkpoint, logits, lora_checkpoint
from tests.support.server import new_token, run_token_headers, spec, start_celery_worker, stop_process_group, wait_for
from tests.support.webui import login


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.policy.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "base", size="tiny", seed=0)


People = dict[str, tuple[str, dict[str, str]]]
SUFFIX = secrets.token_hex(3)


@pytest.fixture(scope="module")
def people() -> People:
    """who -> (token, headers) of the run's owner (a member), another member, a viewer and an admin; the user names
    are ``export-<who>-<SUFFIX>``."""
    out = {}
    for who, role in (("owner", "member"), ("other", "member"), ("viewer", "viewer"), ("admin", "admin")):
        token = new_token(f"export-{who}-{SUFFIX}", role=role)
        out[who] = (token, {"Authorization": f"Bearer {token}"})
    return out


def owner_name(_client: Any, _people: People) -> str:
    return f"export-owner-{SUFFIX}"


def stored_run(owner: str, model_dir: Path) -> dict[str, Any]:
    """A completed run of ``owner`` added through the service (no launch enqueued), naming the tiny model."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.models import RunPublic, RunStatus
    from server.services import runs

    with Session(engine) as s:
        run = runs.create(s, data=spec(model={"name": str(model_dir)}), owner=owner)
        runs.transition(s, run, RunStatus.cancelled, reason="test")
        s.commit()
        return RunPublic.model_validate(run).model_dump()


@pytest.fixture(scope="module")
def celery_worker(live_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from server.jobs.celery_app import app

    app.control.purge()
    log = tmp_path_factory.mktemp("export-worker") / "worker.log"
    proc = start_celery_worker(live_server, log)
    try:
        yield log
    finally:
        stop_process_group(proc)


def events(client: Any, headers: dict[str, str], run_id: int) -> list[dict[str, Any]]:
    data = client.get(f"/api/runs/{run_id}/events", headers=headers).json()["data"]
    return [e for e in data if e["kind"].startswith("export_")]


@pytest.mark.usefixtures("celery_worker")
def test_export_route_auth_bad_input_and_the_worker_writes_the_checkpoint(
    client: Any, people: People, model_dir: Path
) -> None:
    run = stored_run(owner_name(client, people), model_dir)
    run_id, run_dir = run["id"], Path(run["run_dir"])
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(run["spec"]))
    trained = full_checkpoint(run_dir, model_dir, 2, seed=0)
    (run_dir / "checkpoints" / "step_3" / "trainer").mkdir(parents=True)  # incomplete
    url = f"/api/runs/{run_id}/exports"

    listed = client.get(f"/api/runs/{run_id}/checkpoints", headers=people["viewer"][1])
    assert listed.status_code == 200
    assert listed.json() == {"run_id": run_id, "data": [{"step": 2, "kind": "full", "exports": []}], "count": 1}

    refused = {who: client.post(url, json={"step": 2}, headers=people[who][1]) for who in ("viewer", "other")}
    assert refused["viewer"].status_code == 403 and "viewers may only read" in refused["viewer"].json()["detail"]
    assert refused["other"].status_code == 403
    assert refused["other"].json()["detail"].endswith("only its owner or an admin may export it")
    by_token = client.post(url, json={"step": 2}, headers=run_token_headers(run_id))
    assert by_token.status_code == 403

    h = people["owner"][1]
    missing = client.post(url, json={"step": 3}, headers=h)
    assert (missing.status_code, missing.json()["detail"]) == (
        422,
        f"step: run {run_id} has no complete checkpoint at step 3 (complete steps: 2)",
    )
    adapter = client.post(url, json={"step": 2, "adapter_only": True}, headers=h)
    assert adapter.status_code == 422 and adapter.json()["detail"].startswith("adapter_only: step 2 of run")
    assert events(client, h, run_id) == []  # nothing recorded for refused requests

    accepted = client.post(url, json={"step": 2, "adapter_only": False}, headers=h)
    out = run_dir.parent / "exports" / "step_2"
    assert accepted.status_code == 202
    assert accepted.json() == {"run_id": run_id, "step": 2, "adapter_only": False, "path": str(out)}
    again = client.post(url, json={"step": 2}, headers=h)
    assert again.status_code == 409  # under way (or, if the worker was quick, already exported)

    done = wait_for(
        lambda: [e for e in events(client, h, run_id) if e["kind"] in ("export_done", "export_failed")], 120
    )
    assert [e["kind"] for e in events(client, h, run_id)] == ["export_requested", "export_started", "export_done"]
    assert done[0]["reason"] == f"exported to {out}"
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(exported), logits(trained))
    assert (logits(exported) - logits(base_model(model_dir))).abs().max().item() > 0.05
    assert sorted(p.name for p in out.parent.iterdir()) == ["step_2"]  # no staging or temporary folder left
    assert client.get(f"/api/runs/{run_id}/checkpoints", headers=h).json()["data"][0]["exports"] == [str(out)]
    assert client.post(url, json={"step": 2}, headers=h).json()["detail"] == (
        f"run {run_id}: step 2 is already exported (exports/step_2)"
    )


@pytest.mark.usefixtures("celery_worker")
def test_lora_exports_through_the_worker_merged_and_adapter_only(client: Any, people: People, model_dir: Path) -> None:
    from peft import PeftModel

    run = stored_run(owner_name(client, people), model_dir)
    run_id, run_dir = run["id"], Path(run["run_dir"])
    run_dir.mkdir(parents=True)
    peft_model = lora_checkpoint(run_dir, model_dir, 4)
    h = people["admin"][1]  # an admin exports another user's run
    assert client.get(f"/api/runs/{run_id}/checkpoints", headers=h).json()["data"][0]["kind"] == "lora"
    for adapter_only in (False, True):
        resp = client.post(f"/api/runs/{run_id}/exports", json={"step": 4, "adapter_only": adapter_only}, headers=h)
        assert resp.status_code == 202, resp.text
    wait_for(lambda: sum(e["kind"] == "export_done" for e in events(client, h, run_id)) == 2, 180, "two exports")
    home = run_dir.parent / "exports"
    merged = AutoModelForCausalLM.from_pretrained(home / "step_4").eval()
    assert torch.allclose(logits(merged), logits(peft_model), atol=1e-5, rtol=0)
    loaded = PeftModel.from_pretrained(base_model(model_dir), home / "step_4-adapter").eval()
    assert torch.equal(logits(loaded), logits(peft_model))


def test_a_failed_export_records_the_reason(
    client: Any, people: People, model_dir: Path, tmp_path: Path, queued: list[tuple[Any, ...]]
) -> None:
    """The task body run here (no worker): the base model is gone, so ``export_failed`` names the model; what a killed
    earlier delivery left is removed."""
    from server.jobs.tasks import export

    gone = tmp_path / "gone"
    shutil.copytree(model_dir, gone)
    run = stored_run(owner_name(client, people), gone)
    shutil.rmtree(gone)  # deleted after the run was submitted
    run_dir = Path(run["run_dir"])
    run_dir.mkdir(parents=True)
    full_checkpoint(run_dir, model_dir, 1, seed=0)
    stale = run_dir.parent / "exports" / ".step_1.tmp-99999"  # left by a delivery killed mid-write
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    resp = client.post(f"/api/runs/{run['id']}/exports", json={"step": 1}, headers=people["owner"][1])
    assert resp.status_code == 202
    assert export(run["id"], 1, False, queued[-1][4]).startswith(f"failed: run {run['id']} export of step 1 failed: ")
    (failed,) = [e for e in events(client, people["owner"][1], run["id"]) if e["kind"] == "export_failed"]
    assert str(gone) in failed["reason"] and "\n" not in failed["reason"]
    assert not (run_dir.parent / "exports" / "step_1").exists()
    assert list((run_dir.parent / "exports").iterdir()) == []


def test_dashboard_lists_checkpoints_with_an_export_form_for_the_owner_only(
    client: Any, people: People, model_dir: Path
) -> None:
    run = stored_run(owner_name(client, people), model_dir)
    run_dir = Path(run["run_dir"])
    run_dir.mkdir(parents=True)
    full_checkpoint(run_dir, model_dir, 5, seed=0)
    csrf = login(client, people["owner"][0])
    page = client.get(f"/runs/{run['id']}").text
    assert 'id="checkpoints"' in page and 'id="export-5"' in page
    wrong = client.post(f"/runs/{run['id']}/export", data={"csrf": csrf, "step": "6"})
    assert wrong.status_code == 422 and "no complete checkpoint at step 6 (complete steps: 5)" in wrong.text
    login(client, people["viewer"][0])
    page = client.get(f"/runs/{run['id']}").text
    assert 'id="checkpoints"' in page and 'id="export-5"' not in page
    csrf = login(client, people["other"][0])
    refused = client.post(f"/runs/{run['id']}/export", data={"csrf": csrf, "step": "5"})
    assert refused.status_code == 403 and "only its owner or an admin may export it" in refused.text
    client.cookies.clear()


def test_exports_go_to_their_own_queue() -> None:
    """A long export never holds the control-plane queue's slots (launch, stop, reconcile)."""
    from server.core.config import settings
    from server.jobs.celery_app import TaskName, app

    def queue(task: TaskName) -> str:
        return str(app.amqp.router.route({}, task.value)["queue"].name)

    assert settings.export_queue == f"{settings.CELERY_QUEUE}-exports"
    assert queue(TaskName.export_run) == settings.export_queue
    assert {queue(t) for t in TaskName if t is not TaskName.export_run} == {settings.CELERY_QUEUE}


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def export_events(run_id: int) -> list[tuple[str, str, dict[str, Any]]]:
    from sqlmodel import Session, col, select

    from server.core.db import engine
    from server.models import RunEvent

    with Session(engine) as s:
        rows = s.exec(select(RunEvent).where(RunEvent.run_id == run_id).order_by(col(RunEvent.id))).all()
        return [(r.kind, r.reason, dict(r.data)) for r in rows if r.kind.startswith("export_")]


def record_started(run_id: int, request: int, pid: int) -> None:
    """What a delivery killed mid-export (kill -9, out of memory) leaves: its ``export_started`` and nothing after."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.services import capacity, runs

    with Session(engine) as s:
        run = runs.get(s, run_id)
        worker = capacity.worker_name()
        runs.record_event(s, run, "export_started", name="step_1", step=1, request=request, pid=pid, worker=worker)
        s.commit()


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The tasks the service enqueues, kept here instead of sent (no worker takes them)."""
    from server.services import exports

    sent: list[tuple[Any, ...]] = []
    monkeypatch.setattr(exports, "enqueue", lambda task, *args: sent.append((task, *args)))
    return sent


def test_an_export_killed_in_every_delivery_fails_after_the_cap(
    client: Any, people: People, model_dir: Path, queued: list[tuple[Any, ...]]
) -> None:
    from server.core.config import settings
    from server.jobs.celery_app import TaskName
    from server.jobs.tasks import export

    run = stored_run(owner_name(client, people), model_dir)
    run_id, run_dir = run["id"], Path(run["run_dir"])
    run_dir.mkdir(parents=True)
    full_checkpoint(run_dir, model_dir, 1, seed=0)
    h = people["owner"][1]
    assert client.post(f"/api/runs/{run_id}/exports", json={"step": 1}, headers=h).status_code == 202
    ((task, *args),) = queued
    request = args[3]
    assert (task, args) == (TaskName.export_run, [run_id, 1, 0, request])
    assert settings.EXPORT_MAX_DELIVERIES == 2
    for _ in range(settings.EXPORT_MAX_DELIVERIES):
        record_started(run_id, request, os.getpid())  # alive: reconcile leaves them alone
    result = export(run_id, 1, False, request)
    assert result == (
        f"failed: run {run_id} export of step 1: its worker process died during each of its 2 deliveries (killed, "
        "e.g. out of memory: see the export worker's log; EXPORT_MAX_DELIVERIES 2); not tried again"
    )
    kinds = [k for k, _, _ in export_events(run_id)]
    assert kinds == ["export_requested", "export_started", "export_started", "export_failed"]
    assert not (run_dir.parent / "exports" / "step_1").exists()
    assert export(run_id, 1, False, request) == f"skipped: run {run_id} the request of step_1 has ended"
    assert client.post(f"/api/runs/{run_id}/exports", json={"step": 1}, headers=h).status_code == 202


def test_a_request_whose_worker_died_or_that_timed_out_is_failed_and_can_be_made_again(
    client: Any, people: People, model_dir: Path, queued: list[tuple[Any, ...]]
) -> None:
    from sqlmodel import Session

    from server.core.config import settings
    from server.core.db import engine
    from server.jobs.tasks import export, reconcile_exports
    from server.models import RunEvent

    run = stored_run(owner_name(client, people), model_dir)
    run_id, run_dir = run["id"], Path(run["run_dir"])
    run_dir.mkdir(parents=True)
    full_checkpoint(run_dir, model_dir, 1, seed=0)
    h, url = people["owner"][1], f"/api/runs/{run_id}/exports"
    assert client.post(url, json={"step": 1}, headers=h).status_code == 202
    first = queued[-1][4]
    pid = dead_pid()
    record_started(run_id, first, pid)
    assert client.post(url, json={"step": 1}, headers=h).json()["detail"] == (
        f"run {run_id}: the export exports/step_1 is under way"
    )
    assert (run_id, "step_1") in reconcile_exports()
    kind, reason, data = export_events(run_id)[-1]
    assert (kind, data["request"]) == ("export_failed", first)
    assert reason == (
        f"export of step 1 failed: its worker process {pid} is gone (killed, e.g. out of memory: see the export "
        "worker's log)"
    )
    assert (run_id, "step_1") not in reconcile_exports()  # ended: nothing more to do

    assert client.post(url, json={"step": 1}, headers=h).status_code == 202  # the step is no longer blocked
    second = queued[-1][4]
    assert export(run_id, 1, False, first) == (
        f"skipped: run {run_id} request {first} of step_1 was replaced by a newer one"
    )  # the old request's redelivery
    with Session(engine) as s:  # the second request was made long ago and no worker ever took it
        event = s.get(RunEvent, second)
        assert event is not None
        event.time = event.time - timedelta(seconds=settings.EXPORT_REQUEST_TIMEOUT_S + 60)
        s.add(event)
        s.commit()
    assert client.post(url, json={"step": 1}, headers=h).status_code == 202
    kinds = [k for k, _, _ in export_events(run_id)]
    assert kinds[-2:] == ["export_failed", "export_requested"]
    assert export_events(run_id)[-2][1] == (
        f"export of step 1 failed: not finished {settings.EXPORT_REQUEST_TIMEOUT_S:.0f} s after it was requested "
        f"(EXPORT_REQUEST_TIMEOUT_S): its task was lost or its worker is gone (is an export worker consuming queue "
        f"{settings.export_queue}?)"
    )


@pytest.mark.parametrize("link", ["exports", "exports/step_1"])
def test_a_linked_exports_folder_is_refused(
    client: Any, people: People, model_dir: Path, tmp_path: Path, queued: list[tuple[Any, ...]], link: str
) -> None:
    """The run's uid owns its home: a link planted at ``exports`` (or at the export's own name) must not steer the
    export worker's writes and deletes elsewhere; the request fails naming it, nothing is written through the link."""
    from server.jobs.tasks import export

    run = stored_run(owner_name(client, people), model_dir)
    run_id, run_dir = run["id"], Path(run["run_dir"])
    run_dir.mkdir(parents=True)
    full_checkpoint(run_dir, model_dir, 1, seed=0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".step_1.keep").mkdir()  # what a delivery's cleanup glob would match and delete
    planted = run_dir.parent / link
    planted.parent.mkdir(parents=True, exist_ok=True)
    assert client.post(f"/api/runs/{run_id}/exports", json={"step": 1}, headers=people["owner"][1]).status_code == 202
    planted.symlink_to(elsewhere)  # after the request (a link there before it reads as "already exported": 409)
    result = export(run_id, 1, False, queued[-1][4])
    assert result.startswith(f"failed: run {run_id} export of step 1: {link} in the run's home is a link"), result
    assert sorted(p.name for p in elsewhere.iterdir()) == [".step_1.keep"]
    (failed,) = [e for e in events(client, people["owner"][1], run_id) if e["kind"] == "export_failed"]
    assert failed["reason"] == "export of step 1 failed: " + result.split("export of step 1: ", 1)[1]


def test_the_task_reads_only_the_model_files_of_the_checkpoint(
    client: Any, people: People, model_dir: Path, queued: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optimizer's ``state.pt`` (twice the model in fp32) is neither copied into the staging folder nor written
    into the export; the provenance names the source relative to the run directory, not the staging folder."""
    import worker.policy.export
    from server.jobs.tasks import export

    run = stored_run(owner_name(client, people), model_dir)
    run_id, run_dir = run["id"], Path(run["run_dir"])
    run_dir.mkdir(parents=True)
    full_checkpoint(run_dir, model_dir, 1, seed=0)
    (run_dir / "checkpoints" / "step_1" / "trainer" / "state.pt").write_bytes(b"optimizer state")
    read: list[set[str]] = []
    real = worker.policy.export.write_export

    def write_export(source: Any, out: Path, **kw: Any) -> Path:
        read.append({p.name for p in source.path.iterdir()})
        return real(source, out, **kw)

    monkeypatch.setattr(worker.policy.export, "write_export", write_export)
    assert client.post(f"/api/runs/{run_id}/exports", json={"step": 1}, headers=people["owner"][1]).status_code == 202
    out = run_dir.parent / "exports" / "step_1"
    assert export(run_id, 1, False, queued[-1][4]) == f"exported: run {run_id} step 1 to {out}"
    assert read == [{"model.safetensors"}]
    assert "state.pt" not in {p.name for p in out.iterdir()}
    provenance = json.loads((out / "provenance.json").read_text())
    assert (provenance["source"], provenance["run_dir"]) == ("checkpoints/step_1/trainer", str(run_dir))
