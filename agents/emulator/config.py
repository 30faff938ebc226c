"""Emulator options (capacity, latencies, version) and injectable faults.

Options come from `gearshift emulate` flags or `GEARSHIFT_EMULATOR_*` env vars
(the agent can set env per engine). Faults come from `GEARSHIFT_EMULATOR_FAULTS`
(JSON) at start and from `POST /emulator/faults` at run time; both go through
`apply_faults`, which rejects unknown keys and wrong types with a clear message.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gearshift.common.engine_versions import ReleaseFacts

DEFAULT_LOAD_S = 1.0
DEFAULT_TTFT_BASE_S = 0.020
DEFAULT_ITL_S = 0.005
DEFAULT_OUTPUT_TOKENS = 16
# A trtllm-serve drains in-flight requests for a fixed grace on SIGTERM.
TRTLLM_DRAIN_GRACE_S = 30.0


class FaultError(ValueError):
    """A fault specification is invalid; the message names the key and the value."""


@dataclass(frozen=True)
class Faults:
    """Faults the emulated engine shows; all off by default."""

    crash_after_s: float | None = None  # exit non-zero this long after the port is bound
    health_ok: bool = True              # False: /health (and /health_generate) answer 503
    latency_factor: float = 1.0         # multiplies TTFT and ITL
    slow_start_s: float = 0.0           # extra load time (connections refused meanwhile)
    ignore_sigterm: bool = False        # SIGTERM does nothing (only SIGKILL stops it)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["health"] = "ok" if data.pop("health_ok") else "fail"
        return data


FAULT_KEYS = ("crash", "crash_after_s", "health", "latency_factor", "slow_start_s",
              "ignore_sigterm")


def _number(where: str, key: str, value: object, *, minimum: float,
            strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultError(f"{where}: fault {key!r}: expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < minimum or (strict and number == minimum):
        bound = ">" if strict else ">="
        raise FaultError(f"{where}: fault {key!r}: {number} must be finite and {bound} {minimum}")
    return number


def apply_faults(current: Faults, spec: object, *, where: str) -> tuple[Faults, bool]:
    """Return (updated faults, crash requested now). `where` names the source in errors."""
    if not isinstance(spec, dict):
        raise FaultError(f"{where}: expected a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(FAULT_KEYS))
    if unknown:
        raise FaultError(f"{where}: unknown fault(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(FAULT_KEYS)}")
    faults = current
    crash = False
    for key, value in spec.items():
        if key == "crash" or key == "ignore_sigterm":
            if not isinstance(value, bool):
                raise FaultError(f"{where}: fault {key!r} must be true or false, got {value!r}")
            if key == "crash":
                crash = value
            else:
                faults = replace(faults, ignore_sigterm=value)
        elif key == "health":
            if value not in ("ok", "fail"):
                raise FaultError(f"{where}: fault 'health' must be \"ok\" or \"fail\", got {value!r}")
            faults = replace(faults, health_ok=value == "ok")
        elif key == "crash_after_s":
            faults = replace(faults, crash_after_s=None if value is None
                             else _number(where, key, value, minimum=0.0))
        elif key == "latency_factor":
            faults = replace(faults, latency_factor=_number(where, key, value, minimum=0.0, strict=True))
        elif key == "slow_start_s":
            faults = replace(faults, slow_start_s=_number(where, key, value, minimum=0.0))
    return faults, crash


def parse_faults_json(text: str | None, *, where: str) -> Faults:
    """Faults from a JSON string (env var or flag); empty means none."""
    if not text or not text.strip():
        return Faults()
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FaultError(f"{where}: not valid JSON ({exc.msg} at position {exc.pos})") from None
    faults, crash = apply_faults(Faults(), spec, where=where)
    if crash:
        raise FaultError(f"{where}: 'crash' is a run-time switch; use 'crash_after_s' at start")
    return faults


@dataclass(frozen=True)
class EmulatorOptions:
    """How the emulated engine behaves, independent of its real command line."""

    capacity_rps: float
    load_s: float = DEFAULT_LOAD_S
    ttft_base_s: float = DEFAULT_TTFT_BASE_S
    itl_s: float = DEFAULT_ITL_S
    output_tokens: int = DEFAULT_OUTPUT_TOKENS
    engine_version: str = ""
    max_batch: int | None = None           # None: derived from capacity
    trtllm_prefixed_names: bool = True     # False: unprefixed Prometheus names (before 1.3)
    release_facts: ReleaseFacts | None = None  # the emulated release's options and metrics
    build_s: float = 0.0                   # `build` stand-in duration
    faults: Faults = field(default_factory=Faults)
    # "uvloop" spends less CPU per request, but its timers have millisecond steps, which
    # makes emulated token latencies lumpy: only for loads that emulate no latency.
    event_loop: str = "asyncio"
