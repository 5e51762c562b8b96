"""an index of the metrics by (run, source, name, step): the newest point of every series of a run in one index probe
each (``GET /metrics``'s per-run metrics, ``server/core/telemetry.py``)

Revision ID: 0012_metrics_latest_index
Revises: 0011_sweep_trial_held_step
Create Date: 2026-12-07 10:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0012_metrics_latest_index"
down_revision: str | None = "0011_sweep_trial_held_step"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_metrics_latest", "metrics", ["run_id", "source", "name", "step"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_metrics_latest", table_name="metrics")
