"""tags, notes and a group on runs (``server.models.Run``, ``PATCH /api/runs/{id}``)

Revision ID: 0009_run_tags_notes
Revises: 0008_sweeps
Create Date: 2026-12-04 09:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0009_run_tags_notes"
down_revision: str | None = "0008_sweeps"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    # batch mode for SQLite; a rebuild (the downgrade's drops) keeps AUTOINCREMENT (0006)
    with op.batch_alter_table("runs", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.add_column(sa.Column("tags", _JSON, server_default="[]", nullable=False))
        batch.add_column(sa.Column("notes", sa.Text(), server_default="", nullable=False))
        batch.add_column(sa.Column("group", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True))
        batch.create_index(batch.f("ix_runs_group"), ["group"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("runs", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_index(batch.f("ix_runs_group"))
        batch.drop_column("group")
        batch.drop_column("notes")
        batch.drop_column("tags")
