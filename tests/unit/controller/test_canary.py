"""Canary analysis: SLA, baseline tolerance, error rate and "no data" as its own outcome."""

from __future__ import annotations

import pytest

from gearshift.common.errors import InvalidArgument
from gearshift.controller.moves.canary import Sla, analyze
from gearshift.v1 import agent_pb2

SLA = Sla(ttft_p99_s=1.0, itl_p99_s=0.1, max_error_rate=0.05)


def report(dep_id: str = "c1", ttft: float | None = 0.5, itl: float | None = 0.05,
           errors: int = 0, rate: float = 10.0) -> agent_pb2.DeploymentReport:
    r = agent_pb2.DeploymentReport(deployment_id=dep_id, request_rate=rate, errors_total=errors)
    if ttft is not None:
        r.ttft.present, r.ttft.p99_s = True, ttft
    if itl is not None:
        r.itl.present, r.itl.p99_s = True, itl
    return r


def test_within_sla_and_tolerance_passes_with_figures() -> None:
    v = analyze([report(ttft=0.55)], [report("b1", ttft=0.5)], SLA, 0.2)
    assert v.outcome == "pass"
    assert v.figures["candidate_ttft_p99_s"] == 0.55
    assert v.figures["baseline_ttft_p99_s"] == 0.5
    assert v.figures["sla_ttft_p99_s"] == 1.0


def test_over_the_sla_fails_with_the_numbers() -> None:
    v = analyze([report(ttft=1.5)], [report("b1", ttft=1.4)], SLA, 0.2)
    assert v.outcome == "fail"
    assert v.reasons == ["candidate TTFT p99 1.500 s exceeds the SLA 1.000 s"]


def test_worse_than_baseline_beyond_tolerance_fails_without_a_target() -> None:
    no_itl_target = Sla(ttft_p99_s=1.0, itl_p99_s=None, max_error_rate=0.05)
    v = analyze([report(ttft=0.5, itl=0.09)], [report("b1", ttft=0.5, itl=0.05)], no_itl_target, 0.2)
    assert v.outcome == "fail"
    assert v.reasons == ["candidate ITL p99 0.090 s is 80% worse than the baseline 0.050 s "
                         "(tolerance 20%)"]


def test_no_candidate_samples_is_no_data_not_failure() -> None:
    v = analyze([report(ttft=None, itl=None)], [report("b1")], SLA, 0.2)
    assert v.outcome == "no_data"
    assert "no TTFT samples" in v.reasons[0]


def test_no_baseline_samples_checks_only_the_sla() -> None:
    assert analyze([report(ttft=0.9)], [report("b1", ttft=None, itl=None)], SLA).outcome == "pass"


def test_error_rate_counts_errors_since_the_previous_interval() -> None:
    cand = [report("c1", errors=13, rate=10.0)]  # 3 new errors in 10 req/s * 2 s = 20 requests
    v = analyze(cand, [], SLA, errors_before={"c1": 10}, interval_s=2.0)
    assert v.outcome == "fail"
    assert v.figures["candidate_error_rate"] == pytest.approx(0.15)
    assert "15.00% (3 errors in 20 requests)" in v.reasons[0]
    ok = analyze(cand, [], SLA, errors_before={"c1": 13}, interval_s=2.0)
    assert ok.outcome == "pass" and ok.figures["candidate_error_rate"] == 0.0


def test_errors_without_any_finished_request_fail_instead_of_no_data() -> None:
    v = analyze([report(ttft=None, itl=None, errors=5, rate=0.0)], [], SLA,
                errors_before={"c1": 0}, interval_s=1.0)
    assert v.outcome == "fail"


def test_a_restarted_engine_counter_is_not_read_as_negative_errors() -> None:
    v = analyze([report(errors=0)], [], SLA, errors_before={"c1": 50}, interval_s=1.0)
    assert v.outcome == "pass" and "candidate_error_rate" not in v.figures


@pytest.mark.parametrize("kwargs, field", [
    ({"ttft_p99_s": 0.0}, "ttft_p99_s"), ({"itl_p99_s": -1.0}, "itl_p99_s"),
    ({"max_error_rate": 1.5}, "max_error_rate")])
def test_bad_sla_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidArgument, match=field):
        Sla(**kwargs)


def test_negative_tolerance_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="tolerance"):
        analyze([report()], [], SLA, -0.1)


def test_slower_than_baseline_but_within_the_sla_passes() -> None:
    # A move chosen for cost may be slower than the engine it leaves; the SLA decides.
    v = analyze([report(ttft=0.9, itl=0.09)], [report("b1", ttft=0.2, itl=0.01)], SLA, 0.2)
    assert v.outcome == "pass", v.reasons
