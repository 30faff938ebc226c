"""Moving a model between engines: the migration state machine and its transition table,
the ledger and steps that advance a migration, the commands sent to agents, canary analysis,
placement, the orchestrator and the migrations' tables."""
