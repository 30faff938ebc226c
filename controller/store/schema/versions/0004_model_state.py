"""Model state that survives a restart, structured decisions, typed migration kinds.

- `model_tenure`: the engine each model is on and since when (the dwell time).
- `decisions.reason`, `decisions.conditions`, `decisions.trial_share`: the deciding
  rule's words, its tests as data, and the trial share decided with the move.
- `migrations.kind` becomes a bounded string (a `MigrationKind` value) and
  `migrations.trial_outcome` records how a trial ended.

Written by hand; it must match `gearshift.controller.store.tables` and
`gearshift.controller.moves.store` (tests/unit/controller/test_store_migrations.py
compares the models with the schema).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MIGRATION_KIND_LENGTH = 32
TRIAL_OUTCOME_LENGTH = 16


def upgrade() -> None:
    op.create_table(
        "model_tenure",
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("engine", sa.String(), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model"),
    )
    with op.batch_alter_table("decisions") as batch:
        batch.add_column(sa.Column("reason", sa.Text(), nullable=False, server_default=""))
        batch.add_column(sa.Column("conditions", sa.JSON(), nullable=False,
                                   server_default=sa.text("'[]'")))
        batch.add_column(sa.Column("trial_share", sa.Float(), nullable=True))
    with op.batch_alter_table("migrations") as batch:
        batch.alter_column("kind", existing_type=sa.String(),
                           type_=sa.String(length=MIGRATION_KIND_LENGTH), existing_nullable=False)
        batch.add_column(sa.Column("trial_outcome", sa.String(length=TRIAL_OUTCOME_LENGTH),
                                   nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("migrations") as batch:
        batch.drop_column("trial_outcome")
        batch.alter_column("kind", existing_type=sa.String(length=MIGRATION_KIND_LENGTH),
                           type_=sa.String(), existing_nullable=False)
    with op.batch_alter_table("decisions") as batch:
        batch.drop_column("trial_share")
        batch.drop_column("conditions")
        batch.drop_column("reason")
    op.drop_table("model_tenure")
