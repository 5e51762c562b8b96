"""token scope: read tokens for dashboards and monitoring

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 02:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "api_tokens",
        sa.Column("scope", sqlmodel.sql.sqltypes.AutoString(length=8), server_default="write", nullable=False),
    )


def downgrade() -> None:
    op.drop_column("api_tokens", "scope")
