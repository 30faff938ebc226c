"""The capacity rule shared by the live loop and the blind backtest: measured figures
first, else the policy's priors or the default ratio, each saying where it came from."""

from __future__ import annotations

import pytest

from gearshift.policies.priors import (
    DEFAULT_PRIOR_RATIO_RANGE,
    EngineCapacity,
    Measurement,
    citations,
    resolve_capacities,
)
from gearshift.policies.schema import EnginePriors

TOO_LITTLE = "too little data on tensorrt-llm: 3 observation(s), need 72 (6 h)"


def measured(value: float, source: str = "measured", low: float | None = None,
             high: float | None = None) -> Measurement:
    return Measurement(EngineCapacity(value, low, high, source))


def test_one_engine_measured_the_other_gets_the_default_ratio_with_its_interval() -> None:
    caps = resolve_capacities({"vllm": measured(10.0, low=9.0, high=11.0),
                               "tensorrt-llm": Measurement(why=TOO_LITTLE)}, {})
    assert caps["vllm"].source == "measured" and caps["vllm"].capacity_rps == 10.0
    trt = caps["tensorrt-llm"]
    assert trt.source == "default-ratio" and trt.base == "vllm"
    assert trt.capacity_rps == pytest.approx(10.5) and trt.ratio == pytest.approx(1.05)
    lo, hi = DEFAULT_PRIOR_RATIO_RANGE["tensorrt-llm"]
    assert (trt.ratio_low, trt.ratio_high) == (pytest.approx(lo), pytest.approx(hi))
    assert trt.low == pytest.approx(9.0 * lo) and trt.high == pytest.approx(11.0 * hi)
    assert "default ratio" in trt.note and trt.note.endswith(TOO_LITTLE)


def test_the_default_ratio_works_the_other_way_round() -> None:
    caps = resolve_capacities({"tensorrt-llm": measured(10.5)}, {})
    vllm = caps["vllm"]
    assert vllm.source == "default-ratio" and vllm.capacity_rps == pytest.approx(10.0)
    assert vllm.ratio_low is not None and vllm.ratio_high is not None
    assert vllm.ratio_low < 1 / 1.05 < vllm.ratio_high


def test_two_priors_give_a_ratio_a_lone_prior_is_taken_as_is() -> None:
    both = {"vllm": EnginePriors(capacityRps=10.0), "tensorrt-llm": EnginePriors(capacityRps=12.0)}
    caps = resolve_capacities({"vllm": measured(8.0)}, both)
    assert caps["tensorrt-llm"].source == "ratio-prior"
    assert caps["tensorrt-llm"].capacity_rps == pytest.approx(9.6)
    assert caps["tensorrt-llm"].ratio == pytest.approx(1.2)
    lone = resolve_capacities({"vllm": measured(8.0)}, {"tensorrt-llm": EnginePriors(capacityRps=12.0)})
    assert (lone["tensorrt-llm"].source, lone["tensorrt-llm"].capacity_rps) == ("prior", 12.0)
    assert lone["tensorrt-llm"].ratio is None


def test_nothing_measured_uses_absolute_priors_or_says_unknown() -> None:
    caps = resolve_capacities({"vllm": Measurement(why="vllm not measured: no latency observed")},
                              {"vllm": EnginePriors(capacityRps=9.0)})
    assert (caps["vllm"].source, caps["vllm"].capacity_rps) == ("prior", 9.0)
    assert caps["vllm"].note.endswith("vllm not measured: no latency observed")
    assert caps["tensorrt-llm"].source == "unknown" and caps["tensorrt-llm"].capacity_rps is None


def test_a_lower_bound_raises_a_prior_never_lowers_it() -> None:
    prior = {"vllm": EnginePriors(capacityRps=10.0)}
    low = resolve_capacities({"vllm": measured(8.0, "lower_bound")}, prior)
    assert (low["vllm"].source, low["vllm"].capacity_rps) == ("prior", 10.0)
    high = resolve_capacities({"vllm": measured(12.0, "lower_bound")}, prior)
    assert (high["vllm"].source, high["vllm"].capacity_rps) == ("lower_bound", 12.0)
    # The other engine scales from what the first one resolved to.
    assert low["tensorrt-llm"].capacity_rps == pytest.approx(10.5)


def test_a_bound_that_only_shows_the_traffic_wins_only_when_higher() -> None:
    floor = Measurement(EngineCapacity(20.0, 20.0, None, "lower_bound", "never scaled out"),
                        bounds_only=True)
    caps = resolve_capacities({"vllm": measured(10.0), "tensorrt-llm": floor}, {})
    assert caps["tensorrt-llm"].capacity_rps == 20.0 and caps["tensorrt-llm"].source == "lower_bound"
    small = Measurement(EngineCapacity(2.0, 2.0, None, "lower_bound"), bounds_only=True)
    caps = resolve_capacities({"vllm": measured(10.0), "tensorrt-llm": small}, {})
    assert caps["tensorrt-llm"].source == "default-ratio"
    alone = resolve_capacities({"vllm": floor}, {})
    assert alone["vllm"].capacity_rps == 20.0 and alone["tensorrt-llm"].source == "unknown"


def test_citations_name_source_ratio_and_interval() -> None:
    cite = citations(resolve_capacities({"vllm": measured(10.0)}, {}))
    assert cite["capacity_source.vllm"] == "measured" and "capacity_ratio.vllm" not in cite
    assert cite["capacity_source.tensorrt-llm"] == "default-ratio"
    assert cite["capacity_ratio_base.tensorrt-llm"] == "vllm"
    assert cite["capacity_ratio.tensorrt-llm"] == pytest.approx(1.05)
    assert cite["capacity_ratio_low.tensorrt-llm"] is not None
