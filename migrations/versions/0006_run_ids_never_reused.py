"""run ids never reused; run tokens bound to a per-run nonce

- ``runs.token_nonce``: a random value per run, signed into its run token (``server.services.tokens.run_token``), so
  the token of a deleted run never opens a later run, even one with the same id. Existing runs get a random nonce
  here: their processes' old tokens stop working (a live run's supervisor is relaunched with the new one on its next
  launch; upgrade with no live runs).
- SQLite: ``runs`` is rebuilt with ``AUTOINCREMENT``, so a new run never takes the id (and so the run folder
  ``runs/<id>``) of a deleted one; without it SQLite reuses the largest freed rowid. Postgres ids come from a
  sequence, which never goes back. The rebuild needs ``PRAGMA foreign_keys=OFF`` (``migrations/env.py`` sets it
  around SQLite migrations), else dropping the old table would cascade to every run's events and metrics.

Revision ID: 0006_run_ids_never_reused
Revises: 0005_users_roles
Create Date: 2026-12-03 12:00:00
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0006_run_ids_never_reused"
down_revision: str | None = "0005_users_roles"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    sqlite = bind.dialect.name == "sqlite"
    if sqlite and bind.exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError("0006 on SQLite needs PRAGMA foreign_keys=OFF (migrations/env.py sets it); nothing changed")
    with op.batch_alter_table(
        "runs", recreate="always" if sqlite else "auto", table_kwargs={"sqlite_autoincrement": True}
    ) as batch:
        batch.add_column(sa.Column("token_nonce", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))
    runs = sa.table("runs", sa.column("id", sa.Integer), sa.column("token_nonce", sa.String))
    for (run_id,) in bind.execute(sa.select(runs.c.id)).all():
        bind.execute(runs.update().where(runs.c.id == run_id).values(token_nonce=secrets.token_hex(16)))
    with op.batch_alter_table("runs", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.alter_column("token_nonce", existing_type=sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False)
    if sqlite:
        broken = bind.exec_driver_sql("PRAGMA foreign_key_check").all()
        if broken:
            raise RuntimeError(f"0006: rows point at missing rows after the rebuild: {broken[:5]}")


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:  # SQLite keeps AUTOINCREMENT unless rebuilt: harmless
        batch.drop_column("token_nonce")
