"""pipelines and their stages (``server/services/pipelines.py``)

Revision ID: 0010_pipelines
Revises: 0009_run_tags_notes
Create Date: 2026-12-04 13:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010_pipelines"
down_revision: str | None = "0009_run_tags_notes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "pipelines",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sqlmodel.sql.sqltypes.AutoString(length=2000), nullable=False),
        sa.Column("spec", _JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_pipelines_name"), "pipelines", ["name"], unique=False)
    op.create_index(op.f("ix_pipelines_status"), "pipelines", ["status"], unique=False)
    op.create_table(
        "pipeline_stages",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("pipeline_id", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("kind", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("reason", sqlmodel.sql.sqltypes.AutoString(length=2000), nullable=False),
        sa.ForeignKeyConstraint(["pipeline_id"], ["pipelines.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("pipeline_id", "index"),
    )
    op.create_index(op.f("ix_pipeline_stages_pipeline_id"), "pipeline_stages", ["pipeline_id"], unique=False)
    op.create_index(op.f("ix_pipeline_stages_run_id"), "pipeline_stages", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_pipeline_stages_run_id"), table_name="pipeline_stages")
    op.drop_index(op.f("ix_pipeline_stages_pipeline_id"), table_name="pipeline_stages")
    op.drop_table("pipeline_stages")
    op.drop_index(op.f("ix_pipelines_status"), table_name="pipelines")
    op.drop_index(op.f("ix_pipelines_name"), table_name="pipelines")
    op.drop_table("pipelines")
