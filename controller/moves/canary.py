"""Canary analysis: is the candidate deployment as good as the baseline, within the SLA?

`analyze` is a pure function over the agents' `DeploymentReport`s of one report
interval (no I/O, no clock), so the orchestrator, tests and `decisions explain`
see the same numbers. "No data" (the candidate finished no request in the
interval, `ttft.present` false) is an outcome of its own: the orchestrator
pauses on it and never counts it as a failure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gearshift.common.errors import InvalidArgument
from gearshift.v1 import agent_pb2

Outcome = Literal["pass", "fail", "no_data"]
DEFAULT_TOLERANCE = 0.2  # candidate latency may exceed the baseline's by this fraction
DEFAULT_MAX_ERROR_RATE = 0.01  # failed / finished requests


@dataclass(frozen=True)
class Sla:
    """What a model promises its clients; None = no bound on that quantity."""

    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    max_error_rate: float = DEFAULT_MAX_ERROR_RATE

    def __post_init__(self) -> None:
        for name in ("ttft_p99_s", "itl_p99_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidArgument(f"SLA: {name} must be > 0 seconds, got {value!r}")
        if not 0.0 <= self.max_error_rate <= 1.0:
            raise InvalidArgument(
                f"SLA: max_error_rate must be within 0..1, got {self.max_error_rate!r}")


@dataclass(frozen=True)
class CanaryVerdict:
    """The result of one analysis: the outcome, why, and every number it used."""

    outcome: Outcome
    reasons: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)


def _p99(reports: Sequence[agent_pb2.DeploymentReport], which: str) -> float | None:
    """The worst p99 over the reports that have samples; None when none has."""
    values = [getattr(r, which).p99_s for r in reports if getattr(r, which).present]
    return max(values) if values else None


def _error_rate(candidate: Sequence[agent_pb2.DeploymentReport],
                errors_before: Mapping[str, int], interval_s: float) -> tuple[float, float] | None:
    """(errors, finished requests) in the interval, for the deployments with a previous count."""
    errors = 0.0
    requests = 0.0
    known = False
    for r in candidate:
        before = errors_before.get(r.deployment_id)
        if before is None or r.errors_total < before:  # no mark yet, or the engine restarted
            continue
        known = True
        errors += r.errors_total - before
        requests += r.request_rate * interval_s
    return (errors, requests) if known else None


def _compare(name: str, cand: float, base: float | None, bound: float | None,
             tolerance: float, reasons: list[str]) -> None:
    if bound is not None:
        # With a target, the target decides: a move the policy chose for cost may be
        # slower than the baseline and still right, as long as it meets the SLA.
        if cand > bound:
            reasons.append(f"candidate {name} p99 {cand:.3f} s exceeds the SLA {bound:.3f} s")
        return
    if base is not None and base > 0 and cand > base * (1.0 + tolerance):
        worse = (cand / base - 1.0) * 100.0
        reasons.append(f"candidate {name} p99 {cand:.3f} s is {worse:.0f}% worse than the "
                       f"baseline {base:.3f} s (tolerance {tolerance * 100:.0f}%)")


def analyze(candidate: Sequence[agent_pb2.DeploymentReport],
            baseline: Sequence[agent_pb2.DeploymentReport], sla: Sla,
            tolerance: float = DEFAULT_TOLERANCE, *,
            errors_before: Mapping[str, int] | None = None,
            interval_s: float = 0.0) -> CanaryVerdict:
    """Judge one report interval of the candidate against the baseline and the SLA.

    Latency: the worst TTFT / ITL p99 over the candidate deployments must be
    within the SLA where the model has a target, and otherwise at most
    `tolerance` worse than the baseline's worst. Error
    rate: errors counted since `errors_before` (per deployment id, the previous
    interval's `errors_total`) over the requests finished in `interval_s`.
    """
    if not tolerance >= 0:
        raise InvalidArgument(f"canary tolerance must be >= 0, got {tolerance!r}")
    figures: dict[str, float] = {"tolerance": tolerance, "max_error_rate": sla.max_error_rate,
                                 "candidate_deployments": float(len(candidate)),
                                 "baseline_deployments": float(len(baseline))}
    if sla.ttft_p99_s is not None:
        figures["sla_ttft_p99_s"] = sla.ttft_p99_s
    if sla.itl_p99_s is not None:
        figures["sla_itl_p99_s"] = sla.itl_p99_s
    reasons: list[str] = []
    counted = _error_rate(candidate, errors_before or {}, interval_s)
    if counted is not None:
        errors, requests = counted
        figures["candidate_errors"] = errors
        figures["candidate_requests"] = requests
        rate = errors / requests if requests > 0 else (1.0 if errors > 0 else 0.0)
        figures["candidate_error_rate"] = rate
        if rate > sla.max_error_rate:
            reasons.append(f"candidate error rate {rate:.2%} ({errors:.0f} errors in "
                           f"{requests:.0f} requests) exceeds the maximum {sla.max_error_rate:.2%}")
    cand_ttft = _p99(candidate, "ttft")
    base_ttft = _p99(baseline, "ttft")
    if base_ttft is not None:
        figures["baseline_ttft_p99_s"] = base_ttft
    if cand_ttft is None:
        if reasons:  # errors without a single finished request are a failure, not silence
            return CanaryVerdict("fail", reasons, figures)
        return CanaryVerdict("no_data", ["the candidate finished no request in the interval "
                                         "(no TTFT samples)"], figures)
    figures["candidate_ttft_p99_s"] = cand_ttft
    _compare("TTFT", cand_ttft, base_ttft, sla.ttft_p99_s, tolerance, reasons)
    cand_itl = _p99(candidate, "itl")
    base_itl = _p99(baseline, "itl")
    if base_itl is not None:
        figures["baseline_itl_p99_s"] = base_itl
    if cand_itl is not None:
        figures["candidate_itl_p99_s"] = cand_itl
        _compare("ITL", cand_itl, base_itl, sla.itl_p99_s, tolerance, reasons)
    if reasons:
        return CanaryVerdict("fail", reasons, figures)
    return CanaryVerdict("pass", ["candidate within the SLA and the baseline tolerance"], figures)
