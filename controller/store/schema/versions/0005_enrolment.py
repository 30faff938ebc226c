"""Enrolment by bootstrap token: the tokens (secrets hashed) and the hosts' enrolments.

Written by hand; it must match `gearshift.controller.enrolment.store`
(tests/unit/controller/test_store_migrations.py compares the models with the schema).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ENROLMENT_STATE_LENGTH = 16


def upgrade() -> None:
    op.create_table(
        "bootstrap_tokens",
        sa.Column("token_id", sa.String(length=16), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("host_pattern", sa.String(), nullable=False),
        sa.Column("expires", sa.DateTime(timezone=True), nullable=False),
        sa.Column("one_time", sa.Boolean(), nullable=False),
        sa.Column("auto_approve", sa.Boolean(), nullable=False),
        sa.Column("description", sa.String(), nullable=False),
        sa.Column("created", sa.DateTime(timezone=True), nullable=False),
        sa.Column("uses", sa.Integer(), nullable=False),
        sa.Column("used_by", sa.String(), nullable=True),
        sa.Column("revoked", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("token_id"),
    )
    op.create_table(
        "host_enrolments",
        sa.Column("host_id", sa.String(), nullable=False),
        sa.Column("state", sa.String(length=ENROLMENT_STATE_LENGTH), nullable=False),
        sa.Column("token_id", sa.String(), nullable=True),
        sa.Column("key_fingerprint", sa.String(), nullable=False),
        sa.Column("csr_pem", sa.Text(), nullable=True),
        sa.Column("requested", sa.DateTime(timezone=True), nullable=False),
        sa.Column("changed", sa.DateTime(timezone=True), nullable=False),
        sa.Column("cert_not_after", sa.DateTime(timezone=True), nullable=True),
        sa.Column("note", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("host_id"),
    )


def downgrade() -> None:
    op.drop_table("host_enrolments")
    op.drop_table("bootstrap_tokens")
