"""The SLA signals in the per-minute rollups (docs/engines.md, "Signals for SLA policies").

All nullable (NULL: no report of the minute had the signal) except `sleeping_replicas`,
a count. Written by hand; it must match `gearshift.controller.store.tables.RollupRow`
(tests/unit/controller/test_store_migrations.py compares the models with the schema).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FLOATS = ("queue_p50_s", "queue_p99_s", "preemptions_per_s", "prefix_cache_hit_rate",
           "mean_prompt_tokens", "mean_generation_tokens")
_BLOCKS = ("kv_blocks_total", "kv_blocks_used")


def upgrade() -> None:
    with op.batch_alter_table("rollups") as batch:
        for name in _FLOATS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
        batch.add_column(sa.Column("sleeping_replicas", sa.Integer(), nullable=False,
                                   server_default="0"))
        for name in _BLOCKS:
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rollups") as batch:
        for name in (*_BLOCKS, "sleeping_replicas", *reversed(_FLOATS)):
            batch.drop_column(name)
