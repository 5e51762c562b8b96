"""Least privilege by default (issue 32): a root ``asyncrl server`` + ``asyncrl worker`` in embedded mode (SQLite, file
broker, generated secret key file), with neither ``RUN_USER`` nor ``RUN_UID_BASE`` set, runs a submitted run (an SFT
job on the tiny random-init Qwen3: the supervisor and the SFT trainer) as the run's own uid,
``worker.launchers.supervisor.DEFAULT_RUN_UID_BASE + run id``; that uid gets ``PermissionError`` reading the server's
secret key file, its SQLite database (and ``-wal``/``-shm``), listing ``ASYNCRL_HOME`` or its broker folder, while it
reads its own run's files.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server import wait_for
from tests.support.uids import PROBE, output_as, uid_of
from worker.demo import TERMINAL, embedded_service
from worker.launchers import supervisor
from worker.run.procs import session_members
from worker.spec import load_spec_data

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="a root worker's default")]

REPO = Path(__file__).resolve().parents[2]


def test_a_root_workers_run_runs_as_its_own_uid_which_cannot_read_the_servers_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.policy.models import init_model

    for name in ("SECRET_KEY", "RUN_USER", "RUN_UID_BASE"):  # the defaults: a generated secret key file
        monkeypatch.delenv(name, raising=False)
    state = tmp_path / "home"
    model = init_model(state / "outputs" / "models" / "tiny", size="tiny", seed=0)
    overrides = {
        "name": "uid-sft",
        "model.name": str(model),
        "max_steps": "12",
        "data.num_examples": "64",
        "data.batch_size": "4",
        "scheduler.warmup_steps": "1",
        "threads": "1",
    }
    spec = load_spec_data([REPO / "configs/reverse_text/sft.toml"], list(overrides.items()))
    with (
        embedded_service(state) as service,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}) as client,
    ):
        resp = client.post("/api/runs", json=spec)
        assert resp.status_code == 201, resp.text
        run = resp.json()
        uid = supervisor.DEFAULT_RUN_UID_BASE + run["id"]
        sid = int(wait_for(lambda: client.get(f"/api/runs/{run['id']}").json()["launcher_handle"], 60, "launch"))
        seen: dict[int, int | None] = {}  # pid -> uid of every process of the run's session seen while it ran
        deadline = time.monotonic() + 600
        while (now := client.get(f"/api/runs/{run['id']}").json())["status"] not in TERMINAL:
            assert time.monotonic() < deadline, "the run did not end within 600 s"
            for pid in session_members(sid) - set(seen):
                seen[pid] = uid_of(pid)
            time.sleep(0.05)
        assert now["status"] == "completed", now["status_reason"]
        home = Path(now["run_dir"]).parent
        files = [
            state / "secret_key",
            state / "asyncrl.db",
            state / "asyncrl.db-wal",
            state / "asyncrl.db-shm",
            state,
            state / "broker",
            home / "spec.json",
            Path(now["run_dir"]) / "metrics.jsonl",
        ]
        probe = output_as([sys.executable, "-c", PROBE, *map(str, files)], uid, uid)
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files[:5]}
    assert sid in seen and len(seen) >= 2, seen  # the supervisor and the SFT trainer (at least)
    assert set(seen.values()) - {None} == {uid}, seen
    assert (Path(now["run_dir"]) / "metrics.jsonl").stat().st_uid == uid
    assert probe == [
        *(f"denied {p}" for p in files[:6]),
        *(f"read {p}" for p in files[6:]),
    ]
    assert modes == {
        "secret_key": "0o600",
        "asyncrl.db": "0o600",
        "asyncrl.db-wal": "0o600",
        "asyncrl.db-shm": "0o600",
        "home": "0o711",  # ASYNCRL_OUTPUT_DIR (the runs' homes) is inside it: runs pass through, cannot list it
    }
    print(f"run {run['id']}: {len(seen)} processes, all uid {uid}; {probe!r}")
