"""alert events of built-in rules: ``alert_events.rule_id`` nullable

A built-in rule (``worker.tracking.alert_rules.BUILTIN_RULES``: ``policy_check`` fires on the run event
``policy_check_failed``) is no stored row, so its ``alert_events`` rows have no rule id. SQLite rebuilds the table
(``batch_alter_table``); Postgres drops the NOT NULL. The downgrade deletes the built-in rules' events first (their
webhook deliveries cascade).

Revision ID: 0007_builtin_alert_events
Revises: 0006_run_ids_never_reused
Create Date: 2026-12-04 02:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_builtin_alert_events"
down_revision: str | None = "0006_run_ids_never_reused"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("alert_events") as batch:
        batch.alter_column("rule_id", existing_type=sa.Integer(), nullable=True)


def downgrade() -> None:
    op.execute("DELETE FROM alert_events WHERE rule_id IS NULL")
    with op.batch_alter_table("alert_events") as batch:
        batch.alter_column("rule_id", existing_type=sa.Integer(), nullable=False)
