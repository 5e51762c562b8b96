"""limits: runs.worker (who launched a run) and worker_capacity (what each worker declared)

Revision ID: 0004_limits
Revises: 0003
Create Date: 2026-12-03 08:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0004_limits"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("worker", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True))
    op.create_table(
        "worker_capacity",
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=False),
        sa.Column("cores", sa.Integer(), nullable=False),
        sa.Column("memory_gib", sa.Float(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("worker_capacity")
    op.drop_column("runs", "worker")
