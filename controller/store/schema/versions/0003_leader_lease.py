"""Leader lease of HA controllers: leader_lease.

Written by hand; it must match `gearshift.controller.ha.leader.LeaderLeaseRow`
(tests/unit/controller/test_store_migrations.py compares the models with the
schema). The import below only registers that model on the shared metadata so
that the comparison sees it wherever the schema is built; the columns here are
spelled out and never derived from the model. The table exists on SQLite too
(one schema for both backends) but only PostgreSQL uses it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-03-09 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from gearshift.controller.ha import leader  # noqa: F401  (registers the table)

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "leader_lease",
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("holder", sa.String(), nullable=True),
        sa.Column("address", sa.String(), nullable=True),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("leader_lease")
