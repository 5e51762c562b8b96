"""users with roles, server-side dashboard sessions

Every token name becomes a user: ``member`` (a write token) or ``viewer`` (only read tokens), and the user of the
oldest write token ``admin``. Why not everyone ``admin``: before this revision any write token could stop, fork or
reconfigure any run, which is the hole this closes; members keep full control of their own runs (``runs.owner`` is
the token name), and the oldest write token is the one the quick start made on install (the operator's), so the
installation keeps one admin, who can promote others (``asyncrl token role --name N --role admin``).

Revision ID: 0005_users_roles
Revises: 0004_limits
Create Date: 2026-12-03 08:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0005_users_roles"
down_revision: str | None = "0004_limits"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("role", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "dashboard_sessions",
        sa.Column("id_hash", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["token_id"], ["api_tokens.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id_hash"),
    )
    op.create_index(op.f("ix_dashboard_sessions_token_id"), "dashboard_sessions", ["token_id"], unique=False)
    op.execute(
        "INSERT INTO users (name, role, created_at) "
        "SELECT name, CASE WHEN SUM(CASE WHEN scope = 'write' THEN 1 ELSE 0 END) = 0 THEN 'viewer' ELSE 'member' END, "
        "MIN(created_at) FROM api_tokens GROUP BY name"
    )
    op.execute(
        "UPDATE users SET role = 'admin' WHERE name = "
        "(SELECT name FROM api_tokens WHERE scope = 'write' ORDER BY created_at, id LIMIT 1)"
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_dashboard_sessions_token_id"), table_name="dashboard_sessions")
    op.drop_table("dashboard_sessions")
    op.drop_table("users")
