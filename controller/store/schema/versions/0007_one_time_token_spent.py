"""One-time bootstrap tokens are spent once a certificate is issued with them
(docs/enrolment.md): `bootstrap_tokens.spent`, when that happened (NULL: not spent,
or a reusable token). Written by hand; it must match
`gearshift.controller.enrolment.store.BootstrapTokenRow`
(tests/unit/controller/test_store_migrations.py compares the models with the schema).

Hosts that are reset (`gearshift hosts reset`) need no change of schema: their state,
``reset``, is one more value of `host_enrolments.state` (a string column without a
check constraint).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("bootstrap_tokens") as batch:
        batch.add_column(sa.Column("spent", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("bootstrap_tokens") as batch:
        batch.drop_column("spent")
