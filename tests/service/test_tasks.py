"""Launch and stop: the plain functions, then the Celery tasks through a real worker on the real Redis.

Runs here name a model path that does not exist, so each launched supervisor fails in preflight within a
second or two and reports ``failed`` over HTTP with its run token — the whole path without a model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import spec, start_celery_worker, stop_process_group, wait_for
from worker.run.procs import alive


def status_events(client: Any, auth: dict[str, str], run_id: int) -> list[tuple[str | None, str | None]]:
    data = client.get(f"/api/runs/{run_id}/events", headers=auth).json()["data"]
    return [(e["from_status"], e["to_status"]) for e in data if e["kind"] == "status"]


def run_of(client: Any, auth: dict[str, str], run_id: int) -> dict[str, Any]:
    return dict(client.get(f"/api/runs/{run_id}", headers=auth).json())


def queued_run() -> dict[str, Any]:
    """A queued run added through the service, with no launch enqueued."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.models import RunPublic
    from server.services import runs

    with Session(engine) as s:
        run = runs.create(s, data=spec(), owner="test")
        s.commit()
        return RunPublic.model_validate(run).model_dump()


@pytest.fixture
def server_url(live_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    from server.core.config import settings

    monkeypatch.setattr(settings, "ASYNCRL_SERVER_URL", live_server)
    return live_server


def fake_supervisor(home: Path) -> subprocess.Popen[bytes]:
    """A process that holds the supervisor lock like a real one (as if a killed delivery had started it)."""
    home.mkdir(parents=True, exist_ok=True)
    code = (
        "import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
        "f.truncate(0); f.write(str(os.getpid())); f.flush(); print('locked', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(home / "supervisor.lock")], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"locked\n"
    return proc


@pytest.mark.usefixtures("server_url")
def test_launch_twice_launches_once_and_the_supervisor_reports_failure(
    client: Any, auth: dict[str, str], make_run: Any
) -> None:
    from server.jobs.tasks import launch

    run_id = make_run()["id"]
    first, second = launch(run_id), launch(run_id)
    assert first.startswith(f"launched: run {run_id} pid") and second.startswith("skipped"), (first, second)
    run = wait_for(lambda: (r := run_of(client, auth, run_id))["status"] == "failed" and r, 60, "run failed")
    assert run["launcher"] == "local" and run["launcher_handle"] == first.rsplit(" ", 1)[1]
    assert run["status_reason"].startswith("preflight: model.name: /nonexistent/asyncrl-test-model")
    assert status_events(client, auth, run_id) == [(None, "queued"), ("queued", "starting"), ("starting", "failed")]
    assert launch(run_id).startswith("skipped")


@pytest.mark.usefixtures("server_url")
def test_launch_adopts_a_supervisor_left_by_a_killed_delivery(client: Any, auth: dict[str, str], make_run: Any) -> None:
    from server.jobs.tasks import launch, stop
    from worker.launchers import supervisor

    run = make_run()
    proc = fake_supervisor(Path(run["run_dir"]).parent)
    try:
        result = launch(run["id"])
        assert result == f"adopted: run {run['id']} pid {proc.pid}"
        assert not (Path(run["run_dir"]).parent / "supervisor.log").exists()  # nothing new was started
        assert stop(run["id"], grace_s=5) == f"stopped: run {run['id']}"
        assert proc.wait(timeout=10) != 0 and supervisor.running_pid(Path(run["run_dir"]).parent) is None
    finally:
        proc.kill()
    assert status_events(client, auth, run["id"])[-2:] == [("queued", "starting"), ("starting", "cancelled")]


def test_launch_of_a_run_that_is_not_queued_returns_at_once(client: Any, auth: dict[str, str], make_run: Any) -> None:
    from server.jobs.tasks import launch

    run_id = make_run()["id"]
    client.post(f"/api/runs/{run_id}/stop", headers=auth)
    assert launch(run_id) == f"skipped: run {run_id} is cancelled (handle None)"
    assert launch(999999) == "skipped: run 999999 does not exist"


def test_launch_with_an_unusable_run_user_fails_the_run_and_starts_nothing(
    client: Any, auth: dict[str, str], make_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.core.config import settings
    from server.jobs.tasks import launch
    from worker.launchers import supervisor

    monkeypatch.setattr(settings, "RUN_USER", "no-such-user-x")
    run = make_run()
    reason = "launch: RUN_USER: no user 'no-such-user-x' on this worker"
    assert launch(run["id"]) == f"failed: run {run['id']}: {reason}"
    done = run_of(client, auth, run["id"])
    assert (done["status"], done["status_reason"], done["launcher_handle"]) == ("failed", reason, None)
    assert supervisor.running_pid(Path(run["run_dir"]).parent) is None
    assert status_events(client, auth, run["id"]) == [(None, "queued"), ("queued", "failed")]


@pytest.mark.usefixtures("server_url")
def test_a_launch_copies_what_the_run_starts_from_in_another_runs_folder_into_its_own(
    client: Any, auth: dict[str, str], make_run: Any
) -> None:
    """Run B's model is run A's ``final/``: B's launch copies it into B's home (``worker.run.inputs``) and B's
    supervisor gets that path; B's stored spec keeps A's. Run C's copy meets a link planted in A's folder: C fails at
    launch naming the key, and nothing of it starts."""
    from server.jobs.tasks import launch
    from worker.run.rundir import SupervisorHome

    final = Path(make_run()["run_dir"]) / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text('{"model_type": "qwen3"}')
    b, c = make_run(model={"name": str(final)}), make_run(model={"name": str(final)})
    assert launch(b["id"]).startswith(f"launched: run {b['id']} pid")
    home = Path(b["run_dir"]).parent
    copy = home / "inputs" / "model.name" / "final"
    assert json.loads(SupervisorHome(home).spec.read_text())["model"]["name"] == str(copy)
    assert (copy / "config.json").read_text() == '{"model_type": "qwen3"}'
    assert run_of(client, auth, b["id"])["spec"]["model"]["name"] == str(final)
    wait_for(lambda: run_of(client, auth, b["id"])["status"] == "failed", 60, "run B failed")  # no weights: preflight

    (final / "tokenizer.json").symlink_to("config.json")  # inside MODEL_ROOTS, so spec_policy lets it by
    reason = (
        f"launch: model.name: {final} (run {Path(final).parents[1].name}'s {final.parent.name}/final) cannot be copied "
        f"into the run's folder: {final.parent.name}/final/tokenizer.json: is a symbolic link; run files are read "
        "only as regular files"
    )
    assert launch(c["id"]) == f"failed: run {c['id']}: {reason}"
    assert run_of(client, auth, c["id"])["status_reason"] == reason
    assert not (Path(c["run_dir"]).parent / "spec.json").exists()


@pytest.mark.slurm
def test_a_slurm_launch_with_an_unusable_run_user_fails_the_run_and_submits_nothing(
    client: Any, auth: dict[str, str], make_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run user of a Slurm run is checked on the worker before ``sbatch``, as for a local run: no job is queued."""
    from server.core.config import settings
    from server.jobs.tasks import launch
    from worker.launchers import slurm

    monkeypatch.setattr(settings, "RUN_USER", "no-such-user-x")
    run = make_run(launcher={"kind": "slurm"})
    reason = "launch: RUN_USER: no user 'no-such-user-x' on this worker"
    assert launch(run["id"]) == f"failed: run {run['id']}: {reason}"
    done = run_of(client, auth, run["id"])
    assert (done["status"], done["status_reason"], done["launcher_handle"]) == ("failed", reason, None)
    assert slurm.find(run["id"], Path(run["run_dir"]).parent) is None
    assert not (Path(run["run_dir"]).parent / "job.sbatch").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="a root worker's default")
def test_a_root_worker_refuses_a_run_its_uid_cannot_start_and_never_runs_it_as_root(
    client: Any, auth: dict[str, str], make_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither RUN_USER nor RUN_UID_BASE, and a worker Python the run's default uid cannot run (a copy in a 0700
    folder): the launch fails the run with one line saying why and how to fix it; nothing is started, as root or
    anyone else."""
    import shutil
    import tempfile

    from server.core.config import settings
    from server.jobs.tasks import launch
    from worker.launchers import supervisor

    monkeypatch.setattr(settings, "RUN_USER", "")
    monkeypatch.setattr(settings, "RUN_UID_BASE", 0)
    folder = Path(tempfile.mkdtemp(prefix="asyncrl-private-python-"))
    try:
        python = folder / "python"
        shutil.copy2(os.path.realpath(sys.executable), python)
        monkeypatch.setattr(sys, "executable", str(python))
        run = make_run()
        uid = supervisor.DEFAULT_RUN_UID_BASE + run["id"]
        reason = (
            f"launch: the run user asyncrl-run-{run['id']} (uid {uid}) cannot run this worker's Python {python} "
            f"(Permission denied): make it usable by other users (e.g. `chmod o+x {folder}`; scripts/setup.sh does) "
            "or set RUN_USER to an account that can"
        )
        assert launch(run["id"]) == f"failed: run {run['id']}: {reason}"
    finally:
        shutil.rmtree(folder)
    done = run_of(client, auth, run["id"])
    assert (done["status"], done["status_reason"], done["launcher_handle"]) == ("failed", reason, None)
    assert supervisor.running_pid(Path(run["run_dir"]).parent) is None
    assert status_events(client, auth, run["id"]) == [(None, "queued"), ("queued", "failed")]


# ----------------------------------------------------------------------------- a real Celery worker


@pytest.fixture(scope="module")
def celery_worker_proc(live_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from server.jobs.celery_app import app

    app.control.purge()  # launches queued by earlier tests in this session
    log = tmp_path_factory.mktemp("celery") / "worker.log"
    proc = start_celery_worker(live_server, log)
    try:
        yield log
    finally:
        stop_process_group(proc)


def test_worker_delivers_launch_twice_one_launch(
    client: Any, auth: dict[str, str], make_run: Any, celery_worker_proc: Path
) -> None:
    from server.jobs.tasks import launch_run

    run = make_run()  # the API enqueued the first launch after its commit
    launch_run.delay(run["id"])  # a second delivery of the same launch
    done = wait_for(lambda: (r := run_of(client, auth, run["id"]))["status"] == "failed" and r, 60, "run failed")
    assert done["status_reason"].startswith("preflight: model.name")
    results = (f"'launched: run {run['id']} ", f"'skipped: run {run['id']} ")
    wait_for(lambda: sum(celery_worker_proc.read_text().count(r) for r in results) >= 2, 30, "both deliveries")
    log = celery_worker_proc.read_text()
    assert log.count(f"'launched: run {run['id']} pid") == 1  # celery's "succeeded in ...: '<result>'" lines
    assert log.count(f"'skipped: run {run['id']} is") == 1
    assert status_events(client, auth, run["id"]) == [(None, "queued"), ("queued", "starting"), ("starting", "failed")]
    assert (Path(run["run_dir"]).parent / "supervisor.log").read_text().count("ended failed") == 1


def test_worker_stops_a_launched_run(client: Any, auth: dict[str, str], celery_worker_proc: Path) -> None:
    run = queued_run()  # not enqueued: launched by hand below, with a stand-in supervisor that stays up
    proc = fake_supervisor(Path(run["run_dir"]).parent)
    try:
        from server.jobs.tasks import launch

        assert launch(run["id"]).startswith("adopted")
        resp = client.post(f"/api/runs/{run['id']}/stop", headers=auth)
        assert resp.status_code == 200 and resp.json()["status"] == "starting"
        wait_for(lambda: run_of(client, auth, run["id"])["status"] == "cancelled", 60, "run cancelled")
        assert proc.wait(timeout=10) != 0
    finally:
        proc.kill()
    kinds = [e["kind"] for e in client.get(f"/api/runs/{run['id']}/events", headers=auth).json()["data"]]
    assert kinds == ["status", "status", "stop_requested", "status"]
    assert celery_worker_proc.read_text().count(f"'stopped: run {run['id']}'") == 1


def _children(pid: int) -> dict[int, str]:
    """Live child processes of ``pid``: child pid -> process title (Celery renames its processes)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == pid and stat[0] not in {"Z", "X"}:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return found


def test_kill_9_of_the_worker_takes_its_embedded_beat_and_pool_along(tmp_path: Path) -> None:
    """`asyncrl worker` forks a beat (-B) and pool processes; after kill -9 of the worker none of them is left
    (an orphaned beat beside a restarted worker would send every periodic task twice)."""
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "asyncrl"), "worker", "--concurrency", "2"],
            env={**os.environ, "ASYNCRL_HOME": str(tmp_path), "CELERY_QUEUE": f"beat-{os.getpid()}"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        kids = wait_for(
            lambda: (
                (k := _children(proc.pid))
                and any("beat" in t for t in k.values())
                and sum("ForkPoolWorker" in t for t in k.values()) == 2
                and k
            ),
            60,
            "beat and 2 pool workers",
        )
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: not any(alive(p) for p in kids), 20, "beat and pool workers gone")
    finally:
        if alive(proc.pid):
            os.killpg(proc.pid, 9)
