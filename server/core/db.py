"""The engine and sessions. Alembic owns the schema (``alembic upgrade head``); nothing here creates tables."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event, text
from sqlmodel import Session, create_engine

from server.core.config import settings


def private_sqlite_file(path: Path) -> None:
    """Make the SQLite database ``path`` readable by its owner only (0600) before SQLite opens it: created empty with
    that mode when missing (SQLite gives its ``-wal`` and ``-shm`` files the database's mode), an existing one and its
    ``-wal``/``-shm`` set to it; in ``ASYNCRL_HOME``, that folder is made private too
    (:meth:`server.core.config.Settings.private_home`). A run's uid must not read the service's tables."""
    if os.path.abspath(path.parent) == os.path.abspath(settings.ASYNCRL_HOME):
        settings.private_home()
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if file.stat().st_mode & 0o077:
                file.chmod(0o600)
        except FileNotFoundError:
            pass
        except PermissionError:  # not its owner: leave it
            pass


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.removeprefix("sqlite:///")
        if path and not path.startswith(":memory:") and "mode=memory" not in path:
            private_sqlite_file(Path(path.split("?", 1)[0]))
        eng = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(eng, "connect")
        def _sqlite_pragmas(conn: Any, _record: Any) -> None:  # a DB-API connection of sqlite3
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA foreign_keys=ON")

        return eng
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=10)


engine = make_engine(settings.DATABASE_URL)


def get_session() -> Iterator[Session]:
    with Session(engine) as session:
        yield session


def hold_write_lock(session: Session) -> None:
    """SQLite (embedded; no row or advisory locks): take the database's write lock now, held until ``session``'s
    transaction ends, by a write that changes nothing, so that what the transaction read stays true until it commits
    (another writer waits, up to the connection's 30 s timeout). Postgres: nothing (row and advisory locks do it)."""
    if session.get_bind().dialect.name == "sqlite":
        session.execute(text("UPDATE alembic_version SET version_num = version_num WHERE 0 = 1"))


def serialize(session: Session, name: str) -> None:
    """Hold the lock ``name`` until ``session``'s transaction ends, so that a check and the write it allows (count the
    rows, then add one) happen one transaction at a time: a Postgres advisory transaction lock keyed by the name's
    hash; on SQLite the database's write lock (:func:`hold_write_lock`: one writer at a time, whatever the name)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:name))"), {"name": name})
    hold_write_lock(session)
