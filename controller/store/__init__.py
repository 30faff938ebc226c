"""The durable store: `Store` (SQLite or PostgreSQL), its tables, upserts, the one batching
writer, what the controller persists and when (`persistence`), and the Alembic schema
revisions (`schema/`)."""
