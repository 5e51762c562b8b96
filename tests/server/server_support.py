"""Shared setup of the control-plane tests against the real Postgres and Redis.

One database ``asyncrl_test_<random>`` per test session (created, migrated with ``alembic upgrade head``,
dropped at the end) and one Celery queue ``asyncrl-test-<random>`` on the real Redis (deleted at the end).
The settings are read from the environment at import, so the variables are set here, before any
``server`` module is imported. Nothing else on the Postgres server or in Redis is touched.
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

SUFFIX = secrets.token_hex(4)
PG = os.environ.get("ASYNCRL_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432")
REDIS = os.environ.get("ASYNCRL_TEST_REDIS", "redis://127.0.0.1:6379/0")
DB_NAME = f"asyncrl_test_{SUFFIX}"
STATE = Path(tempfile.mkdtemp(prefix=f"asyncrl-test-{SUFFIX}-"))
os.environ.update({
    "DATABASE_URL": f"{PG.replace('postgresql://', 'postgresql+psycopg://')}/{DB_NAME}",
    "CELERY_BROKER_URL": REDIS,
    "CELERY_QUEUE": f"asyncrl-test-{SUFFIX}",
    "SECRET_KEY": secrets.token_hex(16),
    "ASYNCRL_HOME": str(STATE / "home"),
    "ASYNCRL_OUTPUT_DIR": str(STATE / "outputs"),
    "MAX_BODY_BYTES": str(256 * 1024),
    "MAX_METRIC_POINTS": "2000",
})

BAD_MODEL = "/nonexistent/asyncrl-test-model"
"""Specs in these tests name a model path that does not exist: a launched run fails in preflight at once."""


def pg_admin(sql: str) -> None:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(sql)


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


def new_token(name: str) -> str:
    from sqlmodel import Session

    from server.core.db import engine
    from server.services import tokens

    with Session(engine) as s:
        _, plain = tokens.create(s, name=name)
        s.commit()
    return plain


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": f"t-{secrets.token_hex(3)}", "max_steps": 3, "model": {"name": BAD_MODEL}}
    base.update(overrides)
    return base


def run_token_headers(run_id: int) -> dict[str, str]:
    from server.services.tokens import run_token

    return {"Authorization": f"Bearer {run_token(run_id)}"}


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
