"""`decisions explain` and `migrations show` reports from hand-built messages."""

from __future__ import annotations

from typing import Any

from google.protobuf.json_format import ParseDict

from gearshift.cli.explain import (
    GENERIC_REVERSAL,
    decision_report,
    expected_saving_per_day,
    fmt_value,
    key_figures,
    migration_phase,
    migration_report,
)
from gearshift.v1 import control_pb2

BASE_INPUTS: dict[str, Any] = {
    "rps_current": 48.2, "rps_sustained": 42.0, "rps_peak": 61.5, "rps_mean": 45.0,
    "burstiness": 1.37, "revisions_per_week": 0.5, "history_h": 30.0, "dwell_h": 26.5,
    "nvidia": True, "gpu_model": "H100", "sla_ttft_p99_ms": 1000.0,
    "capacity_rps.vllm": 10.0, "capacity_rps.tensorrt-llm": 11.6,
    "ttft_p99_ms.vllm": 900.0, "ttft_p99_ms.tensorrt-llm": 780.0,
}


def decision(**overrides: Any) -> control_pb2.Decision:
    doc: dict[str, Any] = {
        "id": "dec-7", "created_at": "2026-03-02T10:15:00Z", "model": "llama-3.3-70b",
        "from_engine": "vllm", "to_engine": "tensorrt-llm", "rule": "save-money",
        "inputs": {**BASE_INPUTS, "savings_usd_per_h": 12.5, "switch_usd": 310.25,
                   "churn_usd": 40.0, "net_savings_usd": 1850.75, "margin_usd": 62.05},
        "expected": {"cost_usd_per_day": -300.0, "ttft_p99_ms": -120.0,
                     "switch_cost_usd": 310.25, "net_savings_usd": 1850.75},
        "alternatives": [
            {"option": "rule sla", "why": "SLA met"},
            {"option": "vllm", "why": "stay: rule save-money: moving to tensorrt-llm saves "
                                      "$1,850.75 net over the horizon (margin $62.05)"}],
        "policy_version": 4, "mode": "approve", "status": "proposed",
        "status_reason": "waiting for approval",
        "reason": "moving to tensorrt-llm saves $1,850.75 net over the horizon (margin $62.05)",
        "conditions": [{"rule": "save-money", "signal": "net_savings_usd", "operator": "gt",
                        "threshold": 62.05, "observed": 1850.75, "unit": "USD", "held": True,
                        "group": "test"}],
    }
    doc.update(overrides)
    return ParseDict(doc, control_pb2.Decision())


def test_report_has_headline_units_alternatives_and_reversal() -> None:
    text = decision_report(decision())
    assert text.splitlines()[0] == (
        "Move llama-3.3-70b from vllm to tensorrt-llm (rule save-money) — proposed")
    assert "rule save-money: moving to tensorrt-llm saves $1,850.75 net" in text
    for figure in ("42 req/s", "48.2 req/s", "11.6 req/s", "780 ms", "1,000 ms", "1.37x",
                   "0.5/week", "26.5 h", "$12.50/h", "$310.25"):
        assert figure in text, figure
    assert "-$300.00/day (saves $300.00 a day)" in text
    assert "saves $1,850.75 after a switch cost of $310.25" in text
    assert "-120 ms (faster)" in text
    assert "rule sla: SLA met" in text
    assert "stay on vllm: rejected by rule save-money (see Why)" in text
    assert "expected net savings (now $1,850.75 over the horizon) dropping to the margin of " \
           "$62.05 or below" in text
    assert "tensorrt-llm breaking its SLA: TTFT p99 rising above 1,000 ms (measured 780 ms)" in text
    assert "version 4, mode approve" in text
    assert "proposed: waiting for approval" in text


def test_threshold_rule_reversal_names_the_condition() -> None:
    # The rule's words are whatever the core says; the report reads only the conditions.
    d = decision(rule="busy", inputs={"rps_sustained": 42.0, "capacity_gain": 0.16},
                 expected={}, reason="any wording at all",
                 conditions=[
                     {"rule": "busy", "signal": "rps_sustained", "operator": "gt", "threshold": 30,
                      "observed": 42.0, "unit": "req/s", "held": True, "group": "when"},
                     {"rule": "busy", "signal": "capacity_gain", "operator": "ge",
                      "threshold": 0.1, "observed": 0.16, "unit": "ratio", "held": True,
                      "group": "when"},
                     {"rule": "busy", "signal": "gpu_model", "operator": "in",
                      "threshold": ["H100", "H200"], "observed": "L40S", "unit": "",
                      "held": False, "group": "whenAny"}],
                 alternatives=[{"option": "vllm", "why": "stay: rule busy: any wording at all"}])
    text = decision_report(d)
    assert "rule busy: any wording at all" in text
    assert "tested: rps_sustained = 42 req/s, needs > 30 req/s: held" in text
    assert "tested: capacity_gain = 16%, needs >= 10%: held" in text
    assert "tested: gpu_model = L40S, needs in [H100, H200]: not met (whenAny)" in text
    assert "rps_sustained falling to 30 req/s or below (now 42 req/s)" in text
    assert "capacity_gain falling below 10% (now 16%)" in text
    assert "gpu_model" not in text.split("What would reverse it")[1]  # not met: not a reason
    assert "stay on vllm: rejected by rule busy (see Why)" in text
    assert "not estimated" in text


def test_trial_share_is_explained() -> None:
    text = decision_report(decision(trial_share=0.1))
    assert "trial first: tensorrt-llm serves 10% of the traffic" in text
    assert "trial first" not in decision_report(decision())


def test_unknown_inputs_get_the_generic_reversal_and_are_listed_as_unmeasured() -> None:
    d = decision(rule="manual", inputs={"rps_current": None, "gpu_model": "L40S"}, expected={
        "cost_usd_per_day": None}, alternatives=[], status="rejected", status_reason="",
        conditions=[], reason="")
    text = decision_report(d)
    assert GENERIC_REVERSAL in text
    assert "not measured: rps_current" in text
    assert "unknown: cost_usd_per_day" in text
    assert "none recorded" in text
    assert text.splitlines()[0].endswith("— rejected")


def test_horizon_and_list_column() -> None:
    d = decision(expected={"cost_usd_per_day": 24.0, "horizon_h": 168.0})
    text = decision_report(d)
    assert "+$24.00/day (costs $24.00 a day)" in text
    assert "+$168.00 serving cost over 168 h" in text
    assert expected_saving_per_day(d) == "-$24.00"
    assert expected_saving_per_day(decision()) == "$300.00"
    assert expected_saving_per_day(decision(expected={})) == "-"


def test_value_units_from_names() -> None:
    assert fmt_value("candidate_ttft_p99_s", 0.1234) == "123 ms"
    assert fmt_value("candidate_error_rate", 0.005) == "0.5%"
    assert fmt_value("share", 0.25) == "25%"
    assert fmt_value("cold_start_s", 210) == "210 s"
    assert fmt_value("nvidia", False) == "no"
    assert fmt_value("rps_peak", None) == "unknown"


def migration(**overrides: Any) -> control_pb2.Migration:
    doc: dict[str, Any] = {
        "id": "mig-3", "decision_id": "dec-7", "model": "llama-3.3-70b", "from_engine": "vllm",
        "to_engine": "tensorrt-llm", "kind": "engine_switch", "phase": "canary",
        "canary_step": 1, "canary_steps": [0.1, 0.25, 0.5],
        "status_message": "canary step 2/3 paused: no data",
        "source_deployments": ["d-old"], "target_deployments": ["d-new"],
        "created_at": "2026-03-02T10:20:00Z", "updated_at": "2026-03-02T10:41:00Z",
        "steps": [
            {"at": "2026-03-02T10:20:00Z", "from_phase": "pending", "to_phase": "building",
             "message": "building tensorrt-llm"},
            {"at": "2026-03-02T10:35:00Z", "from_phase": "canary", "to_phase": "canary",
             "message": "canary step 2/3: target takes 25%",
             "figures": {"step": 1, "share": 0.1, "candidate_ttft_p99_s": 0.412,
                         "baseline_ttft_p99_s": 0.455, "candidate_error_rate": 0.002,
                         "max_error_rate": 0.01}},
        ],
    }
    doc.update(overrides)
    return ParseDict(doc, control_pb2.Migration())


def test_migration_report_shows_phase_steps_and_canary_figures() -> None:
    m = migration()
    assert migration_phase(m) == "canary 2/3 (25%)"
    text = migration_report(m)
    assert "Migration mig-3: llama-3.3-70b vllm → tensorrt-llm (engine_switch)" in text
    assert "canary step 2/3 paused: no data" in text
    assert "10% → 25% → 50%" in text
    assert "pending → building" in text
    assert "cand ttft p99 412 ms" in text
    assert "base ttft p99 455 ms" in text
    assert "cand errors 0.2%" in text


def test_migration_without_steps_and_rolled_back() -> None:
    m = migration(phase="rolled_back", steps=[], reason="canary failed: TTFT p99 over the SLA",
                  kind="revision_rollout", target_revision="r2", to_engine="")
    text = migration_report(m)
    assert "revision r2 on vllm (revision_rollout)" in text
    assert "rolled_back" in text
    assert "reason    canary failed: TTFT p99 over the SLA" in text
    assert "no steps recorded" in text
    assert key_figures({}) == ""
