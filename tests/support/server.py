"""Shared setup of the control-plane tests against the real Postgres and Redis.

One database ``asyncrl_test_<random>`` per test session (created, migrated with ``alembic upgrade head``,
dropped at the end) and one Celery queue ``asyncrl-test-<random>`` on the real Redis (deleted at the end).
The settings are read from the environment at import, so the variables are set here, before any
``server`` module is imported: ``tests/conftest.py`` imports this module first. Nothing else on the Postgres
server or in Redis is touched.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg

from worker.run.procs import live_processes

SUFFIX = secrets.token_hex(4)
PG = os.environ.get("ASYNCRL_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432")
REDIS = os.environ.get("ASYNCRL_TEST_REDIS", "redis://127.0.0.1:6379/0")
DB_NAME = f"asyncrl_test_{SUFFIX}"
STATE = Path(tempfile.mkdtemp(prefix=f"asyncrl-test-{SUFFIX}-"))
if os.geteuid() == 0:
    STATE.chmod(0o711)  # the runs of a root worker run as other uids: they enter ASYNCRL_OUTPUT_DIR (not ASYNCRL_HOME)
os.environ.update(
    {
        "DATABASE_URL": f"{PG.replace('postgresql://', 'postgresql+psycopg://')}/{DB_NAME}",
        "CELERY_BROKER_URL": REDIS,
        "CELERY_QUEUE": f"asyncrl-test-{SUFFIX}",
        "SECRET_KEY": secrets.token_hex(16),
        "ASYNCRL_HOME": str(STATE / "home"),
        "ASYNCRL_OUTPUT_DIR": str(STATE / "outputs"),
        "MAX_BODY_BYTES": str(256 * 1024),
        "MAX_METRIC_POINTS": "2000",
        "MAX_RUNS_PER_USER": "1000",  # tests/service/test_limits.py lowers them to see runs wait
        "MAX_RUNS_PER_WORKER": "1000",
        "WEBHOOK_ALLOW_PRIVATE": "true",  # the test receivers listen on loopback; test_attacks.py turns it off
        "MODEL_ROOTS": f"/nonexistent,{tempfile.gettempdir()}",  # BAD_MODEL and the models tests make in tmp dirs
    }
)

BAD_MODEL = "/nonexistent/asyncrl-test-model"
"""Specs in these tests name a model path that does not exist: a launched run fails in preflight at once."""


SFT_ROW = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}
"""A well-formed SFT row (a user and an assistant turn)."""


def sft_data(name: str = "train.jsonl", rows: list[Any] | None = None) -> str:
    """An SFT data file under ``ASYNCRL_OUTPUT_DIR/data`` (a ``DATA_ROOTS`` folder the server sees, so the submit
    reads it: ``server.services.launch_checks``) with ``rows`` (two :data:`SFT_ROW` by default); its path."""
    path = Path(os.environ["ASYNCRL_OUTPUT_DIR"]) / "data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in ([SFT_ROW, SFT_ROW] if rows is None else rows)))
    return str(path)


def pg_admin(sql: str) -> None:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(sql)


def drop_queue() -> None:
    """Delete this session's Celery queue keys from Redis."""
    import redis

    r = redis.Redis.from_url(REDIS)
    for key in r.scan_iter(f"*asyncrl-test-{SUFFIX}*"):
        r.delete(key)


def migrate(url: str, revision: str = "head", down: bool = False) -> None:
    from alembic import command
    from alembic.config import Config

    from server.core.db import make_engine

    cfg = Config(str(Path(__file__).parents[2] / "alembic.ini"))
    cfg.attributes["configure_logger"] = False
    eng = make_engine(url)
    with eng.begin() as conn:
        cfg.attributes["connection"] = conn
        (command.downgrade if down else command.upgrade)(cfg, revision)
    eng.dispose()


def fresh_database(*, remove_state: bool) -> Iterator[str]:
    """Body of the ``database`` fixture (``tests/conftest.py``, one a pytest process): create and migrate the test
    database, yield its URL, then drop it and the test queue (and, with ``remove_state``, the state dir)."""
    pg_admin(f'CREATE DATABASE "{DB_NAME}"')
    try:
        migrate(os.environ["DATABASE_URL"])
        yield os.environ["DATABASE_URL"]
    finally:
        from server.core.db import engine

        engine.dispose()
        pg_admin(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')
        drop_queue()
        if remove_state:
            shutil.rmtree(STATE, ignore_errors=True)


def new_token(name: str, scope: str = "write", role: str = "admin") -> str:
    """A new token of the user ``name`` (created with ``role`` if new: ``admin`` by default, so that tests about
    something else may act on each other's runs; the permission tests pass ``member`` or ``viewer``)."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.services import tokens

    with Session(engine) as s:
        _, plain = tokens.create(s, name=name, scope=scope, role=role)
        s.commit()
    return plain


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": f"t-{secrets.token_hex(3)}", "max_steps": 3, "model": {"name": BAD_MODEL}}
    base.update(overrides)
    return base


def run_token_headers(run_id: int) -> dict[str, str]:
    return {"Authorization": f"Bearer {run_token_of(run_id)}"}


def run_token_of(run_id: int) -> str:
    """The run token of the stored run ``run_id`` (``server.services.tokens.run_token``); for a run that does not
    exist (deleted meanwhile, e.g. by the fuzzer) a well-formed token the server refuses with 401."""
    from sqlmodel import Session

    from server.core.db import engine
    from server.services import runs, tokens

    with Session(engine) as s:
        try:
            return tokens.run_token(runs.get(s, run_id))
        except runs.RunNotFound:
            return f"asr_run_{run_id}_{'0' * 64}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)


def stored(run_id: int) -> int:
    from sqlalchemy import func
    from sqlmodel import Session, select

    from server.core.db import engine
    from server.models import Metric

    with Session(engine) as s:
        return int(s.exec(select(func.count()).select_from(Metric).where(Metric.run_id == run_id)).one())


def points(n: int, name: str = "loss", source: str = "trainer", start: int = 0) -> list[dict[str, Any]]:
    """Metric points ``start .. n-1`` of one series as the ingest API takes them (value = step / 10)."""
    return [{"source": source, "step": s, "name": name, "value": s / 10, "time": 1e9 + s} for s in range(start, n)]


# ----------------------------------------------------------------------------- real processes (e2e/service)


def _ready(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


class ApiServer:
    """``asyncrl server --no-migrate`` (the test database is migrated already) as a child process in its own
    process group on a fixed port of ``host`` (default 127.0.0.1), so it can be killed and restarted at the same
    URL."""

    def __init__(self, log: Path, host: str = "127.0.0.1") -> None:
        self.port, self.log, self.host = free_port(), log, host
        self.url = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "worker.cli",
                    "server",
                    "--no-migrate",
                    "--host",
                    self.host,
                    "--port",
                    str(self.port),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(lambda: _ready(self.url) or self.proc.poll() is not None, 60, "asyncrl server up")  # type: ignore[union-attr]
        assert self.proc.poll() is None, self.log.read_text()[-2000:]

    def kill(self) -> None:
        """SIGKILL (no graceful shutdown), as a crashed server."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        assert not _ready(self.url)


def start_celery_worker(server_url: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    """A real Celery worker (solo pool: the task runs in this one process) on the test queue and its export queue
    (``settings.export_queue``), in its own process group, with ``env`` added to the environment; returns once it
    logged ``ready.``."""
    queue = env.get("CELERY_QUEUE", os.environ["CELERY_QUEUE"])
    queues = f"{queue},{env.get('CELERY_EXPORT_QUEUE') or f'{queue}-exports'}"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "server.jobs.celery_app",
                "worker",
                "--pool=solo",
                "--loglevel=INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                f"--queues={queues}",
                "-n",
                f"real-{secrets.token_hex(3)}@%h",
            ],
            env={**os.environ, "ASYNCRL_SERVER_URL": server_url, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_for(lambda: b"ready." in log.read_bytes() or proc.poll() is not None, 60, "celery worker ready")
    assert proc.poll() is None, log.read_text()[-2000:]
    return proc


def stop_process_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def processes() -> dict[int, tuple[int, str]]:
    """Live processes: pid -> (session id, command line with spaces between arguments)."""
    return {pid: (sid, cmd) for pid, (_, sid, cmd) in live_processes().items()}


def metrics_file_keys(path: Path) -> set[tuple[str, int, str]]:
    """``(source, step, name)`` of every point the run's processes wrote to ``metrics.jsonl`` (what the supervisor
    forwards: numbers, not booleans)."""
    from worker.launchers.reporter import rows_to_points
    from worker.run.rundir import read_jsonl

    return {(p["source"], p["step"], p["name"]) for p in rows_to_points(read_jsonl(path))}


def stored_keys(run_id: int) -> set[tuple[str, int, str]]:
    from sqlmodel import Session, select

    from server.core.db import engine
    from server.models import Metric

    with Session(engine) as s:
        rows = s.exec(select(Metric.source, Metric.step, Metric.name).where(Metric.run_id == run_id)).all()
    return {(source, int(step), name) for source, step, name in rows}
