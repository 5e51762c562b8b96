"""Fixtures shared by the tests that talk to the control plane (``service/``, ``e2e/service/``, ``browser/``).

``tests.support.server`` is imported first: it points the settings (test database, Celery queue, state
directory) at this session's throw-away resources before any ``server`` module is imported, by any test folder.
The ``database`` fixture creates and migrates that database; the folders that need it use it ``autouse``.
"""

from __future__ import annotations

import atexit
import os
import secrets
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _pytest.pathlib import LOCK_TIMEOUT, make_numbered_dir_with_cleanup

from tests.support.server import fresh_database, new_token, spec
from tests.support.uvicorn_thread import serve

RUNS_CAN_ENTER = 0o711
"""Mode of the tests' temporary folders when they run as root: the runs they launch through the service run as other
uids (a root worker's default: ``worker.launchers.supervisor.run_user``) and must reach the models and data made there
(enter, not list). pytest makes them 0700, under ``/tmp/pytest-of-root``, which every pytest session sets back to
0700."""


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """As root without ``--basetemp``: the session's temporary folders live under ``/tmp/asyncrl-pytest-of-root``
    (0711; like pytest, the newest 3 sessions are kept) instead of ``/tmp/pytest-of-root``, and each is made
    :data:`RUNS_CAN_ENTER` (xdist workers get theirs from the controller)."""
    if os.geteuid() != 0 or config.option.basetemp is not None or hasattr(config, "workerinput"):
        return
    root = Path(tempfile.gettempdir()) / "asyncrl-pytest-of-root"
    root.mkdir(mode=RUNS_CAN_ENTER, exist_ok=True)
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
        raise pytest.UsageError(f"{root} is not a folder of root's: remove it")
    root.chmod(RUNS_CAN_ENTER)
    numbered = make_numbered_dir_with_cleanup(
        prefix="pytest-", root=root, keep=3, lock_timeout=LOCK_TIMEOUT, mode=RUNS_CAN_ENTER, register=atexit.register
    )
    config.option.basetemp = str(numbered / "t")  # pytest empties a given basetemp: not the folder of the lock


if os.geteuid() == 0:
    _getbasetemp, _mktemp = pytest.TempPathFactory.getbasetemp, pytest.TempPathFactory.mktemp

    def _enterable(path: Path) -> Path:
        if path.stat().st_mode & 0o777 != RUNS_CAN_ENTER:
            path.chmod(RUNS_CAN_ENTER)
        return path

    def _getbasetemp_runs_can_enter(self: pytest.TempPathFactory) -> Path:
        return _enterable(_getbasetemp(self))

    def _mktemp_runs_can_enter(self: pytest.TempPathFactory, basename: str, numbered: bool = True) -> Path:
        return _enterable(_mktemp(self, basename, numbered))

    pytest.TempPathFactory.getbasetemp = _getbasetemp_runs_can_enter  # type: ignore[method-assign]
    pytest.TempPathFactory.mktemp = _mktemp_runs_can_enter  # type: ignore[method-assign]


@pytest.fixture(scope="session")
def database() -> Iterator[str]:
    """The migrated test database's URL; dropped, with the test queue and state directory, at the session's end."""
    yield from fresh_database(remove_state=True)


@pytest.fixture
def session() -> Iterator[Any]:
    from sqlmodel import Session

    from server.core.db import engine

    with Session(engine) as s:
        yield s


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from server.main import app

    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {new_token(f'user-{secrets.token_hex(3)}')}"}


@pytest.fixture
def make_run(client: Any, auth: dict[str, str]) -> Callable[..., dict[str, Any]]:
    def make(**overrides: Any) -> dict[str, Any]:
        resp = client.post("/api/runs", json=spec(**overrides), headers=auth)
        assert resp.status_code == 201, resp.text
        return dict(resp.json())

    return make


@pytest.fixture(scope="module")
def live_server() -> Iterator[str]:
    """The app served by uvicorn on a free port in a thread (for processes that call the API)."""
    from server.main import app

    with serve(app) as url:
        yield url


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with one change: every file named ``*slurm*`` is one unit of work, so the Slurm tests run in
    one process, one at a time (the single-node partition holds one run's job; the cluster-script test restarts the
    multi-node cluster). The tests of any other file stay in one process as with plain ``loadfile`` (they share module
    fixtures: a vLLM server, a run). (xdist's own ``loadgroup`` marks do not group on pytest 9.2: it renames
    ``item._nodeid``, which pytest 9.2 no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrSlurm(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "slurm" if "slurm" in path.rsplit("/", 1)[-1] else path

    return FileOrSlurm(config, log)
