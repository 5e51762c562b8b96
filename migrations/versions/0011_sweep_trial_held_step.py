"""the rung a sweep trial is held at (``server.models.SweepTrial.held_step``, trial state ``waiting``)

Revision ID: 0011_sweep_trial_held_step
Revises: 0010_pipelines
Create Date: 2026-12-04 13:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_sweep_trial_held_step"
down_revision: str | None = "0010_pipelines"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sweep_trials") as batch:
        batch.add_column(sa.Column("held_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sweep_trials") as batch:
        batch.drop_column("held_step")
