"""Backtest: the output of docs/cost-model.md, the quality target of the default policy on every
shipped trace, and replays that ignore the future."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gearshift.policies.backtest import run_backtest, simulate
from gearshift.policies.loader import load_policy_file
from gearshift.policies.trace import ModelSeries, read_trace

TRACES = Path(__file__).parent / "traces"
EXAMPLES = Path(__file__).parents[3] / "policies" / "examples"
EXPECTED = json.loads((TRACES / "expected.json").read_text())


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    default = load_policy_file(str(EXAMPLES / "default.yaml"))
    seed = load_policy_file(str(EXAMPLES / "seed-framework.yaml"))
    out = {}
    for name in sorted(EXPECTED):
        out[name] = run_backtest(default, read_trace(TRACES / f"{name}.jsonl.gz"), compare=seed)
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_default_policy_meets_the_quality_target(results, name: str) -> None:
    r, oracle = results[name], EXPECTED[name]["oracle"]
    s = r["summary"]
    assert s["cost_usd"] <= oracle["cost_usd"] * 1.01, (s, oracle)
    assert s["flaps"] <= oracle["flaps"]
    assert s["sla_violation_min"] <= oracle["sla_violation_min"]
    assert s["cost_usd"] <= r["compare"]["summary"]["cost_usd"]  # never worse than the seed rule


def test_output_is_exactly_the_design_json(results) -> None:
    r = dict(results["fleet-mixed"])
    r.pop("compare")
    assert list(r) == ["policy", "trace", "models", "summary", "baselines"]
    assert r["policy"] == "default" and r["trace"] == "fleet-mixed"
    for m in r["models"].values():
        assert list(m) == ["switches", "gpu_hours", "cost_usd", "flaps", "revision_lag_h",
                           "sla_violation_min"]
        for s in m["switches"]:
            assert list(s) == ["ts", "to", "rule"] and s["ts"].endswith("Z")
    assert list(r["summary"]) == ["cost_usd", "flaps", "revision_lag_h", "sla_violation_min"]
    assert r["summary"]["cost_usd"] == round(sum(m["cost_usd"] for m in r["models"].values()), 2)
    assert r["baselines"] == {b: {"cost_usd": EXPECTED["fleet-mixed"][b]["cost_usd"]}
                              for b in ("static-vllm", "static-tensorrt-llm")}
    json.dumps(r)


def test_compare_shows_where_the_policies_differ(results) -> None:
    c = results["weekly-churn-70b"]["compare"]
    assert c["policy"] == "seed-framework"
    m = c["models"]["llama-70b-ft"]
    assert m["only_policy"] and m["cost_delta_usd"] > 0
    assert c["cost_delta_usd"] == round(c["summary"]["cost_usd"]
                                        - results["weekly-churn-70b"]["summary"]["cost_usd"], 2)


def test_changing_future_traffic_leaves_earlier_decisions_unchanged() -> None:
    policy = load_policy_file(str(EXAMPLES / "default.yaml"))
    trace = read_trace(TRACES / "rnd-churn-70b.jsonl.gz")
    cut = 1000  # steps
    series = trace.series["research-70b"]
    future = ModelSeries(rps=series.rps[:cut] + tuple(r * 5 + 50 for r in series.rps[cut:]),
                         revision_steps=series.revision_steps)
    other = dataclasses.replace(trace, series={"research-70b": future})
    cut_ts = trace.start.timestamp() + cut * trace.step_s
    before = [d.to_dict() for d in simulate(policy, trace)[1]["research-70b"] if d.created_at < cut_ts]
    after = [d.to_dict() for d in simulate(policy, other)[1]["research-70b"] if d.created_at < cut_ts]
    assert before == after and before


# The default policy's results on the shipped traces, pinned: a change to the decision
# core, the model-state rules or the cost model that moves them must say so here.
PINNED_SUMMARIES = {
    "bursty-8b": (1400.0, 0, 0.0, 0.0, 0),
    "fleet-mixed": (475976.33, 0, 10.17, 0.0, 5),
    "ramp-70b": (199924.93, 0, 0.0, 0.0, 1),
    "rnd-churn-70b": (21757.2, 0, 3.5, 0.0, 1),
    "steady-70b": (172810.27, 0, 0.0, 0.0, 1),
    "weekly-churn-70b": (84846.67, 0, 2.92, 0.0, 1),
}


@pytest.mark.parametrize("name", sorted(PINNED_SUMMARIES))
def test_default_policy_results_are_pinned(results, name: str) -> None:
    s = results[name]["summary"]
    switches = sum(len(m["switches"]) for m in results[name]["models"].values())
    assert (s["cost_usd"], s["flaps"], s["revision_lag_h"], s["sla_violation_min"],
            switches) == PINNED_SUMMARIES[name]


def test_a_backtest_loads_no_learning_library() -> None:
    """Neither run loads scikit-learn or SciPy (seconds of start-up): without --blind
    nothing is forecast or fitted; a blind backtest fits its forecasts with the numpy
    trees (`policies.quantile_trees`) and its capacities with the Python PAVA."""
    code = ("import json, sys\n"
            "from gearshift.cli.main import main\n"
            "try:\n"
            "    main()\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n")
    trace = TRACES / "steady-70b.jsonl.gz"
    for blind in (False, True):
        args = ["policy", "backtest", str(EXAMPLES / "default.yaml"), "--trace", str(trace),
                "-o", "json", *(["--blind"] if blind else [])]
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                              check=True, timeout=300)
        assert json.loads(proc.stdout)["summary"]["cost_usd"] > 0
        loaded = set(json.loads(proc.stderr.strip().splitlines()[-1]))
        assert not {m for m in loaded if m.partition(".")[0] in ("sklearn", "scipy")}
        assert ("gearshift.policies.quantile_trees" in loaded) is blind  # forecasts fitted
