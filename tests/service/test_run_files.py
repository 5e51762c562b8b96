"""A run's processes own their run directory: every route, dashboard part and task that reads a run's files reads
only regular files inside it, never through a symbolic link (``worker.run.run_files``), and a refusal is a one-line 4xx
without server paths. Bad rollout records are skipped and counted, never a 5xx."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import run_token_headers
from worker.run.checkpoint import write_part
from worker.run.rundir import RunDir

SECRET = "TOP-SECRET-" + secrets.token_hex(8)


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """A file outside every run directory, standing for the server's ``secret_key``."""
    path = tmp_path / "secret_key"
    path.write_text(SECRET + "\n")
    return path


def no_server_path(text: str) -> None:
    from server.core.config import settings

    assert str(settings.ASYNCRL_OUTPUT_DIR) not in text and "/tmp" not in text and SECRET not in text, text


def test_log_reached_through_a_symbolic_link_is_refused_for_every_process(
    client: Any, auth: dict[str, str], make_run: Any, secret_file: Path
) -> None:
    run = make_run()
    rd = RunDir(run["run_dir"])
    rd.logs.mkdir(parents=True)
    (rd.logs / "trainer.log").symlink_to(secret_file)
    (rd.logs / "orchestrator.log").symlink_to("../../../../../" + str(secret_file))  # relative link
    os.mkfifo(rd.logs / "inference.log")  # a FIFO would hang a reader
    (Path(run["run_dir"]).parent / "supervisor.log").symlink_to(secret_file)
    url = f"/api/runs/{run['id']}/logs"
    answers = {
        p: client.get(url, params={"process": p}, headers=auth) for p in ("trainer", "orchestrator", "supervisor")
    }
    for resp in answers.values():
        assert resp.status_code == 403, resp.text
        no_server_path(resp.text)
    name = run["name"]
    assert answers["trainer"].json()["detail"] == (
        f"process: run {run['id']}'s trainer log is refused: {name}/logs/trainer.log: is a symbolic link; "
        "run files are read only as regular files"
    )
    assert (
        answers["supervisor"]
        .json()["detail"]
        .endswith("supervisor.log: is a symbolic link; run files are read only as regular files")
    )
    fifo = client.get(url, params={"process": "inference"}, headers=auth)
    assert fifo.status_code == 403 and fifo.json()["detail"].endswith(
        f"{name}/logs/inference.log: is not a regular file"
    )
    # the run's own token gets the same answer
    assert client.get(url, headers=run_token_headers(run["id"])).status_code == 403


def test_a_symbolic_link_in_a_parent_folder_is_refused(
    client: Any, auth: dict[str, str], make_run: Any, secret_file: Path
) -> None:
    run = make_run()
    rd = RunDir(run["run_dir"])
    rd.root.mkdir(parents=True)
    outside = secret_file.parent / "logs"
    outside.mkdir()
    (outside / "trainer.log").write_text(SECRET)
    rd.logs.symlink_to(outside)  # logs/ -> a folder elsewhere: the file in it is regular, the way is not
    resp = client.get(f"/api/runs/{run['id']}/logs", headers=auth)
    assert resp.status_code == 403 and resp.json()["detail"] == (
        f"process: run {run['id']}'s trainer log is refused: {run['name']}/logs: is a symbolic link; "
        "run files are read only as regular files"
    )
    rd.logs.unlink()
    rd.root.rename(rd.root.with_name("elsewhere"))
    rd.root.symlink_to(rd.root.with_name("elsewhere"))  # the run directory itself replaced by a link
    (rd.root.with_name("elsewhere") / "logs").mkdir()
    (rd.root.with_name("elsewhere") / "logs" / "trainer.log").write_text(SECRET)
    resp = client.get(f"/api/runs/{run['id']}/logs", headers=auth)
    assert resp.status_code == 403 and f"{run['name']}: is a symbolic link" in resp.json()["detail"]
    no_server_path(resp.text)


def test_missing_log_404_names_no_server_path(client: Any, auth: dict[str, str], make_run: Any) -> None:
    run = make_run()
    resp = client.get(f"/api/runs/{run['id']}/logs", params={"process": "orchestrator"}, headers=auth)
    assert resp.status_code == 404
    assert resp.json()["detail"] == f"process: run {run['id']} has no orchestrator log yet"


def test_rollouts_through_a_symbolic_link_are_refused(
    web: tuple[Any, str], make_run: Any, auth: dict[str, str], secret_file: Path
) -> None:
    client, _ = web
    run = make_run()
    rd = RunDir(run["run_dir"])
    rd.rollouts.mkdir(parents=True)
    secret_file.write_text(json.dumps({"advantage": 1.0, "completion": SECRET}) + "\n")
    rd.rollout_file(3).symlink_to(secret_file)
    resp = client.get(f"/api/runs/{run['id']}/rollouts", params={"step": 3}, headers=auth)
    assert resp.status_code == 403 and resp.json()["detail"] == (
        f"step: run {run['id']}'s rollouts are refused: {run['name']}/rollouts/step_3.jsonl: is a symbolic link; "
        "run files are read only as regular files"
    )
    # the newest-step listing leaves the link out: nothing to show, nothing read
    newest = client.get(f"/api/runs/{run['id']}/rollouts", headers=auth)
    assert newest.status_code == 200 and newest.json() == {
        "run_id": run["id"],
        "step": None,
        "data": [],
        "total": 0,
        "offset": 0,
        "skipped": 0,
    }
    page = client.get(f"/runs/{run['id']}", params={"part": "rollouts"})
    assert page.status_code == 200 and SECRET not in page.text and "No rollouts yet" in page.text
    # the rollouts folder itself a link: 403 on the API, a one-line reason on the page
    rd.rollout_file(3).unlink()
    rd.rollouts.rmdir()
    rd.rollouts.symlink_to(secret_file.parent)
    (secret_file.parent / "step_4.jsonl").write_text(json.dumps({"advantage": 1.0, "completion": SECRET}) + "\n")
    resp = client.get(f"/api/runs/{run['id']}/rollouts", headers=auth)
    assert resp.status_code == 403 and resp.json()["detail"].endswith(
        f"{run['name']}/rollouts: is a symbolic link; run files are read only as regular files"
    )
    page = client.get(f"/runs/{run['id']}", params={"part": "rollouts"})
    assert page.status_code == 200 and SECRET not in page.text
    assert f"rollouts refused: {run['name']}/rollouts: is a symbolic link" in page.text
    full = client.get(f"/runs/{run['id']}")
    assert full.status_code == 200 and SECRET not in full.text


def test_run_page_logs_through_a_symbolic_link_show_the_reason(
    web: tuple[Any, str], make_run: Any, secret_file: Path
) -> None:
    client, _ = web
    run = make_run()
    rd = RunDir(run["run_dir"])
    rd.logs.mkdir(parents=True)
    (rd.logs / "trainer.log").symlink_to(secret_file)
    for params in ({"part": "logs", "process": "trainer"}, {}):
        page = client.get(f"/runs/{run['id']}", params=params)
        assert page.status_code == 200 and SECRET not in page.text
        assert f"trainer log refused: {run['name']}/logs/trainer.log: is a symbolic link" in page.text


def test_bad_rollout_records_are_skipped_and_counted(web: tuple[Any, str], make_run: Any, auth: dict[str, str]) -> None:
    client, _ = web
    run = make_run()
    rd = RunDir(run["run_dir"])
    rd.rollouts.mkdir(parents=True)
    good = {"task": "t", "completion": "c", "reward": 0.5, "advantage": 0.25}
    lines: list[str | bytes] = [
        json.dumps(good),
        "not json {",
        json.dumps({"task": "t", "completion": "no advantage", "reward": 1.0}),
        json.dumps([1, 2, 3]),
        json.dumps({**good, "advantage": "high"}),
        json.dumps({**good, "reward": "high", "completion": "bad reward"}),  # shown; the reward cell says —
        b"\xff\xfe not UTF-8",
        json.dumps({**good, "completion": "last"}),
    ]
    raw = [x if isinstance(x, bytes) else x.encode() for x in lines]
    rd.rollout_file(5).write_bytes(b"\n".join(raw) + b'\n{"torn": ')
    resp = client.get(f"/api/runs/{run['id']}/rollouts", headers=auth)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["step"] == 5 and body["skipped"] == 6
    assert [r["completion"] for r in body["data"]] == ["c", "bad reward", "last"]
    limited = client.get(f"/api/runs/{run['id']}/rollouts", params={"limit": 2}, headers=auth).json()
    # the whole file is read for the total: every bad line counts, whatever the page
    assert [r["completion"] for r in limited["data"]] == ["c", "bad reward"] and limited["skipped"] == 6
    assert limited["total"] == 3 and [r["id"] for r in limited["data"]] == [f"{run['id']}-5-0", f"{run['id']}-5-5"]
    page = client.get(f"/runs/{run['id']}", params={"part": "rollouts"})
    assert page.status_code == 200, page.text
    assert "Step 5 (first 3; 6 bad lines skipped)" in page.text
    assert '<td class="num">—</td><td class="num">0.250</td>' in page.text
    assert client.get(f"/runs/{run['id']}").status_code == 200


def checkpoint(run: dict[str, Any], step: int) -> None:
    rd = RunDir(run["run_dir"])
    rd.create()
    for part in ("trainer", "orchestrator"):
        write_part(rd, step, part, lambda d, p=part: (d / "state.bin").write_bytes(f"{p}-{step}".encode()))


def test_fork_copies_no_symbolic_link_of_a_checkpoint(
    client: Any, auth: dict[str, str], make_run: Any, secret_file: Path
) -> None:
    parent = make_run(max_steps=8)
    checkpoint(parent, 2)
    part = RunDir(parent["run_dir"]).checkpoint_dir(2) / "trainer"
    (part / "state.bin").unlink()
    (part / "state.bin").symlink_to(secret_file)
    before = client.get("/api/runs", params={"limit": 1}, headers=auth).json()["count"]
    resp = client.post(f"/api/runs/{parent['id']}/fork", json={"step": 2}, headers=auth)
    assert resp.status_code == 409 and resp.json()["detail"] == (
        f"run {parent['id']}: checkpoint step 2 cannot be copied: {parent['name']}/checkpoints/step_2/trainer/state.bin: "
        "is a symbolic link; run files are read only as regular files"
    )
    assert client.get("/api/runs", params={"limit": 1}, headers=auth).json()["count"] == before  # nothing stored
    runs_dir = Path(parent["run_dir"]).parent.parent
    assert not any(
        SECRET in p.read_text(errors="replace")
        for p in runs_dir.rglob("state.bin")
        if p.is_file() and not p.is_symlink()
    )


def test_checkpoints_reached_through_links_do_not_count(
    client: Any, auth: dict[str, str], make_run: Any, tmp_path: Path
) -> None:
    from sqlmodel import Session

    from server.core.db import engine
    from server.services import runs

    run, donor = make_run(max_steps=8), make_run(max_steps=8)
    checkpoint(run, 2)
    checkpoint(donor, 6)
    checkpoint(donor, 7)
    cps = RunDir(run["run_dir"]).checkpoints
    (cps / "step_6").symlink_to(RunDir(donor["run_dir"]).checkpoint_dir(6))  # a step folder that is a link
    (cps / "step_7").mkdir()
    for part in ("trainer", "orchestrator"):  # real folders whose markers are links
        (cps / "step_7" / part).mkdir()
        (cps / "step_7" / part / ".complete").symlink_to(
            RunDir(donor["run_dir"]).checkpoint_dir(7) / part / ".complete"
        )
    with Session(engine) as s:
        assert runs.checkpoint_steps(runs.get(s, run["id"])) == [2]
        assert runs.checkpoint_steps(runs.get(s, donor["id"])) == [6, 7]
    # the whole checkpoints folder a link: resume/fork say why, 409, with no server path
    moved = tmp_path / "cps"
    cps.rename(moved)
    cps.symlink_to(moved)
    resp = client.post(f"/api/runs/{run['id']}/fork", json={}, headers=auth)
    assert resp.status_code == 409 and resp.json()["detail"] == (
        f"run {run['id']}: its checkpoints are refused: {run['name']}/checkpoints: is a symbolic link; "
        "run files are read only as regular files"
    )
    cps.unlink()
    resp = client.post(f"/api/runs/{run['id']}/fork", json={}, headers=auth)
    assert (
        resp.status_code == 409
        and resp.json()["detail"] == f"run {run['id']}: no complete checkpoint in {run['name']}/checkpoints"
    )


def test_reconcile_reason_reads_no_linked_file(
    client: Any, auth: dict[str, str], make_run: Any, secret_file: Path
) -> None:
    import subprocess

    from sqlmodel import Session

    from server.core.db import engine
    from server.jobs.tasks import reconcile
    from server.models import RunStatus
    from server.services import runs

    proc = subprocess.Popen(["sleep", "60"])
    proc.kill()
    proc.wait()
    run = make_run()
    with Session(engine) as s:
        row = runs.get(s, run["id"], lock=True)
        row.launcher, row.launcher_handle = "local", str(proc.pid)
        for to in ("starting", "running"):
            runs.transition(s, row, RunStatus(to), reason="test")
        s.commit()
    rd = RunDir(run["run_dir"])
    rd.root.mkdir(parents=True)
    (rd.root / "events.jsonl").symlink_to(secret_file)
    (rd.root.parent / "supervisor.log").symlink_to(secret_file)
    assert run["id"] in reconcile()
    reason = client.get(f"/api/runs/{run['id']}", headers=auth).json()["status_reason"]
    assert reason == f"supervisor {proc.pid} is gone" and SECRET not in reason
