"""Durable tables of the controller (SQLModel), one class per table.

Every timestamp is a timezone-aware UTC `datetime` (`UTCDateTime` stores naive
UTC on SQLite and `timestamptz` on PostgreSQL, and always reads back aware UTC).
Structured values (labels, GPU inventory, decision inputs, alternatives) are
JSON columns; enumerated state is a `str` enum stored as its value; "unknown"
is NULL, never a sentinel. The schema itself is created by the hand-written
Alembic revision in `gearshift.controller.store.schema.versions`; keep the two in
step (a test compares them).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlmodel import Field, SQLModel

from gearshift.policies.core import DecisionStatus
from gearshift.policies.schema import Mode

DECISION_STATUS_LENGTH = 32

# Keys of `SettingRow` the controller relies on, with the type their value must have.
SETTING_ACTIVE_POLICY_VERSION = "active_policy_version"  # int, or None before any apply
SETTING_PAUSED = "paused"  # bool: the policy loop proposes nothing while paused
SETTING_EPOCH = "epoch"  # int: fencing epoch, bumped on every controller start
SETTING_TYPES: dict[str, tuple[type, ...]] = {
    SETTING_ACTIVE_POLICY_VERSION: (int, type(None)),
    SETTING_PAUSED: (bool,),
    SETTING_EPOCH: (int,),
}


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


def new_decision_id() -> str:
    """A short random decision id such as ``d-3f9a1c0b2e7d`` (easy to type in the CLI)."""
    return f"d-{uuid.uuid4().hex[:12]}"


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """A datetime column that always reads back timezone-aware UTC.

    Naive datetimes written to it are taken to be UTC already.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            # SQLite stores text; keep one fixed format so comparisons order correctly.
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _ts(nullable: bool = False, index: bool = False) -> Any:
    return Field(default_factory=utcnow, sa_type=UTCDateTime, nullable=nullable, index=index)


def _json(factory: Any) -> Any:
    return Field(default_factory=factory, sa_type=sa.JSON, nullable=False)


class HostRow(SQLModel, table=True):
    """A GPU host as its agent last described it (Hello) and last reported."""

    __tablename__ = "hosts"

    host_id: str = Field(primary_key=True)
    labels: dict[str, str] = _json(dict)
    agent_version: str = ""
    # list of {"index": int, "uuid": str, "model": str, "memory_total_bytes": int}
    gpus: list[dict[str, Any]] = _json(list)
    # list of {"engine": str, "version": str, "executable": str, "release": str (the
    # version-table row it runs with), "version_match": "known" | "nearest" | "unknown" | ""
    # (not said), "version_source": "config" | "metadata" | "probe" | ""}; rows written
    # before version tables lack the last three keys (a JSON column: no migration)
    engines: list[dict[str, Any]] = _json(list)
    first_seen: datetime = _ts()
    last_seen: datetime = _ts()
    last_report_seq: int | None = Field(default=None, sa_type=sa.BigInteger)  # NULL: no report yet


class DeploymentRow(SQLModel, table=True):
    """One engine deployment (a served model on one host) as last reported."""

    __tablename__ = "deployments"

    deployment_id: str = Field(primary_key=True)
    host_id: str = Field(index=True)
    model: str = Field(index=True)
    engine: str
    engine_version: str = ""
    revision: str = ""
    phase: str = ""  # DeploymentPhase name without prefix, e.g. "ready"
    endpoint: str = ""
    updated: datetime = _ts()


class RollupRow(SQLModel, table=True):
    """Per model, engine and minute: what the fleet measured (docs/store.md).

    Totals (`request_rate_*`, `running_mean`, `waiting_mean`,
    `generation_tokens_per_s`) are summed over the deployments of the model on
    that engine; latency quantiles are NULL when no request finished that minute.
    """

    __tablename__ = "rollups"

    model: str = Field(primary_key=True)
    engine: str = Field(primary_key=True)
    minute: datetime = Field(primary_key=True, sa_type=UTCDateTime)  # start of the minute, UTC
    engine_version: str = ""
    gpu_model: str = ""
    reports: int = 0  # reports with metrics that fell in the minute
    replicas: int = 0  # distinct deployments among them
    request_rate_mean: float = 0.0  # requests/s
    request_rate_max: float = 0.0  # requests/s, peak of the reconstructed total
    running_mean: float = 0.0
    waiting_mean: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    e2e_p99_s: float | None = None
    generation_tokens_per_s: float = 0.0
    kv_cache_usage_mean: float = 0.0  # 0..1, mean over reports
    errors: int = Field(default=0, sa_type=sa.BigInteger)  # failed requests within the minute
    # SLA signals (NULL: no report of the minute had it; see controller/ingest/rollup.py).
    queue_p50_s: float | None = None  # time waiting before scheduling
    queue_p99_s: float | None = None
    preemptions_per_s: float | None = None
    prefix_cache_hit_rate: float | None = None  # 0..1
    mean_prompt_tokens: float | None = None
    mean_generation_tokens: float | None = None
    sleeping_replicas: int = 0  # deployments whose engine was asleep at their latest report
    kv_blocks_total: int | None = Field(default=None, sa_type=sa.BigInteger)
    kv_blocks_used: int | None = Field(default=None, sa_type=sa.BigInteger)


class CommandLogRow(SQLModel, table=True):
    """A command sent to an agent, and what became of it."""

    __tablename__ = "command_log"

    command_id: str = Field(primary_key=True)
    host_id: str = Field(index=True)
    epoch: int = Field(sa_type=sa.BigInteger)
    kind: str  # "start" | "drain" | "stop" | "build"
    payload: dict[str, Any] = _json(dict)
    phase: str = "pending"  # "pending" until the agent answers, then its CommandPhase name
    message: str = ""
    created: datetime = _ts()
    updated: datetime = _ts()


class PolicyVersionRow(SQLModel, table=True):
    """One applied policy document; versions only ever grow."""

    __tablename__ = "policy_versions"

    version: int | None = Field(default=None, primary_key=True)
    name: str
    yaml_text: str = Field(sa_type=sa.Text)
    digest: str  # sha256 hex of yaml_text
    applied_at: datetime = _ts()
    applied_by: str = ""
    comment: str = ""


class SettingRow(SQLModel, table=True):
    """Controller-wide state as key/JSON value (see the SETTING_* keys)."""

    __tablename__ = "settings"

    key: str = Field(primary_key=True)
    value: Any = Field(default=None, sa_type=sa.JSON, nullable=True)
    updated: datetime = _ts()


class DecisionRow(SQLModel, table=True):
    """A decision of the policy core with every reason for it (docs/decisions.md)."""

    __tablename__ = "decisions"

    id: str = Field(default_factory=new_decision_id, primary_key=True)
    created_at: datetime = _ts(index=True)
    model: str = Field(index=True)
    from_engine: str
    to_engine: str
    rule: str
    inputs: dict[str, Any] = _json(dict)  # every input value the rule used
    expected: dict[str, Any] = _json(dict)  # expected cost and latency change
    alternatives: list[dict[str, Any]] = _json(list)  # rejected options and why
    policy_version: int | None = None
    mode: str = Mode.DRY_RUN.value  # a `policies.schema.Mode` value
    status: DecisionStatus = Field(
        default=DecisionStatus.PROPOSED,
        sa_type=sa.Enum(
            DecisionStatus,
            native_enum=False,
            length=DECISION_STATUS_LENGTH,
            values_callable=lambda e: [m.value for m in e],
            validate_strings=True,
        ),
        index=True,
    )
    status_reason: str = ""
    updated_at: datetime = _ts()
    reason: str = Field(default="", sa_type=sa.Text)  # the deciding rule's own words
    # what the deciding rule tested: {"rule", "signal", "operator", "threshold", "observed",
    # "unit", "held", "group"} per condition (`policies.rules.ConditionResult`)
    conditions: list[dict[str, Any]] = _json(list)
    trial_share: float | None = None  # set: the move first tries the target on this share


class ModelTenureRow(SQLModel, table=True):
    """The engine each model is on and since when, so that a restart keeps the dwell time
    (`policies.model_state.Tenure`)."""

    __tablename__ = "model_tenure"

    model: str = Field(primary_key=True)
    engine: str
    since: datetime = Field(sa_type=UTCDateTime)


class RevisionRow(SQLModel, table=True):
    """A model revision that was published (the churn signal counts them)."""

    __tablename__ = "revisions"
    __table_args__ = (sa.UniqueConstraint("model", "revision", name="uq_revisions_model_revision"),)

    id: int | None = Field(default=None, primary_key=True)
    model: str  # indexed through the unique constraint's leading column
    revision: str
    published_at: datetime = _ts()
    source: str = ""  # where it was seen: "agent", "cli", "registry", …
