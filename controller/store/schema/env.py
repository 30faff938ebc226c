"""Alembic environment of the controller store.

There is no alembic.ini: `gearshift.controller.store.database.alembic_config` builds the
Config in code and passes an open SQLAlchemy connection in
``config.attributes["connection"]``, so URLs (and passwords) never go through
ini interpolation.
"""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

from gearshift.controller.store import tables  # noqa: F401  (registers the tables on the metadata)

target_metadata = SQLModel.metadata


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError(
            "gearshift migrations need a connection in config.attributes['connection']; "
            "use gearshift.controller.store.database.Store.open(url)"
        )
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER most things
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise RuntimeError("gearshift migrations run online only (Store.open runs them)")
run_migrations_online()
