"""The live loop prices moves at the fleet's GPU price when the policy sets none (the
default policy): the controller's --gpu-price-per-hour, overridden by a host's label; with
no price anywhere, decisions, explanations and policy validation say so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gearshift.cli.explain import decision_report
from gearshift.common.errors import ConfigError
from gearshift.controller.api.control_actions import decision_msg
from gearshift.controller.config import ControllerConfig
from gearshift.controller.decisions.gpu_price import PRICE_LABEL
from gearshift.controller.decisions.policy_loop import PolicyLoop, RateHistory
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.store.database import Store, default_sqlite_url
from gearshift.v1 import agent_pb2

NOW = 1_773_014_400.0  # 2026-03-09T00:00:00Z
STEP_S = 300.0
GPU = "NVIDIA H100 80GB HBM3"

POLICY = """\
apiVersion: gearshift.dev/v1
kind: EnginePolicy
metadata: {{name: unpriced}}
spec:
  mode: dry-run
  rules:
    - {{name: sla, kind: sla-guard}}
    - {{name: cost, kind: expected-savings}}
  guardrails: {{minDwell: 0s{pins}}}
{cost}  models:
    m:
      gpusPerReplica: 8
      engines:
        vllm: {{coldStart: 210s, capacityRps: 10}}
        tensorrt-llm: {{coldStart: 240s, build: 30m, capacityRps: 11.6}}
"""


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(default_sqlite_url(tmp_path / "data"))
    yield s
    s.close()


def _fleet(hosts: dict[str, dict[str, str]]) -> FleetState:
    """Model m on vLLM, one deployment on each host (host id -> its labels)."""
    fleet = FleetState(clock=lambda: NOW)
    for i, (host, labels) in enumerate(hosts.items()):
        fleet.hello(agent_pb2.Hello(host_id=host, labels=labels,
                                    protocol_version=agent_pb2.PROTOCOL_VERSION_1,
                                    gpus=[agent_pb2.GpuInfo(index=g, model=GPU) for g in range(8)]),
                    1.0)
        report = agent_pb2.Report(seq=1)
        report.deployments.add(deployment_id=f"d{i}", model="m", engine="vllm",
                               engine_version="0.11.0", phase=agent_pb2.DEPLOYMENT_PHASE_READY,
                               request_rate=100.0, metrics_present=True, tensor_parallel_size=8)
        fleet.report(host, report)
    return fleet


def _loop(store: Store, *, fleet_price: float | None = None, policy_price: float | None = None,
          hosts: dict[str, dict[str, str]] | None = None, pin: bool = False) -> PolicyLoop:
    history = RateHistory(STEP_S)
    for k in range(288 * 3):  # three days at 200 req/s
        history.sample(NOW - (288 * 3 - k) * STEP_S, {"m": 200.0})
    loop = PolicyLoop(store, DecisionStore(store.engine), _fleet(hosts or {"h1": {}}), history,
                      paused=lambda: False, clock=lambda: NOW, gpu_price_per_hour=fleet_price)
    cost = f"  cost: {{pricePerGpuHour: {policy_price}}}\n" if policy_price is not None else ""
    pins = ", pins: {m: tensorrt-llm}" if pin else ""
    loop.policies.apply(POLICY.format(cost=cost, pins=pins), "unpriced.yaml", "test", "")
    return loop


def _price(loop: PolicyLoop) -> tuple[float | None, object]:
    facts = loop.model_facts("m", loop.policies.active()[1])  # type: ignore[index]
    assert facts is not None
    return facts.price_per_gpu_hour, facts.price_source


def test_the_fleet_price_prices_the_default_policy_s_moves(store: Store) -> None:
    loop = _loop(store, fleet_price=4.0)
    rows = loop.evaluate(NOW)
    assert [(r.rule, r.to_engine) for r in rows] == [("cost", "tensorrt-llm")]
    i = rows[0].inputs
    assert i["price_per_gpu_hour"] == 4.0
    assert i["price_source"] == "controller --gpu-price-per-hour"
    assert rows[0].expected["net_savings_usd"] > 0
    assert "price_note" not in i


def test_without_any_price_nothing_moves_and_validation_says_why(store: Store) -> None:
    loop = _loop(store)
    assert loop.evaluate(NOW) == []
    assert _price(loop) == (None, "none")
    warnings = loop.policies.validate(POLICY.format(cost="", pins=""), "unpriced.yaml").warnings
    assert any("rule cost can never move a model" in w and "--gpu-price-per-hour" in w
               for w in warnings), warnings
    # A price from the policy, the controller or a host's label silences the warning.
    priced = _loop(store, hosts={"h1": {PRICE_LABEL: "3"}})
    assert not [w for w in priced.policies.validate(POLICY.format(cost="", pins=""), "p.yaml").warnings
                if "never move" in w]


def test_a_decision_without_a_price_says_so_in_its_explanation(store: Store) -> None:
    """A pin still moves the model; its expected effect cannot be priced, and says why."""
    row = _loop(store, pin=True).evaluate(NOW)[0]
    assert row.rule == "pin" and row.expected["net_savings_usd"] is None
    assert row.inputs["price_note"].startswith("no GPU price: set spec.cost.pricePerGpuHour")
    text = decision_report(decision_msg(row))
    assert "unknown: cost_usd_per_day, net_savings_usd, switch_cost_usd (no GPU price" in text


def test_a_host_label_overrides_the_fleet_price_and_a_model_takes_its_hosts_mean(
        store: Store) -> None:
    loop = _loop(store, fleet_price=4.0, hosts={"h1": {PRICE_LABEL: "2.0"}, "h2": {}})
    assert _price(loop) == (3.0, f"controller --gpu-price-per-hour; host label {PRICE_LABEL}")
    labelled = _loop(store, hosts={"h1": {PRICE_LABEL: "2.5"}, "h2": {}})
    assert _price(labelled) == (2.5, f"host label {PRICE_LABEL} (1 of 2 deployments' hosts "
                                     "have a price)")


def test_a_bad_label_falls_back_to_the_fleet_price_and_is_cited(store: Store) -> None:
    price, source = _price(_loop(store, fleet_price=4.0, hosts={"h1": {PRICE_LABEL: "cheap"}}))
    assert price == 4.0
    assert source == (f"controller --gpu-price-per-hour (label {PRICE_LABEL}='cheap' is not a "
                      "positive number)")
    assert _price(_loop(store, hosts={"h1": {PRICE_LABEL: "-1"}}))[0] is None


def test_the_policy_s_price_wins_and_the_decision_cites_it(store: Store) -> None:
    row = _loop(store, fleet_price=4.0, policy_price=2.0).evaluate(NOW)[0]
    assert row.inputs["price_per_gpu_hour"] == 2.0
    assert row.inputs["price_source"] == "policy spec.cost.pricePerGpuHour"


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_fleet_price_is_refused_naming_the_flag(bad: float) -> None:
    with pytest.raises(ConfigError, match="--gpu-price-per-hour: expected a positive number"):
        ControllerConfig(gpu_price_per_hour=bad).validate()


def test_the_shipped_default_policy_makes_a_cost_move_on_a_priced_fleet(store: Store) -> None:
    """policies/examples/default.yaml, with the priors an operator adds (cold starts and
    capacities), on a fleet priced by --gpu-price-per-hour: an estimate, and a move."""
    default = (Path(__file__).resolve().parents[3] / "policies" / "examples"
               / "default.yaml").read_text()
    text = default + ('  models:\n    "*":\n      gpusPerReplica: 8\n      engines:\n'
                      '        vllm: {coldStart: 210s, capacityRps: 10}\n'
                      '        tensorrt-llm: {coldStart: 240s, build: 30m, capacityRps: 11.6}\n')
    for price, moves in ((None, 0), (4.0, 1)):
        loop = _loop(store, fleet_price=price)
        loop.fleet.started = NOW - 3 * 86400  # on vLLM for three days: past minDwell
        loop.policies.apply(text, "default.yaml", "test", "")
        rows = loop.evaluate(NOW)
        assert len(rows) == moves, rows
    row = rows[0]
    assert (row.rule, row.to_engine, row.inputs["price_per_gpu_hour"]) == ("cost", "tensorrt-llm", 4.0)
    assert row.expected["net_savings_usd"] > row.inputs["margin_usd"] > 0
