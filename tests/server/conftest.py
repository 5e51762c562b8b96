"""Fixtures of the control-plane tests (setup and helpers: ``server_support.py``, imported first)."""

from __future__ import annotations

import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from server_support import DB_NAME, STATE, drop_queue, free_port, migrate, new_token, pg_admin, spec


def fresh_database(*, remove_state: bool) -> Iterator[str]:
    """Body of the ``database`` fixtures (here, and package-scoped in ``tests/browser``): create and migrate the
    test database, yield its URL, then drop it and the test queue (and, with ``remove_state``, the state dir)."""
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


@pytest.fixture(scope="session", autouse=True)
def database() -> Iterator[str]:
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
    import uvicorn

    from server.main import app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
