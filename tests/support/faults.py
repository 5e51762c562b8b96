"""A whole service the fault-matrix tests own and may kill: a Postgres and a Redis started for the test (never the
shared ones), an ``asyncrl server`` and an ``asyncrl worker`` (Celery with embedded beat) pointed at them.

Everything listens on 127.0.0.1 on free ports, keeps its files in one temporary folder, dies with the process that
started it (``PR_SET_PDEATHSIG``; Postgres' backends end when their postmaster is gone) and is stopped by
:meth:`Stack.close`. Each service runs in its own process group, so ``kill_9()`` is a crash of all of it (Postgres:
postmaster and backends, as an OOM kill of its container) and ``start()`` a restart on the same port and data.

Used by ``tests/e2e/service/test_fault_matrix.py`` and ``benchmarks/fault_matrix.py``.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from worker.run.procs import alive, die_with_parent, free_port, live_processes

PG_BIN = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
"""Debian's Postgres server binaries (newest last); ``postgres`` on PATH otherwise."""
START_S = 60.0
"""Bound on every start (a service that is not up by then fails the test with its log)."""


def wait_until(check: Callable[[], Any], timeout: float, what: str, log: Path | None = None) -> Any:
    """Poll ``check`` every 0.1 s until it returns something true (returned) or ``timeout`` seconds pass.

    Raises:
        TimeoutError: naming ``what`` (with the tail of ``log``).
    """
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{tail}")
        time.sleep(0.1)
    return value


def _parents() -> dict[int, tuple[int, int]]:
    """Live (not zombie) processes of this machine: pid -> (parent pid, process group id), from ``/proc``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state ppid pgrp ...
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if fields[0] not in {"Z", "X"}:
                found[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return found


def _account(name: str) -> pwd.struct_passwd | None:
    """The account to run a service as: ``name`` when this process is root (Postgres refuses root), else None."""
    return pwd.getpwnam(name) if os.geteuid() == 0 else None


@dataclass
class Service:
    """One server process (and whatever it forks) in its own process group, restartable with the same argv."""

    name: str
    argv: list[str]
    log: Path
    env: Mapping[str, str] | None = None
    user: str | None = None
    ready: Callable[[], bool] = lambda: True
    children_leave_group: bool = False
    """Its children start sessions of their own (Postgres' backends): found by parent pid instead. Not for a Celery
    worker: a run's supervisor is a child of it that must outlive it."""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    crashed: set[int] = field(default_factory=set, repr=False)
    """Pids it had when :meth:`crash` killed its main process (:meth:`kill_9` ends those left too)."""

    def start(self) -> None:
        """Start it and wait until ``ready`` (at most :data:`START_S`).

        Raises:
            RuntimeError: it exited while starting (the message holds the end of its log).
            TimeoutError: not ready in time.
        """
        account = _account(self.user) if self.user else None
        switch: dict[str, Any] = {} if account is None else {"user": account.pw_uid, "group": account.pw_gid}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=dict(self.env) if self.env is not None else None,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(sig=signal.SIGKILL),
                **switch,
            )
        proc = self.proc
        wait_until(lambda: proc.poll() is not None or self.ready(), START_S, f"{self.name} ready", self.log)
        if proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with code {proc.returncode}:\n{self.log.read_text()[-3000:]}")

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    def processes(self) -> set[int]:
        """Live pids of its process group, and with ``children_leave_group`` every descendant of its main process."""
        if self.proc is None:
            return set()
        table = _parents()
        found = {pid for pid, (_, pgid) in table.items() if pgid == self.proc.pid}
        grew = self.children_leave_group
        while grew:
            more = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
            found |= more
            grew = bool(more)
        return found

    def crash(self) -> set[int]:
        """SIGKILL its main process only (as a crash or an OOM kill of it); returns the pids it had (itself and
        what it started), to see which of them outlive it."""
        assert self.proc is not None, f"{self.name} was never started"
        had = self.processes()
        self.crashed |= had
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return had

    def kill_9(self) -> None:
        """SIGKILL every process of it (group and descendants); returns once none is left."""
        if self.proc is None:
            return
        pids, self.crashed = self.processes() | self.crashed, set()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        wait_until(lambda: not any(alive(p) for p in pids), 30, f"{self.name} gone")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM (Postgres: SIGINT, its fast shutdown) the group, SIGKILL what is left after ``grace_s``."""
        if self.proc is None or self.proc.poll() is not None:
            self.kill_9()
            return
        sig = signal.SIGINT if self.name == "postgres" else signal.SIGTERM
        try:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        self.kill_9()


def _pg_ready(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def _redis_ready(port: int) -> bool:
    import redis

    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).ping())
    except redis.RedisError:
        return False


def _http_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _celery_ready(log: Path, offset: int) -> Callable[[], bool]:
    def ready() -> bool:
        with open(log, "rb") as f:
            f.seek(offset)
            return b"ready." in f.read()

    return ready


def postgres(root: Path) -> tuple[Service, str]:
    """A new Postgres cluster in ``root/pg`` (``initdb``, trust on 127.0.0.1, a socket folder of its own, no fsync:
    a killed process loses nothing the kernel holds), not yet started; returns it and the URL of its ``postgres``
    database (user ``postgres``)."""
    binary = PG_BIN[-1] if PG_BIN else Path(shutil.which("postgres") or "postgres")
    data, sockets = root / "pg", root / "pg-sock"
    account = _account("postgres")
    for folder in (data, sockets):
        folder.mkdir(mode=0o700)
        if account is not None:
            os.chown(folder, account.pw_uid, account.pw_gid)
    switch: dict[str, Any] = {} if account is None else {"user": account.pw_uid, "group": account.pw_gid}
    subprocess.run(
        [str(binary.parent / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
        check=True,
        capture_output=True,
        timeout=120,
        **switch,
    )
    port = free_port()
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    argv = [str(binary), "-D", str(data), "-p", str(port), "-k", str(sockets)]
    argv += ["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=100"]
    return Service(
        "postgres",
        argv,
        root / "postgres.log",
        user="postgres",
        ready=lambda: _pg_ready(url),
        children_leave_group=True,
    ), url


def redis_server(root: Path) -> tuple[Service, str]:
    """A Redis on its own port (no persistence: a restart starts empty, as the CI Redis), not yet started."""
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(root), "--protected-mode", "no"]
    return Service("redis", argv, root / "redis.log", ready=lambda: _redis_ready(port)), f"redis://127.0.0.1:{port}/0"


class Stack:
    """Postgres, Redis, ``asyncrl server`` and ``asyncrl worker`` of one test, in ``root``.

    ``env`` is the environment of the server and the worker: the test's own plus the database and broker URLs,
    ``ASYNCRL_HOME`` / ``ASYNCRL_OUTPUT_DIR`` under ``root``, and ``RECONCILE_INTERVAL_S`` = ``reconcile_s``.
    """

    def __init__(self, root: Path, reconcile_s: float = 2.0) -> None:
        self.root = root
        self.pg, pg_url = postgres(root)
        self.db_url = pg_url.rsplit("/", 1)[0] + "/asyncrl"
        self.redis, broker = redis_server(root)
        self.api_port = free_port()
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.env = {
            **os.environ,
            "DATABASE_URL": self.db_url.replace("postgresql://", "postgresql+psycopg://"),
            "CELERY_BROKER_URL": broker,
            "CELERY_QUEUE": "asyncrl-faults",
            "ASYNCRL_HOME": str(root / "home"),
            "ASYNCRL_OUTPUT_DIR": str(root / "outputs"),
            "ASYNCRL_SERVER_URL": self.url,
            "RECONCILE_INTERVAL_S": str(reconcile_s),
            "MAX_RUNS_PER_USER": "4",
            "MAX_RUNS_PER_WORKER": "2",
            "MODEL_ROOTS": tempfile.gettempdir(),  # the tests' models are made in temporary folders
        }
        self.env.setdefault("SECRET_KEY", secrets.token_hex(16))
        for name in ("MAX_BODY_BYTES", "MAX_METRIC_POINTS"):  # the service's defaults, not the control-plane tests'
            self.env.pop(name, None)
        python = [sys.executable, "-m", "worker.cli"]
        self.api = Service(
            "api",
            [*python, "server", "--no-migrate", "--host", "127.0.0.1", "--port", str(self.api_port)],
            root / "server.log",
            env=self.env,
            ready=lambda: _http_ready(self.url),
        )
        self.worker = Service(  # no export worker: its "ready." in the same log would race the control worker's
            "worker",
            [*python, "worker", "--concurrency", "1", "--export-concurrency", "0"],
            root / "worker.log",
            env=self.env,
        )

    def start(self) -> Stack:
        """Start Postgres (create and migrate the ``asyncrl`` database), Redis, the server and the worker."""
        self.pg.start()
        admin = self.db_url.rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("CREATE DATABASE asyncrl")
        self.migrate()
        self.redis.start()
        self.api.start()
        self.start_worker()
        return self

    def migrate(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "alembic", "upgrade", "head"],
            env=self.env,
            cwd=Path(__file__).resolve().parents[2],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start_worker(self) -> None:
        """(Re)start the Celery worker; returns once it logged ``ready.``."""
        self.worker.log.touch()
        self.worker.ready = _celery_ready(self.worker.log, self.worker.log.stat().st_size)
        self.worker.start()

    def token(self, name: str = "faults") -> str:
        """A write token of an admin user ``name`` in this stack's database (``asyncrl token create``)."""
        out = subprocess.run(
            [sys.executable, "-m", "worker.cli", "token", "create", "--name", name, "--role", "admin"],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        return next(word for word in out.split() if word.startswith("asr_"))

    def client(self, token: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0)

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """Rows of ``sql`` on this stack's database (a fresh connection)."""
        with psycopg.connect(self.db_url, connect_timeout=5) as conn:
            return list(conn.execute(sql, args).fetchall())

    def supervisors(self) -> list[int]:
        """Pids of live supervisors of runs under this stack's output folder."""
        from worker.launchers.supervisor import running_pid

        homes = (self.root / "outputs" / "runs").glob("*")
        return [pid for home in homes if (pid := running_pid(home)) is not None]

    def close(self) -> None:
        """Stop every supervisor, then the worker, the server, Redis and Postgres; remove nothing (logs stay)."""
        from worker.launchers.supervisor import terminate

        for pid in self.supervisors():
            terminate(pid, grace_s=10)
        for service in (self.worker, self.api, self.redis, self.pg):
            service.stop()


def run_processes(home: Path, supervisor_pid: int | None = None) -> dict[int, str]:
    """Live processes of a run: those in its supervisor's session, and any whose command line names its home
    folder (the run directory is inside it: vLLM's ``--model`` does not name it, its group leader is in the
    session). pid -> command line."""
    found = {}
    for pid, (_, sid, cmd) in live_processes().items():
        if (supervisor_pid is not None and sid == supervisor_pid) or str(home) in cmd:
            found[pid] = cmd
    return found


def remove(root: Path) -> None:
    """Delete a stack's folder (Postgres' data folder belongs to its account)."""
    shutil.rmtree(root, ignore_errors=True)


def new_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="asyncrl-faults-"))
    root.chmod(0o755)  # Postgres' account must reach its data folder inside
    return root
