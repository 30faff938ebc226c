"""Engine releases: the trace's ``engine_release`` record, the cost model with the facts in
force at each step, and a policy that re-decides when engines change (docs/cost-model.md,
docs/decisions.md "Engine releases"). The public traces with releases are checked against
their hindsight optimum, plain and blind. Cost: about 15 s (six one-model backtests)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gearshift.cli.policy_cmds import policy as policy_cli
from gearshift.policies.backtest import run_backtest
from gearshift.policies.blind import LatencyWorld, blind_view
from gearshift.policies.core import ModelState, decide
from gearshift.policies.costmodel import ModelReplay, replay_model
from gearshift.policies.loader import load_policy_file
from gearshift.policies.priors import EngineCapacity, Measurement, resolve_capacities
from gearshift.policies.signals import EngineFacts, ModelFacts, ModelHistory, compute_signals
from gearshift.policies.trace import TraceError, parse_trace, read_trace

TRACES = Path(__file__).parent / "traces"
RELEASES = TRACES / "engine-changes"
EXAMPLES = Path(__file__).parents[3] / "policies" / "examples"
STEP_S = 300.0
T0 = 1_772_409_600.0  # 2026-03-02T00:00:00Z
DAY_S = 86400.0


def default():  # type: ignore[no-untyped-def]
    return load_policy_file(str(EXAMPLES / "default.yaml"))


# --- the record ---------------------------------------------------------------------------

def test_a_release_changes_the_facts_it_carries_from_the_step_that_holds_it(lines_of) -> None:
    lines = lines_of({"m": [5.0] * 6})
    # 00:07 lies in step 1 (00:05 .. 00:10): the release runs from step 1 on.
    lines.insert(3, json.dumps({"kind": "engine_release", "ts": "2026-03-02T00:07:00Z",
                                "model": "m", "engine": "vllm", "version": "0.12.0",
                                "capacity_rps": 12.5, "build_s": 30}))
    trace = parse_trace(lines, "t.jsonl")
    [rel] = trace.series["m"].releases
    assert (rel.step, rel.engine, rel.version) == (1, "vllm", "0.12.0")
    before, after = trace.profile_at("m", 0), trace.profile_at("m", 1)
    assert before == trace.profiles["m"]
    assert (after.capacity_rps["vllm"], after.build_s["vllm"]) == (12.5, 30)
    # What the record does not carry stays, for this engine and the others.
    assert after.ttft_p99_ms == before.ttft_p99_ms
    assert after.capacity_rps["tensorrt-llm"] == before.capacity_rps["tensorrt-llm"]
    assert trace.release_at("m", "vllm", 0) is None
    assert trace.release_at("m", "vllm", 5) == rel
    assert trace.release_at("m", "tensorrt-llm", 5) is None


@pytest.mark.parametrize(("fields", "reason"), [
    ({"engine": "sglang"}, "engine: expected one of the header's engines"),
    ({"version": ""}, "version: expected a non-empty string"),
    ({"version": 12}, "version: expected a non-empty string"),
    ({"capacity": 12.0}, "unknown field 'capacity'"),
    ({"build_overhead_usd": 1.0}, "unknown field 'build_overhead_usd'"),
    ({"capacity_rps": 0}, "capacity_rps: expected a number > 0"),
    ({"ttft_p99_ms": -1}, "ttft_p99_ms: expected a number >= 0"),
    ({"cold_start_s": "fast"}, "cold_start_s: expected a finite number"),
])
def test_a_bad_release_fails_with_its_line_and_field(lines_of, fields, reason) -> None:
    record = {"kind": "engine_release", "ts": "2026-03-02T00:05:00Z", "model": "m",
              "engine": "vllm", "version": "0.12.0", **fields}
    lines = lines_of({"m": [5.0] * 3})
    lines.insert(2, json.dumps(record))
    with pytest.raises(TraceError) as err:
        parse_trace(lines, source="t.jsonl")
    assert err.value.message.startswith("t.jsonl:3: ")
    assert reason in err.value.message


def test_an_unknown_kind_names_the_three_kinds(lines_of) -> None:
    lines = lines_of({"m": [5.0] * 2})
    lines.insert(1, json.dumps({"kind": "engine_upgrade", "ts": "2026-03-02T00:00:00Z",
                                "model": "m"}))
    with pytest.raises(TraceError, match="'traffic', 'revision' or 'engine_release'"):
        parse_trace(lines, source="t.jsonl")


# --- the cost model -----------------------------------------------------------------------

@pytest.mark.parametrize("folder", ["engine-changes", "three-engines"])
def test_static_baselines_match_the_published_figures(folder: str) -> None:
    expected = json.loads((TRACES / folder / "expected.json").read_text())
    for name, figures in expected.items():
        trace = read_trace(TRACES / folder / f"{name}.jsonl.gz")
        for engine in trace.engines:
            want = figures[f"static-{engine}"]
            outs = [replay_model(trace, m, {}, initial_engine=engine) for m in trace.series]
            assert round(sum(o.cost_usd for o in outs), 2) == want["cost_usd"], (name, engine)
            assert round(sum(o.revision_lag_h for o in outs), 2) == want["revision_lag_h"]
            assert sum(o.sla_violation_min for o in outs) == want["sla_violation_min"]
    # And the backtest's baselines are those figures.
    trace = read_trace(RELEASES / "trt-regression-32b.jsonl.gz")
    result = run_backtest(default(), trace)
    assert result["baselines"] == {
        k: {"cost_usd": v["cost_usd"]}
        for k, v in expected_of("trt-regression-32b").items() if k.startswith("static-")}


def expected_of(name: str) -> dict[str, dict[str, float]]:
    return json.loads((RELEASES / "expected.json").read_text())[name]  # type: ignore[no-any-return]


def test_replicas_sla_minutes_and_rebuilds_use_the_facts_of_their_step(make_trace) -> None:
    slower = {"engine": "tensorrt-llm", "version": "1.3.0", "build_s": 3600,
              "ttft_p99_ms": 1200.0, "capacity_rps": 5.8}
    trace = make_trace({"m": [50.0] * 40}, releases={"m": [(10, slower)]})
    # Statically on TensorRT-LLM: 6 replicas of 8 GPUs (50 * 1.2 / 11.6), then 11 (/ 5.8),
    # and SLA minutes from step 10 on (1200 ms > 1000 ms).
    out = replay_model(trace, "m", {}, initial_engine="tensorrt-llm")
    assert out.gpu_hours == (10 * 6 + 30 * 11) * 8 * STEP_S / 3600
    assert out.sla_violation_min == 30 * 5
    # A switch to TensorRT-LLM takes the build of the step it starts: 1800 s before the
    # release (7 steps with the 240 s cold start), 3600 s after (13 steps).
    early, late = ModelReplay(trace, "m"), ModelReplay(trace, "m")
    for k in range(13):
        early.step(k, "tensorrt-llm" if k == 5 else None)
        late.step(k, "tensorrt-llm" if k == 12 else None)
    assert early.pending is None and early.serving == "tensorrt-llm"  # ready at step 12
    assert late.pending == ("tensorrt-llm", 12 + 13)


# --- the policy against the hindsight optimum ---------------------------------------------

@pytest.mark.parametrize("name", ["vllm-upgrade-70b", "trt-regression-32b",
                                  "sglang-release-three"])
def test_the_default_policy_follows_releases_near_the_optimum(name: str) -> None:
    """Plain: within 1% of the oracle, no more flaps, at most 15 SLA minutes over it;
    blind (only the version change is known): within 3% and 30 SLA minutes."""
    trace = read_trace(RELEASES / f"{name}.jsonl.gz")
    oracle = expected_of(name)["oracle"]
    for blind, within, sla_over in ((False, 0.01, 15), (True, 0.03, 30)):
        s = run_backtest(default(), trace, blind=blind)["summary"]
        assert s["cost_usd"] <= oracle["cost_usd"] * (1 + within), (name, blind, s)
        assert s["flaps"] <= oracle["flaps"], (name, blind, s)
        assert s["sla_violation_min"] <= oracle["sla_violation_min"] + sla_over, (name, blind)


def test_explain_names_the_release_plain_and_blind() -> None:
    path = str(RELEASES / "vllm-upgrade-70b.jsonl.gz")
    for extra in ([], ["--blind"]):
        out = CliRunner().invoke(policy_cli, ["backtest", str(EXAMPLES / "default.yaml"),
                                              "--trace", path, "--explain", *extra])
        assert out.exit_code == 0, out.output
        move = out.output.split("Move chat-70b from tensorrt-llm to vllm")[1]
        assert "capacity on vllm 0.12.0:" in move
        assert "engine_version.vllm           0.12.0" in move
        if extra:  # blind: the new release is not measured yet; the move is its trial
            assert "NOT MEASURED on this release" in move
            assert "vllm 0.12.0: not measured; prior from" in move
            assert "trial first: vllm serves 10%" in move
            assert "a release trial" in move
    # JSON: the contract's keys, and the decisions beside them only when asked.
    out = CliRunner().invoke(policy_cli, ["backtest", str(EXAMPLES / "default.yaml"),
                                          "--trace", path, "-o", "json", "--explain"])
    result = json.loads(out.output)
    assert list(result) == ["policy", "trace", "models", "summary", "baselines", "decisions"]
    [_, upgrade] = result["decisions"]["chat-70b"]
    assert upgrade["inputs"]["engine_version.vllm"] == "0.12.0"
    assert upgrade["inputs"]["capacity_rps.vllm"] == 12.8


# --- what the core does with releases ------------------------------------------------------

def _facts(engines: dict[str, EngineFacts], **cite: object) -> ModelFacts:
    return ModelFacts(gpus_per_replica=2, sla_ttft_p99_ms=800.0, engines=engines, nvidia=True,
                      price_per_gpu_hour=4.0, citations=cite)  # type: ignore[arg-type]


def _engine(capacity: float, build_s: float = 0.0, **kw: float) -> EngineFacts:
    return EngineFacts(capacity_rps=capacity, ttft_p99_ms=kw.pop("ttft", 500.0),
                       cold_start_s=90, build_s=build_s, build_overhead_usd=0.0, **kw)


def _decide(facts: ModelFacts, state: ModelState, now: float, rate: float = 100.0):  # type: ignore[no-untyped-def]
    policy = default()
    ts = now - 3 * DAY_S + np.arange(int(3 * DAY_S / STEP_S)) * STEP_S
    hist = ModelHistory.of(ts, [rate] * len(ts), [], STEP_S)
    sig = compute_signals("m", hist, facts, now, policy.signal_settings)
    return decide(policy, {"m": sig}, {"m": state}, now)


def test_a_measured_capacity_regression_moves_at_once() -> None:
    now = T0 + 10 * DAY_S
    state = ModelState(engine="tensorrt-llm", since=now - 3 * 3600)  # within minDwell (24 h)
    engines = {"vllm": _engine(18.0), "tensorrt-llm": _engine(16.2, build_s=900)}
    measured = {"capacity_source.vllm": "measured", "capacity_source.tensorrt-llm": "measured",
                "engine_version.tensorrt-llm": "1.3.0"}
    # Without a previous release to compare with, the cheaper engine waits out the dwell.
    assert _decide(_facts(engines, **measured), state, now) == []
    [d] = _decide(_facts(engines, **measured, **{"capacity_earlier.tensorrt-llm": 21.6}),
                  state, now)
    assert (d.to_engine, d.rule, d.urgent) == ("vllm", "cost", True)
    assert "tensorrt-llm 1.3.0 regressed: 16.2 rps per replica, 25% under" in d.reason
    assert d.inputs["regression"].startswith("tensorrt-llm 1.3.0 regressed")


def test_a_new_release_is_trialled_when_the_top_of_its_band_pays() -> None:
    now = T0 + 10 * DAY_S
    since = now - 5 * DAY_S
    engines = {"vllm": _engine(10.0), "tensorrt-llm": _engine(11.6, build_s=1800)}
    cite = {"capacity_source.tensorrt-llm": "measured", "capacity_source.vllm": "earlier-release",
            "capacity_high.vllm": 12.5, "engine_version.vllm": "0.12.0",
            "engine_release_ts.vllm": now - 3600}
    state = ModelState(engine="tensorrt-llm", since=since)
    [d] = _decide(_facts(engines, **cite), state, now)
    assert (d.to_engine, d.trial_share) == ("vllm", 0.1)
    assert "vllm 0.12.0 was released after the model chose tensorrt-llm" in d.inputs["release_trial"]
    assert "a release trial" in d.reason
    # Once per release: trialled, it is not tried again; a release older than the choice
    # of engine was weighed then; a measured release needs no trial.
    assert _decide(_facts(engines, **cite), ModelState(
        engine="tensorrt-llm", since=since, trialled=frozenset({"vllm@0.12.0"})), now) == []
    # Live, a trial is known by when it started: one after the release counts.
    assert _decide(_facts(engines, **cite), ModelState(
        engine="tensorrt-llm", since=since, trialled_at=(("vllm", now - 60),)), now) == []
    assert _decide(_facts(engines, **cite), ModelState(
        engine="tensorrt-llm", since=since, trialled_at=(("vllm", now - 7200),)), now) != []
    assert _decide(_facts(engines, **{**cite, "engine_release_ts.vllm": since - 1}),
                   state, now) == []
    assert _decide(_facts(engines, **{**cite, "capacity_source.vllm": "measured"}),
                   state, now) == []


def test_an_earlier_releases_figure_is_a_widened_prior_never_a_measurement() -> None:
    old = EngineCapacity(10.0, 9.0, 11.0, "measured", "")
    caps = resolve_capacities({
        "vllm": Measurement(why="too little data on vllm", version="0.12.0", earlier=old,
                            earlier_version="0.11.0"),
        "tensorrt-llm": Measurement(EngineCapacity(11.6, 11.0, 12.0, "measured", "")),
    }, {}, ("vllm", "tensorrt-llm"))
    v = caps["vllm"]
    assert (v.source, v.capacity_rps, v.low, v.high) == ("earlier-release", 10.0, 9.0 * 0.75,
                                                         11.0 * 1.25)
    assert v.note.startswith("vllm 0.12.0: not measured; prior from 0.11.0")


# --- the quickest way out of a breach, and blind SLA ---------------------------------------

def test_a_breach_goes_to_the_compliant_engine_that_serves_soonest(tmp_path, lines_of,
                                                                   profile_of) -> None:
    """vLLM breaks the SLA; TensorRT-LLM (build 30 min) and SGLang (no build) meet it:
    the first move goes to SGLang (one step), plain and blind, and the blind replay
    reaches the plain one's SLA minutes (the physical minimum)."""
    three = profile_of(
        capacity_rps={"vllm": 10.0, "tensorrt-llm": 11.6, "sglang": 10.2},
        cold_start_s={"vllm": 210, "tensorrt-llm": 240, "sglang": 240},
        build_s={"vllm": 0, "tensorrt-llm": 1800, "sglang": 0},
        build_overhead_usd={"vllm": 0, "tensorrt-llm": 150, "sglang": 0},
        ttft_p99_ms={"vllm": 1300.0, "tensorrt-llm": 780.0, "sglang": 850.0})
    trace = parse_trace(lines_of({"m": [8.0] * 48}, profiles={"m": three}), "t")
    for blind in (False, True):
        r = run_backtest(default(), trace, blind=blind, decisions=True)
        [first, *_] = r["decisions"]["m"]
        assert (first.to_engine, first.rule, first.urgent) == ("sglang", "sla-first", True)
        assert "serves soonest" in first.reason and "tensorrt-llm ready in 34 min" in first.reason
        assert r["summary"]["sla_violation_min"] == 5.0  # one step: SGLang's cold start


def test_blind_reaches_the_plain_sla_minutes_on_an_sla_bound_trace(tmp_path, lines_of,
                                                                  profile_of) -> None:
    slow = profile_of(ttft_p99_ms={"vllm": 1300.0, "tensorrt-llm": 780.0})
    trace = parse_trace(lines_of({"m": [8.0] * 48}, profiles={"m": slow}), "t")
    plain = run_backtest(default(), trace)["summary"]["sla_violation_min"]
    blind = run_backtest(default(), trace, blind=True)["summary"]["sla_violation_min"]
    assert plain == blind == 35.0  # TensorRT-LLM's build and cold start: 7 steps


def test_a_release_that_breaks_the_sla_acts_between_evaluations(lines_of, profile_of) -> None:
    """The serving engine's release at 00:20 (not an evaluation: every 15 min) breaks the
    TTFT target: plain acts at that step, blind one step later (its first reading)."""
    fast = profile_of(ttft_p99_ms={"vllm": 900.0, "tensorrt-llm": 780.0})
    breach = {"engine": "vllm", "version": "0.12.0", "ttft_p99_ms": 1300.0}
    trace = parse_trace(lines_of({"m": [8.0] * 48}, profiles={"m": fast},
                                 releases={"m": [(4, breach)]}), "t")
    plain = run_backtest(default(), trace)
    blind = run_backtest(default(), trace, blind=True)
    assert plain["models"]["m"]["switches"][0]["ts"] == "2026-03-02T00:20:00Z"
    assert blind["models"]["m"]["switches"][0]["ts"] == "2026-03-02T00:25:00Z"
    assert plain["summary"]["sla_violation_min"] == 35.0
    assert blind["summary"]["sla_violation_min"] == 40.0


def test_blind_sees_versions_not_the_figures_of_a_release(make_trace) -> None:
    upgrade = {"engine": "vllm", "version": "0.12.0", "capacity_rps": 12.8,
               "ttft_p99_ms": 1300.0, "cold_start_s": 100}
    trace = make_trace({"m": [50.0] * 20}, releases={"m": [(10, upgrade)]})
    [rel] = blind_view(trace).series["m"].releases
    assert (rel.version, dict(rel.changes)) == ("0.12.0", {"cold_start_s": 100})
    # The world answers with the release's latency from its step on.
    world = LatencyWorld(trace, seed=1)
    before = [r[2] for r in world.readings("m", "vllm", 0, 10) if r]
    after = [r[2] for r in world.readings("m", "vllm", 10, 20) if r]
    assert max(before) < 1.0 < min(after)
