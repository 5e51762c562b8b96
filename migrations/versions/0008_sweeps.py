"""sweeps and their trials (``server/services/sweeps.py``)

Revision ID: 0008_sweeps
Revises: 0007_builtin_alert_events
Create Date: 2026-12-04 02:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008_sweeps"
down_revision: str | None = "0007_builtin_alert_events"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sqlmodel.sql.sqltypes.AutoString(length=2000), nullable=False),
        sa.Column("spec", _JSON, nullable=False),
        sa.Column("decided", _JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_sweeps_name"), "sweeps", ["name"], unique=False)
    op.create_index(op.f("ix_sweeps_status"), "sweeps", ["status"], unique=False)
    op.create_table(
        "sweep_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("params", _JSON, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("pruned_step", sa.BigInteger(), nullable=True),
        sa.Column("reason", sqlmodel.sql.sqltypes.AutoString(length=2000), nullable=False),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("sweep_id", "index"),
    )
    op.create_index(op.f("ix_sweep_trials_sweep_id"), "sweep_trials", ["sweep_id"], unique=False)
    op.create_index(op.f("ix_sweep_trials_run_id"), "sweep_trials", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_sweep_trials_run_id"), table_name="sweep_trials")
    op.drop_index(op.f("ix_sweep_trials_sweep_id"), table_name="sweep_trials")
    op.drop_table("sweep_trials")
    op.drop_index(op.f("ix_sweeps_status"), table_name="sweeps")
    op.drop_index(op.f("ix_sweeps_name"), table_name="sweeps")
    op.drop_table("sweeps")
