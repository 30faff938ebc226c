"""Policies name engines from the catalog: unknown names are errors listing the known
ones; the per-engine signal vocabulary (`capacity_rps.<engine>`, `capacity_gain.<engine>`)
and the old two-engine names, still accepted and reported as deprecated; traces name
any catalog engines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gearshift.cli.policy_cmds import policy
from gearshift.common.engines import BASELINE_ENGINE, ENGINE_NAMES
from gearshift.policies.loader import PolicyError, load_policy
from gearshift.policies.signals import (
    DEPRECATED_SIGNALS,
    SIGNALS,
    EngineFacts,
    ModelFacts,
    ModelHistory,
    SignalSettings,
    SignalView,
    compute_signals,
)
from gearshift.policies.trace import TraceError, parse_trace
from tests.unit.policies.conftest import policy_text, profile, trace_lines


def _threshold(signal: str, prefer: str = "vllm", op: str = "gt: 1") -> str:
    return f"    - {{name: r, kind: threshold, prefer: {prefer}, when: [{{signal: {signal}, {op}}}]}}\n"


def test_an_unknown_engine_is_an_error_listing_the_known_ones() -> None:
    with pytest.raises(PolicyError) as err:
        load_policy(policy_text(rules=_threshold("rps_peak", prefer="vlm")), source="p.yaml")
    [problem] = err.value.problems
    assert problem.startswith("p.yaml:8: spec.rules[0].prefer: expected a known engine")
    assert f"({', '.join(ENGINE_NAMES)}), found 'vlm' (did you mean 'vllm'?)" in problem
    with pytest.raises(PolicyError, match=r"spec.preferences.exclude\[0\]: expected a known engine"):
        load_policy(policy_text("  preferences: {exclude: [tgi]}\n"))


def test_every_catalog_engine_has_its_signals_and_the_default_order() -> None:
    for name in ENGINE_NAMES:
        assert f"capacity_rps.{name}" in SIGNALS
        assert (f"capacity_gain.{name}" in SIGNALS) == (name != BASELINE_ENGINE)
    p = load_policy(policy_text(rules=_threshold("capacity_rps.tensorrt-llm", "tensorrt-llm")))
    assert p.deprecations == ()
    assert p.doc.spec.preferences.order == list(ENGINE_NAMES)


def test_per_engine_signals_read_that_engine() -> None:
    facts = ModelFacts(gpus_per_replica=1, engines={
        "vllm": EngineFacts(capacity_rps=10.0), "tensorrt-llm": EngineFacts(capacity_rps=11.5)})
    history = ModelHistory(sample_ts=np.array([0.0]), rps=np.array([1.0]),
                           revision_ts=np.array([]), sample_period_s=60.0)
    sig = compute_signals("m", history, facts, 60.0, SignalSettings())
    view = SignalView(signals=sig, engine="vllm", dwell_s=None)
    assert SIGNALS["capacity_rps.tensorrt-llm"].read(view) == 11.5
    assert SIGNALS["capacity_gain.tensorrt-llm"].read(view) == pytest.approx(0.15)
    for old, new in DEPRECATED_SIGNALS.items():  # the old names read the same figures
        assert SIGNALS[old].read(view) == SIGNALS[new].read(view)


def test_old_signal_names_load_and_policy_validate_reports_them(tmp_path: Path) -> None:
    rules = (_threshold("capacity_vllm_rps") + _threshold("capacity_gain", "tensorrt-llm", "ge: 0.1")
             .replace("name: r", "name: g"))
    p = load_policy(rules and policy_text(rules=rules), source="p.yaml")
    assert p.deprecations == (
        "p.yaml:8: spec.rules[0].when[0].signal: signal 'capacity_vllm_rps' is deprecated; "
        "use 'capacity_rps.vllm'",
        "p.yaml:9: spec.rules[1].when[0].signal: signal 'capacity_gain' is deprecated; "
        "use 'capacity_gain.tensorrt-llm'")
    path = tmp_path / "old.yaml"
    path.write_text(policy_text(rules=_threshold("capacity_tensorrt_llm_rps")))
    out = CliRunner().invoke(policy, ["validate", str(path)])
    assert out.exit_code == 0, out.output
    assert (f"warning: {path}:8: spec.rules[0].when[0].signal: signal "
            "'capacity_tensorrt_llm_rps' is deprecated; use 'capacity_rps.tensorrt-llm'"
            in out.output)


def test_a_trace_names_any_catalog_engines_the_same_for_every_model() -> None:
    only_vllm = {k: {"vllm": v["vllm"]} if isinstance(v, dict) else v
                 for k, v in profile().items()}
    trace = parse_trace(trace_lines({"m": [1.0]}, profiles={"m": only_vllm}), source="t")
    assert trace.engines == ("vllm",)
    with pytest.raises(TraceError, match="unknown engine 'tgi'"):
        bad = profile(capacity_rps={"vllm": 1.0, "tgi": 2.0})
        parse_trace(trace_lines({"m": [1.0]}, profiles={"m": bad}), source="t")
    with pytest.raises(TraceError, match="every model names the same engines"):
        parse_trace(trace_lines({"m": [1.0], "n": [1.0]},
                                profiles={"m": profile(), "n": only_vllm}), source="t")
    with pytest.raises(TraceError, match=r"build_s\.vllm: missing"):
        parse_trace(trace_lines({"m": [1.0]}, profiles={"m": profile(
            build_s={"tensorrt-llm": 1800})}), source="t")
