"""Fixtures of the end-to-end runs through the service (API server, Celery worker, supervisor, vLLM, Slurm) on the
real Postgres and Redis: a tiny random model, an ``asyncrl server`` process, and a server + worker pair."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import ApiServer, start_celery_worker, stop_process_group


@pytest.fixture(scope="session", autouse=True)
def migrated_database(database: str) -> str:
    """Every test here runs against the session's migrated test database."""
    return database


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.policy.models import init_model

    return init_model(tmp_path_factory.mktemp("model"), size="tiny", seed=0)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    from server.jobs.celery_app import app

    app.control.purge()  # launches queued by earlier tests of this session
    server = ApiServer(tmp_path_factory.mktemp("api") / "server.log")
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from server.jobs.celery_app import app
    from worker.policy.models import init_model

    app.control.purge()  # launches queued by earlier tests of this session
    tmp = tmp_path_factory.mktemp("resume")
    model = init_model(tmp / "model", size="tiny", seed=0)
    api = ApiServer(tmp / "server.log")
    api.start()
    worker = None
    try:  # a worker that does not start must not leave the API server behind
        worker = start_celery_worker(api.url, tmp / "worker.log")
        yield str(model)
    finally:
        if worker is not None:
            stop_process_group(worker)
        api.kill()
