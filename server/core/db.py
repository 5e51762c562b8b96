"""The engine and sessions. Alembic owns the schema (``alembic upgrade head``); nothing here creates tables."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event, text
from sqlmodel import Session, create_engine

from server.core.config import settings


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
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
