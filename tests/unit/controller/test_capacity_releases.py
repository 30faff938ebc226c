"""Capacity is learned per engine release: after an engine's upgrade the live loop never
takes the earlier release's figure for a measurement of the new one. It becomes the new
release's prior (``earlier-release``, its band widened), the decision cites the release
each engine runs, and the new release's own figure takes over once it is measured."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gearshift.cli.explain import decision_report
from gearshift.controller.api.control_actions import decision_msg
from gearshift.controller.decisions import learning
from gearshift.controller.decisions.facts import FactsCache, model_facts, newest
from gearshift.controller.decisions.learning import CapacityLearner, live_capacities
from gearshift.controller.decisions.policy_loop import PolicyLoop, RateHistory
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.store.database import Store, default_sqlite_url
from gearshift.controller.store.tables import DecisionRow, RollupRow
from gearshift.policies.priors import EARLIER_RELEASE_SOURCE, EARLIER_RELEASE_WIDENING
from gearshift.policies.schema import ModelPriors
from gearshift.v1 import agent_pb2

NOW = 1_773_014_400.0  # 2026-03-09T00:00:00Z
STEP_S = 300.0
GPU = "NVIDIA H100 80GB HBM3"
OLD, NEW = "0.11.0", "0.12.0"
SLA = ModelPriors(slaTtftP99Ms=1000)

POLICY = """\
apiVersion: gearshift.dev/v1
kind: EnginePolicy
metadata: {name: releases}
spec:
  mode: dry-run
  rules: [{name: cost, kind: expected-savings}]
  guardrails: {minDwell: 0s}
  cost: {pricePerGpuHour: 4.0}
  models:
    m: {slaTtftP99Ms: 1000, gpusPerReplica: 8}
    "*": {gpusPerReplica: 8}
"""


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(default_sqlite_url(tmp_path / "data"))
    yield s
    s.close()


def minutes(version: str, capacity_rps: float, n: int = 60, *, model: str = "m",
            start: float = NOW - 86400.0) -> list[RollupRow]:
    """`n` minutes of one vLLM replica from 10% to 130% of `capacity_rps` on `version`;
    p99 TTFT crosses the 1 s SLA at the capacity."""
    rows = []
    for i in range(n):
        load = capacity_rps * (0.1 + 1.2 * i / max(n - 1, 1))
        rows.append(RollupRow(model=model, engine="vllm", engine_version=version, gpu_model=GPU,
                              minute=datetime.fromtimestamp(start + 60 * i, UTC), reports=6,
                              replicas=1, request_rate_mean=load, request_rate_max=load,
                              ttft_p99_s=0.1 + 0.9 * (load / capacity_rps) ** 4, itl_p99_s=0.02))
    return rows


def test_an_upgraded_engine_takes_its_earlier_release_as_a_prior_until_measured(
        store: Store) -> None:
    learner = CapacityLearner(store)
    assert learner.observe(minutes(OLD, 10.0)) == 60
    old = learner.best("m", "vllm", GPU, 1.0, None, OLD)
    assert old is not None and old.estimate.status == "ok"

    # The engine now runs 0.12.0: nothing was measured on it.
    assert learner.best("m", "vllm", GPU, 1.0, None, NEW) is None
    caps, cite = live_capacities(learner, "m", GPU, SLA, {"vllm": NEW})
    vllm = caps["vllm"]
    assert vllm.source == EARLIER_RELEASE_SOURCE == cite["capacity_source.vllm"]
    assert vllm.capacity_rps == pytest.approx(old.estimate.capacity_rps)
    assert vllm.low == pytest.approx(old.estimate.low * (1 - EARLIER_RELEASE_WIDENING))
    assert vllm.high == pytest.approx(old.estimate.high * (1 + EARLIER_RELEASE_WIDENING))
    assert cite["engine_version.vllm"] == NEW
    note = str(cite["capacity_note.vllm"])
    assert note.startswith(f"vllm {NEW}: not measured; prior from {OLD} (measured "), note
    assert "band widened 25%" in note and f"vllm {NEW} not measured" in note
    assert cite["capacity_points.vllm"] == 0
    # With no engine measured on its own release, the others derive theirs from it (the
    # default ratio, with no priors): an upgrade of the measured engine leaves them priced.
    trt = caps["tensorrt-llm"]
    assert (trt.source, trt.base) == ("default-ratio", "vllm")
    assert str(cite["capacity_note.tensorrt-llm"]).startswith(f"vllm {EARLIER_RELEASE_SOURCE} ")
    # Without the release (an agent that reports none), any release's figure counts, as before.
    assert live_capacities(learner, "m", GPU, SLA)[0]["vllm"].source == "measured"

    # A few minutes on 0.12.0 are too little data: still the earlier release's figure.
    learner.observe(minutes(NEW, 5.0, n=3, start=NOW - 600))
    caps, cite = live_capacities(learner, "m", GPU, SLA, {"vllm": NEW})
    assert caps["vllm"].source == EARLIER_RELEASE_SOURCE
    assert f"too little data on vllm {NEW}" in str(cite["capacity_note.vllm"])

    # Once 0.12.0 has enough observations, its own figure is the measurement.
    learner.observe(minutes(NEW, 5.0, start=NOW - 7200))
    caps, cite = live_capacities(learner, "m", GPU, SLA, {"vllm": NEW})
    assert caps["vllm"].source == "measured"
    assert caps["vllm"].capacity_rps == pytest.approx(5.0, rel=0.1)
    assert cite["engine_version.vllm"] == NEW and cite["capacity_points.vllm"] == 63
    # The earlier release keeps its own figure (a rollback to it finds it measured).
    caps, _ = live_capacities(learner, "m", GPU, SLA, {"vllm": OLD})
    assert caps["vllm"].source == "measured"
    assert caps["vllm"].capacity_rps == pytest.approx(10.0, rel=0.1)


def test_the_nearest_earlier_release_is_the_prior_not_the_one_with_most_points(
        store: Store) -> None:
    learner = CapacityLearner(store)
    learner.observe(minutes("0.10.2", 20.0, n=120))
    learner.observe(minutes(OLD, 10.0))
    learner.observe(minutes("0.13.0", 40.0))
    found = learner.earlier("m", "vllm", GPU, NEW, 1.0, None)
    assert found is not None and found.key.engine_version == OLD
    # Nothing earlier: the nearest later release (a rollback), still never "measured".
    caps, cite = live_capacities(learner, "m", GPU, SLA, {"vllm": "0.10.0"})
    assert caps["vllm"].source == EARLIER_RELEASE_SOURCE
    assert "prior from 0.10.2" in str(cite["capacity_note.vllm"])
    # A release name that is not a number: the release with the most points.
    found = learner.earlier("m", "vllm", GPU, "nightly", 1.0, None)
    assert found is not None and found.key.engine_version == "0.10.2"


def test_newest_orders_releases_by_number() -> None:
    assert newest(["0.9.2", "0.12.0", "0.11.2"]) == "0.12.0"
    assert newest(["0.12.0rc1", "0.12.0"]) == "0.12.0"
    assert newest(["", "nightly", "0.11.0"]) == "0.11.0"
    assert newest(["nightly"]) == "nightly"
    assert newest(["", ""]) is None


def _hello(host: str, **installed: str) -> agent_pb2.Hello:
    hello = agent_pb2.Hello(host_id=host, protocol_version=agent_pb2.PROTOCOL_VERSION_1,
                            gpus=[agent_pb2.GpuInfo(index=i, model=GPU) for i in range(8)])
    for engine, version in installed.items():
        hello.engines.add(engine=engine.replace("_", "-"), version=version)
    return hello


def _loop(store: Store, fleet: FleetState, rps: float = 200.0) -> PolicyLoop:
    history = RateHistory(STEP_S)
    for k in range(288 * 3):
        history.sample(NOW - (288 * 3 - k) * STEP_S, {"m": rps, "n": rps})
    loop = PolicyLoop(store, DecisionStore(store.engine), fleet, history, paused=lambda: False,
                      clock=lambda: NOW, learner=CapacityLearner(store))
    loop.policies.apply(POLICY, "releases.yaml", "test", "")
    return loop


def _serve(fleet: FleetState, host: str, model: str, version: str, rps: float = 200.0) -> None:
    report = agent_pb2.Report(seq=1)
    report.deployments.add(deployment_id=f"{model}-1", model=model, engine="vllm",
                           engine_version=version, phase=agent_pb2.DEPLOYMENT_PHASE_READY,
                           request_rate=rps, metrics_present=True, tensor_parallel_size=8,
                           ttft=agent_pb2.Quantiles(present=True, p99_s=0.8))
    fleet.report(host, report)


def test_the_live_decision_names_each_engines_release_and_explains_it(store: Store) -> None:
    """vLLM serves m on 0.12.0, measured only on 0.11.0; TensorRT-LLM is installed as 1.2.0
    on m's host (1.3.0 elsewhere: a move goes to m's host first)."""
    fleet = FleetState(clock=lambda: NOW)
    fleet.hello(_hello("h1", vllm=NEW, tensorrt_llm="1.2.0"), 1.0)
    fleet.hello(_hello("h2", vllm="0.13.0", tensorrt_llm="1.3.0", sglang="0.5.7"), 1.0)
    _serve(fleet, "h1", "m", NEW)
    loop = _loop(store, fleet)
    assert loop.learner is not None
    loop.learner.observe(minutes(OLD, 10.0))
    facts = loop.model_facts("m", loop.policies.active()[1])  # type: ignore[index]
    assert facts is not None
    c = facts.citations
    assert (c["engine_version.vllm"], c["engine_version.tensorrt-llm"],
            c["engine_version.sglang"]) == (NEW, "1.2.0", "0.5.7")  # sglang: from the fleet
    assert c["capacity_source.vllm"] == EARLIER_RELEASE_SOURCE
    assert facts.engines["vllm"].capacity_rps == pytest.approx(10.0, rel=0.1)

    # A decision on it cites the releases, and `decisions explain` names them.
    loop.learner.observe(minutes(NEW, 10.0, start=NOW - 7200))  # measured on 0.12.0 too
    loop.policies.apply(POLICY.replace("m: {slaTtftP99Ms: 1000, gpusPerReplica: 8}",
                              "m: {slaTtftP99Ms: 1000, gpusPerReplica: 8, engines: {"
                              "tensorrt-llm: {coldStart: 240s, build: 30m}, "
                              "vllm: {coldStart: 210s}}}"), "releases.yaml", "test", "")
    (row,) = loop.evaluate(NOW)
    assert (row.from_engine, row.to_engine) == ("vllm", "tensorrt-llm")
    assert row.inputs["engine_version.vllm"] == NEW
    assert row.inputs["capacity_source.vllm"] == "measured"
    text = decision_report(decision_msg(row))
    assert f"capacity on vllm {NEW}:" in text and "capacity on tensorrt-llm 1.2.0:" in text


def test_explain_says_a_figure_is_another_releases() -> None:
    row = DecisionRow(
        created_at=datetime.fromtimestamp(NOW, UTC), model="m", from_engine="vllm",
        to_engine="tensorrt-llm", rule="cost",
        inputs={"capacity_source.vllm": EARLIER_RELEASE_SOURCE, "capacity_rps.vllm": 10.0,
                "capacity_low.vllm": 6.0, "capacity_high.vllm": 14.0,
                "engine_version.vllm": NEW,
                "capacity_note.vllm": f"vllm {NEW}: not measured; prior from {OLD} "
                                      "(measured 10 rps), band widened 25%"})
    text = decision_report(decision_msg(row))
    assert (f"capacity on vllm {NEW}: 10 req/s, NOT MEASURED on this release: another "
            "release's figure as its prior (band widened), band 6 req/s .. 14 req/s") in text
    assert f"why: vllm {NEW}: not measured; prior from {OLD}" in text


def test_models_without_an_sla_share_capacities_only_on_the_same_releases(
        store: Store) -> None:
    """Models without an SLA share their capacities and citations within a tick: on other
    releases, each cites its own. A model on two releases at once (an upgrade rolling
    through its replicas) is on the newer; a deployment that reports no release leaves its
    engine's release unknown."""
    fleet = FleetState(clock=lambda: NOW)
    for host in ("h1", "h2", "h3", "h4"):
        fleet.hello(_hello(host), 1.0)
    _serve(fleet, "h1", "n", OLD)
    _serve(fleet, "h2", "o", NEW)
    _serve(fleet, "h3", "p", "")
    report = agent_pb2.Report(seq=1)
    for i, version in enumerate((NEW, OLD)):
        report.deployments.add(deployment_id=f"q-{i}", model="q", engine="vllm",
                               engine_version=version, phase=agent_pb2.DEPLOYMENT_PHASE_READY,
                               tensor_parallel_size=8, gpu_indices=[i])
    fleet.report("h4", report)
    loop = _loop(store, fleet)
    policy = loop.policies.active()[1]  # type: ignore[index]
    cache = FactsCache(policy, loop.learner)
    ready: dict[str, list[tuple[str, agent_pb2.DeploymentReport]]] = {}
    for host, d, _ in fleet.deployments():
        ready.setdefault(d.model, []).append((host, d))
    seen = {m: model_facts(fleet, r, m, cache.priors(m), policy, loop.learner, None,
                           cache).citations for m, r in ready.items()}
    assert seen["n"]["engine_version.vllm"] == OLD and seen["o"]["engine_version.vllm"] == NEW
    assert seen["q"]["engine_version.vllm"] == NEW
    assert "engine_version.vllm" not in seen["p"]
    assert "engine_version.tensorrt-llm" not in seen["n"]  # no host says which


# --- when a release first ran, and regressions against the release before -----------------

def test_a_release_is_new_only_when_it_appears_after_the_first_tick(store: Store) -> None:
    learner = CapacityLearner(store)
    learner.load()
    # The first tick on an empty store: what runs already is not new.
    assert learner.release_seen("vllm", OLD, NOW) == 0.0
    learner.releases_settled()
    assert learner.release_seen("vllm", OLD, NOW + 60) == 0.0  # recorded once
    assert learner.release_seen("vllm", NEW, NOW + 60) == NOW + 60
    assert learner.release_seen("vllm", NEW, NOW + 120) == NOW + 60
    learner.save()
    # A restarted controller keeps the times, and a release it sees next is new.
    again = CapacityLearner(store)
    again.load()
    assert again.releases_seen == {f"vllm/{OLD}": 0.0, f"vllm/{NEW}": NOW + 60}
    assert again.release_seen("sglang", "0.5.10", NOW + 300) == NOW + 300


def test_a_measured_release_is_cited_with_the_older_releases_figure(store: Store) -> None:
    learner = CapacityLearner(store)
    learner.observe(minutes(OLD, 10.0, start=NOW - 3 * 86400))
    learner.observe(minutes(NEW, 7.0, start=NOW - 86400))
    learner.releases_settled()
    caps, cite = live_capacities(learner, "m", GPU, SLA, {"vllm": NEW}, NOW)
    assert caps["vllm"].source == "measured" and caps["vllm"].capacity_rps == pytest.approx(
        7.0, rel=0.1)
    assert cite["capacity_earlier.vllm"] == pytest.approx(10.0, rel=0.1)
    assert cite["engine_release_ts.vllm"] == NOW
    # The older release is never compared with a newer one (a rollback is no regression),
    # and without the tick's time nothing of this is cited.
    _, back = live_capacities(learner, "m", GPU, SLA, {"vllm": OLD}, NOW)
    assert "capacity_earlier.vllm" not in back
    _, timeless = live_capacities(learner, "m", GPU, SLA, {"vllm": NEW})
    assert "capacity_earlier.vllm" not in timeless and "engine_release_ts.vllm" not in timeless


def test_releases_recorded_are_bounded(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent reporting a new version at every report cannot grow the record without
    end: past the bound a release is not recorded and counts as old."""
    monkeypatch.setattr(learning, "MAX_RELEASES_SEEN", 3)
    learner = CapacityLearner(store)
    learner.releases_settled()
    assert [learner.release_seen("vllm", f"0.{i}.0", NOW + i) for i in range(3)] == [
        NOW, NOW + 1, NOW + 2]
    assert learner.release_seen("vllm", "9.9.9", NOW + 9) == 0.0
    stored = learner.snapshot()
    assert len(learner.releases_seen) == 3 and len(stored) == 3
    assert f"{learning.RELEASE_SEEN_PREFIX}vllm/9.9.9" not in stored
    assert learner.release_seen("vllm", "0.1.0", NOW + 9) == NOW + 1  # recorded ones stay
