"""Fixtures of the service tests: the API, services, Celery tasks, supervisor and dashboard against the real
Postgres and Redis (no model, no vLLM: the specs name a model path that does not exist)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.alerts import Receiver
from tests.support.server import new_token, start_celery_worker, stop_process_group
from tests.support.webui import login
from worker.launchers.capacity import Capacity


@pytest.fixture(scope="session", autouse=True)
def migrated_database(database: str) -> str:
    """Every test here runs against the session's migrated test database."""
    return database


WORKER_ENV = {"WEBHOOK_BACKOFF_BASE_S": "0.5", "WEBHOOK_BACKOFF_MAX_S": "4", "WEBHOOK_MAX_ATTEMPTS": "40"}
"""Backoff 0.5, 1, 2, 4, 4, ... s: a receiver down for 60 s sees ~17 tries, far below 40."""


@pytest.fixture(scope="module")
def worker(live_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from server.jobs.celery_app import app

    app.control.purge()  # tasks queued by earlier modules
    log = tmp_path_factory.mktemp("alerts-worker") / "worker.log"
    proc = start_celery_worker(live_server, log, **WORKER_ENV)
    yield log
    stop_process_group(proc)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def web(client: Any) -> tuple[Any, str]:
    """The module's client logged in with a fresh write token, and its CSRF token."""
    return client, login(client, new_token(f"web-{secrets.token_hex(3)}"))


@pytest.fixture
def declared(session: Any) -> Iterator[Any]:
    """Replace the declared workers by the ones a test publishes (``declare(name, cores, memory_gib, gpus)``); the
    earlier rows come back afterwards."""
    from sqlmodel import delete, select

    from server.models import WorkerCapacity
    from server.services import capacity

    saved = [r.model_dump() for r in session.exec(select(WorkerCapacity)).all()]
    session.exec(delete(WorkerCapacity))
    session.commit()

    def declare(name: str, cores: int, memory_gib: float, gpus: int) -> None:
        capacity.publish(session, name, Capacity(cores=cores, memory_gib=memory_gib, gpus=gpus))
        session.commit()

    yield declare
    session.exec(delete(WorkerCapacity))
    session.add_all(WorkerCapacity(**row) for row in saved)
    session.commit()
