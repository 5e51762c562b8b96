"""Alembic is the only way the schema changes: one head, upgrade/downgrade work, and no drift from the models."""

from __future__ import annotations

import secrets

from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlmodel import SQLModel

import server.alerts.models  # noqa: F401
import server.models  # noqa: F401
from tests.support.server import PG, migrate, pg_admin


def test_single_head() -> None:
    script = ScriptDirectory.from_config(Config("alembic.ini"))
    assert len(script.get_heads()) == 1


def test_models_match_migrations() -> None:
    from server.core.db import engine

    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), SQLModel.metadata)
    assert diff == [], f"models and migrations drift; write a migration (alembic revision --autogenerate): {diff}"


def test_downgrade_then_upgrade_on_a_fresh_database() -> None:
    name = f"asyncrl_test_mig_{secrets.token_hex(4)}"
    url = f"{PG.replace('postgresql://', 'postgresql+psycopg://')}/{name}"
    pg_admin(f'CREATE DATABASE "{name}"')
    try:
        migrate(url)
        migrate(url, "base", down=True)
        migrate(url)
    finally:
        pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
