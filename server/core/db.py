"""The engine and sessions. Alembic owns the schema (``alembic upgrade head``); nothing here creates tables."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Engine, event, text
from sqlalchemy.exc import OperationalError
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


class DatabaseUnavailable(RuntimeError):
    """``DATABASE_URL`` names a database that does not open; the message is one line saying what to do."""


def check_connection(eng: Engine | None = None) -> None:
    """Open and close one connection to ``eng`` (default :data:`engine`), so a server that cannot reach its
    database says so at start in one line instead of a driver traceback.

    Raises:
        DatabaseUnavailable: ``DATABASE_URL: cannot open <url> (<the driver's reason>): <what to do>``.
    """
    eng = engine if eng is None else eng
    try:
        with eng.connect():
            pass
    except OperationalError as err:
        raise DatabaseUnavailable(unavailable_line(eng.url, str(err.orig))) from None


def unavailable_line(url: URL, reason: str) -> str:
    """The one line of :class:`DatabaseUnavailable` for the driver's ``reason`` (psycopg's or sqlite3's message,
    possibly several lines) of the database at ``url`` (shown without its password)."""
    reason = " ".join((reason.strip().splitlines() or [""])[0].split())  # psycopg's second line is a hint
    reason = re.sub(r"^connection failed: connection to server at .*? failed: ", "", reason)
    reason = re.sub(r"^FATAL: +", "", reason).removesuffix(".")
    host, port, user, name = url.host or "localhost", url.port or 5432, url.username, url.database
    if re.search(r'database ".*" does not exist', reason):
        todo = f"create it first (createdb -h {host} -p {port}{f' -U {user}' if user else ''} {name})"
    elif "password authentication failed" in reason or re.search(r'role ".*" does not exist', reason):
        todo = "check the user and password in DATABASE_URL"
    elif url.get_backend_name() == "sqlite":
        todo = "check that DATABASE_URL names a file this user may create and write"
    else:
        todo = f"is Postgres running and reachable at {host}:{port}? start it or fix DATABASE_URL"
    return f"DATABASE_URL: cannot open {url.render_as_string(hide_password=True)} ({reason}): {todo}"


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
