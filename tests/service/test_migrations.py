"""Alembic is the only way the schema changes: one head, upgrade/downgrade work, and no drift from the models; a
server whose database does not open says so in one line."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import make_url
from sqlmodel import SQLModel

import server.alerts.models  # noqa: F401
import server.models  # noqa: F401
from tests.support.server import PG, free_port, migrate, pg_admin


def test_single_head() -> None:
    script = ScriptDirectory.from_config(Config("alembic.ini"))
    assert len(script.get_heads()) == 1


def test_models_match_migrations() -> None:
    from server.core.db import engine

    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), SQLModel.metadata)
    assert diff == [], f"models and migrations drift; write a migration (alembic revision --autogenerate): {diff}"


def schema(url: str) -> dict[str, Any]:
    """Every table of the database at ``url`` with its columns (name, type, nullable, default), indexes, unique and
    foreign-key constraints, and the Alembic revision: what a migration round trip must give back unchanged."""
    import sqlalchemy as sa

    from server.core.db import make_engine

    eng = make_engine(url)
    try:
        insp = sa.inspect(eng)
        out: dict[str, Any] = {}
        for table in sorted(insp.get_table_names()):
            out[table] = {
                "columns": [
                    (c["name"], str(c["type"]), c["nullable"], str(c.get("default"))) for c in insp.get_columns(table)
                ],
                "pk": insp.get_pk_constraint(table)["constrained_columns"],
                "indexes": sorted(
                    (i["name"], tuple(i["column_names"]), bool(i["unique"])) for i in insp.get_indexes(table)
                ),
                "unique": sorted((u["name"], tuple(u["column_names"])) for u in insp.get_unique_constraints(table)),
                "fks": sorted(
                    (f["name"], tuple(f["constrained_columns"]), f["referred_table"], tuple(f["referred_columns"]))
                    for f in insp.get_foreign_keys(table)
                ),
            }
        with eng.connect() as conn:
            out["alembic_version"] = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all()
        return out
    finally:
        eng.dispose()


def test_downgrade_then_upgrade_on_a_fresh_database() -> None:
    """Down to base leaves no table but Alembic's own, and up again gives back the very schema of the first upgrade:
    every table, column (type, nullability, default), index and constraint, at the single head."""
    import sqlalchemy as sa

    from server.core.db import make_engine

    name = f"asyncrl_test_mig_{secrets.token_hex(4)}"
    url = f"{PG.replace('postgresql://', 'postgresql+psycopg://')}/{name}"
    pg_admin(f'CREATE DATABASE "{name}"')
    try:
        migrate(url)
        first = schema(url)
        heads = ScriptDirectory.from_config(Config("alembic.ini")).get_heads()
        assert first["alembic_version"] == heads
        assert {"runs", "run_events", "metrics"} <= set(first)
        migrate(url, "base", down=True)
        eng = make_engine(url)
        try:
            assert sa.inspect(eng).get_table_names() == ["alembic_version"]
        finally:
            eng.dispose()
        migrate(url)
        assert schema(url) == first
    finally:
        pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_existing_tokens_become_users_with_roles() -> None:
    """0005_users_roles: the user of the oldest write token is admin, other writers members, read-only ones
    viewers; their tokens keep working with those roles."""
    import sqlalchemy as sa

    from server.core.db import make_engine

    name = f"asyncrl_test_mig_{secrets.token_hex(4)}"
    url = f"{PG.replace('postgresql://', 'postgresql+psycopg://')}/{name}"
    pg_admin(f'CREATE DATABASE "{name}"')
    try:
        migrate(url, "0004_limits")
        eng = make_engine(url)
        rows = [  # (name, scope, created_at, revoked)
            ("reader", "read", "2026-11-01", False),
            ("ops", "write", "2026-11-02", False),
            ("alice", "write", "2026-11-03", False),
            ("alice", "read", "2026-11-04", False),
            ("gone", "write", "2026-11-05", True),
        ]
        with eng.begin() as conn:
            for i, (user, scope, created, revoked) in enumerate(rows):
                conn.execute(
                    sa.text(
                        "INSERT INTO api_tokens (name, token_hash, prefix, scope, created_at, revoked_at) "
                        "VALUES (:n, :h, 'asr_x', :s, :c, :r)"
                    ),
                    {"n": user, "h": f"{i:064d}", "s": scope, "c": created, "r": created if revoked else None},
                )
        migrate(url)
        with eng.connect() as conn:
            roles = {r[0]: r[1] for r in conn.execute(sa.text("SELECT name, role FROM users"))}
        eng.dispose()
        assert roles == {"reader": "viewer", "ops": "admin", "alice": "member", "gone": "member"}
        migrate(url, "0004_limits", down=True)
        migrate(url)
    finally:
        pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_the_server_on_a_database_that_does_not_exist_exits_with_one_line() -> None:
    """``asyncrl server`` before ``createdb``: exit 1 and one line naming ``DATABASE_URL`` and the command that makes
    the database, not the driver's traceback; the port it bound is free again."""
    url = make_url(os.environ["DATABASE_URL"]).set(database="asyncrl_no_such_db")
    env = {**os.environ, "DATABASE_URL": url.render_as_string(hide_password=False)}
    cmd = [sys.executable, "-m", "worker.cli", "server", "--port", str(free_port())]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (1, "")
    shown = url.render_as_string(hide_password=True)
    assert proc.stderr.strip() == (
        f'error: DATABASE_URL: cannot open {shown} (database "asyncrl_no_such_db" does not exist): create it first '
        f"(createdb -h {url.host} -p {url.port or 5432}{f' -U {url.username}' if url.username else ''} "
        "asyncrl_no_such_db)"
    )
