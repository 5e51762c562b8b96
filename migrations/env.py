"""Alembic environment: the URL comes from ``Settings`` (or ``config.attributes["connection"]``), the target is
``SQLModel.metadata`` as declared in ``server/models.py`` and ``server/alerts/models.py``."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection
from sqlmodel import SQLModel

import server.alerts.models  # noqa: F401  (registers the alert and webhook tables on SQLModel.metadata)
import server.models  # noqa: F401  (registers the other tables)
from server.core.config import settings
from server.core.db import make_engine

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)
target_metadata = SQLModel.metadata


def _foreign_keys(connection: Connection, on: bool, *, commit: bool) -> None:
    """SQLite: turn ``PRAGMA foreign_keys`` off while migrations run (a batch rebuild drops and recreates a table;
    with foreign keys on, that drop would cascade to the rows pointing at it) and on again after. The pragma only
    takes effect outside a transaction, so it is set before the first statement; ``commit`` ends the transaction
    SQLAlchemy opened for it (on a connection this module made; a caller's connection is the caller's to commit)."""
    if connection.dialect.name != "sqlite":
        return
    connection.exec_driver_sql(f"PRAGMA foreign_keys={'ON' if on else 'OFF'}")
    if commit:
        connection.commit()


def _run(connection: Connection, *, own: bool = False) -> None:
    _foreign_keys(connection, False, commit=own)
    try:
        _migrate(connection)
    finally:
        _foreign_keys(connection, True, commit=own)


def _migrate(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=settings.DATABASE_URL, target_metadata=target_metadata, literal_binds=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(settings.DATABASE_URL)
    with engine.connect() as conn:
        _run(conn, own=True)
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
