"""The EnginePolicy document (``apiVersion: gearshift.dev/v1``) as strict pydantic models.

Stage one of validation: shapes, types, ranges, unknown keys forbidden. YAML keys
are camelCase (``minDwell``); Python fields are snake_case. Cross-field checks
(rule kinds, signal names, cron expressions) are stage two, in `loader`.
"""

from __future__ import annotations

import difflib
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel

from gearshift.common.engines import ENGINE_NAMES, is_engine

API_VERSION = "gearshift.dev/v1"
KIND = "EnginePolicy"



def _known_engine(value: str) -> str:
    """An engine name of the catalog; the error lists the known names."""
    if not is_engine(value):
        close = difflib.get_close_matches(value, ENGINE_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"expected a known engine ({', '.join(ENGINE_NAMES)}), "
                         f"found {value!r}{hint}")
    return value


Engine = Annotated[str, AfterValidator(_known_engine),
                   WithJsonSchema({"type": "string", "enum": list(ENGINE_NAMES)})]


class Mode(StrEnum):
    """What the live loop does with a decision (docs/decisions.md)."""

    DRY_RUN = "dry-run"  # record it, never act
    APPROVE = "approve"  # wait for a person (gearshift decisions approve ID)
    AUTO = "auto"        # hand it to the migration orchestrator at once


# Published as the plain list of its values, as when it was a Literal.
ModeField = Annotated[Mode, WithJsonSchema({"enum": [m.value for m in Mode], "title": "Mode",
                                            "type": "string"})]

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
DURATION_PATTERN = r"^\d+(\.\d+)?(s|m|h|d|w)$"


def parse_duration(value: Any) -> float:
    """'90s', '15m', '24h', '7d', '2w' or a number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like '30m', '24h' or '7d', found {value!r}")
    if isinstance(value, int | float):
        if value < 0 or value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"expected a duration >= 0, found {value!r}")
        return float(value)
    if isinstance(value, str):
        m = _DURATION_RE.match(value)
        if m:
            return float(m.group(1)) * _UNIT_S[m.group(2)]
    raise ValueError(f"expected a duration like '30m', '24h' or '7d', found {value!r}")


def format_duration(seconds: float) -> str:
    """Seconds as the largest whole unit: 604800 -> '7d', 90 -> '90s'."""
    for unit in ("d", "h", "m"):
        size = _UNIT_S[unit]
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    WithJsonSchema({"anyOf": [{"type": "string", "pattern": DURATION_PATTERN},
                              {"type": "number", "minimum": 0}],
                    "description": "duration: '30m', '24h', '7d' or seconds"}),
]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel,
                              populate_by_name=False, strict=False)


class Metadata(_Strict):
    name: Name
    description: str = ""


class Selector(_Strict):
    """Which models the policy governs: all when names and globs are both empty."""

    names: list[str] = []
    globs: list[str] = []
    labels: dict[str, str] = {}


class Condition(_Strict):
    """One comparison of a registered signal; exactly one operator."""

    signal: str
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    eq: bool | float | str | None = None
    ne: bool | float | str | None = None
    in_: list[str] | None = Field(default=None, alias="in")


class Rule(_Strict):
    """A named rule of a registered kind; `threshold` rules use `when`/`whenAny` + `prefer`."""

    name: Name
    kind: str
    prefer: Engine | None = None
    when: list[Condition] = []
    when_any: list[Condition] = []
    params: dict[str, Any] = {}


class SignalsConfig(_Strict):
    window: Duration = 24 * 3600.0
    long_window: Duration = 7 * 86400.0
    sustained_quantile: Annotated[float, Field(ge=0, le=1)] = 0.1
    revision_window: Duration = 14 * 86400.0
    min_history: Duration = 3600.0


class Preferences(_Strict):
    """Engine order for ties, and engines never to move to."""

    order: list[Engine] = list(ENGINE_NAMES)
    exclude: list[Engine] = []


class MaintenanceWindow(_Strict):
    cron: str  # five-field crontab: when the window opens (UTC)
    duration: Duration


class Guardrails(_Strict):
    min_dwell: Duration = 24 * 3600.0
    cooldown: Duration = 0.0
    hysteresis: Annotated[float, Field(ge=0, le=100)] = 0.5
    max_concurrent_migrations: Annotated[int, Field(ge=1, le=10_000)] = 2
    maintenance_windows: list[MaintenanceWindow] = []
    pins: dict[str, Engine] = {}  # model name or glob -> engine
    freezes: list[str] = []  # model names or globs


class Cost(_Strict):
    price_per_gpu_hour: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    build_overhead_usd: dict[Engine, NonNegative] = {}
    horizon: Duration = 7 * 86400.0


class EnginePriors(_Strict):
    """What to assume for a model on one engine until the fleet has measured it."""

    capacity_rps: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None  # per replica
    ttft_p99_ms: NonNegative | None = None
    itl_p99_ms: NonNegative | None = None
    cold_start: Duration | None = None
    build: Duration | None = None


class ModelPriors(_Strict):
    """Per-model facts for the live loop: sizing, SLA targets and engine priors.

    Keys of `spec.models` are model names or globs; the first match wins."""

    gpus_per_replica: Annotated[int, Field(ge=1, le=1024)] | None = None  # default: as deployed
    min_replicas: Annotated[int, Field(ge=0, le=10_000)] = 1
    headroom: Annotated[float, Field(ge=0, le=10)] = 0.2
    sla_ttft_p99_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    sla_itl_p99_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    engines: dict[Engine, EnginePriors] = {}


class Trials(_Strict):
    """Measured engine trials: before moving to an engine whose capacity for the model
    was never measured, run it on a bounded share of traffic and decide on what it showed."""

    enabled: bool = False
    share: Annotated[float, Field(gt=0, le=0.5)] = 0.1


class Spec(_Strict):
    mode: ModeField = Mode.DRY_RUN
    interval: Duration = 300.0
    selector: Selector = Selector()
    signals: SignalsConfig = SignalsConfig()
    rules: Annotated[list[Rule], Field(min_length=1)]
    preferences: Preferences = Preferences()
    guardrails: Guardrails = Guardrails()
    cost: Cost = Cost()
    models: dict[str, ModelPriors] = {}
    trials: Trials = Trials()


class PolicyDoc(_Strict):
    api_version: Literal["gearshift.dev/v1"]
    kind: Literal["EnginePolicy"]
    metadata: Metadata
    spec: Spec
