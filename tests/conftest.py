"""Fixtures shared by the tests that talk to the control plane (``service/``, ``e2e/service/``, ``browser/``).

``tests.support.server`` is imported first: it points the settings (test database, Celery queue, state
directory) at this session's throw-away resources before any ``server`` module is imported, by any test folder.
The ``database`` fixture creates and migrates that database; the folders that need it use it ``autouse``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.server import fresh_database, new_token, spec
from tests.support.uvicorn_thread import serve


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
