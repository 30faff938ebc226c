"""Migrations of models between engines: migrations, migration_steps, migration_commands.

Written by hand; it must match `gearshift.controller.moves.store`
(tests/unit/controller/test_store_migrations.py compares the models with the
schema). The import below only registers those models on the shared metadata
so that the comparison sees them wherever the schema is built; the columns
here are spelled out and never derived from the models.

Revision ID: 0002
Revises: 0001
Create Date: 2026-03-02 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from gearshift.controller.moves import store  # noqa: F401  (registers the tables)

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _str(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.String(), nullable=nullable)


def _json(name: str) -> sa.Column:
    return sa.Column(name, sa.JSON(), nullable=False)


def _int(name: str) -> sa.Column:
    return sa.Column(name, sa.Integer(), nullable=False)


def upgrade() -> None:
    op.create_table(
        "migrations",
        _str("id"),
        _str("decision_id", nullable=True),
        _str("model"),
        _str("kind"),
        _str("from_engine"),
        _str("to_engine"),
        _str("target_revision", nullable=True),
        sa.Column("phase", sa.String(length=32), nullable=False),
        _int("canary_step"),
        _json("canary_steps"),
        _json("source_deployment_ids"),
        _json("source_specs"),
        _json("target_specs"),
        _json("target_deployment_ids"),
        _json("target_restarts"),
        _json("error_marks"),
        _str("reason"),
        _str("status_message"),
        sa.Column("abort_requested", sa.Boolean(), nullable=False),
        _int("healthy_intervals"),
        _int("failed_checks"),
        _int("no_data_intervals"),
        sa.Column("observed_report_s", sa.Float(), nullable=True),
        _json("last_figures"),
        _ts("phase_entered_at"),
        _ts("created_at"),
        _ts("updated_at"),
        _ts("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_migrations_model", "migrations", ["model"])
    op.create_index("ix_migrations_phase", "migrations", ["phase"])
    op.create_table(
        "migration_steps",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        _str("migration_id"),
        _ts("at"),
        _str("from_phase"),
        _str("to_phase"),
        sa.Column("message", sa.Text(), nullable=False),
        _json("figures"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_migration_steps_migration_id", "migration_steps", ["migration_id"])
    op.create_table(
        "migration_commands",
        _str("command_id"),
        _str("migration_id"),
        _str("host_id"),
        _str("kind"),
        _str("phase"),
        _str("message"),
        _ts("sent_at"),
        _ts("updated_at"),
        sa.PrimaryKeyConstraint("command_id"),
    )
    op.create_index("ix_migration_commands_migration_id", "migration_commands",
                    ["migration_id"])


def downgrade() -> None:
    for table in ("migration_commands", "migration_steps", "migrations"):
        op.drop_table(table)
