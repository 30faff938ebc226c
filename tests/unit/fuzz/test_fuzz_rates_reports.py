"""Property tests on the rate calculator and the controller's report check.

Rates are never negative and never above what the counters can explain (the sum of
each series' current value over the interval), whatever the engines' processes do;
a report either passes the check with every figure in range, or is refused with an
`InvalidArgument` and leaves the fleet as it was."""

from __future__ import annotations

import copy
import ipaddress
import math

from hypothesis import given
from hypothesis import strategies as st

from fuzz_settings import FUZZ
from gearshift.agents.metrics import RateCalculator, parse_prometheus_text
from gearshift.cli.output import escape_controls
from gearshift.common.errors import InvalidArgument
from gearshift.controller.api.validation import (
    MAX_LATENCY_S,
    MAX_REQUEST_RATE_PER_GPU,
    check_report,
)
from gearshift.controller.ingest.fleet import FleetState
from gearshift.v1 import agent_pb2

COUNTER_VALUES = st.one_of(
    st.floats(min_value=0, max_value=1e12, allow_nan=False),
    st.sampled_from([math.nan, math.inf, -1.0, 0.0, 1e300]),
)


def body(values: list[float], kv: float) -> str:
    lines = ["# TYPE vllm:request_success_total counter"]
    lines += [f'vllm:request_success_total{{engine="{i}",finished_reason="stop"}} {v!r}'
              for i, v in enumerate(values)]
    lines += ["# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc {kv!r}", ""]
    return "\n".join(lines).replace("nan", "NaN").replace("inf", "Inf")


@FUZZ
@given(scrapes=st.lists(st.tuples(st.lists(COUNTER_VALUES, min_size=1, max_size=3),
                                  st.floats(min_value=0.001, max_value=3600),
                                  st.floats(allow_nan=True, allow_infinity=True)),
                        min_size=2, max_size=8))
def test_rates_are_never_negative_nor_above_what_the_counters_explain(
        scrapes: list[tuple[list[float], float, float]]) -> None:
    calc = RateCalculator()
    now = 0.0
    last_good: tuple[float, float] | None = None  # (time, summed counters) of the base
    for values, step_s, kv in scrapes:
        now += step_s
        snapshot = parse_prometheus_text(body(values, kv))
        sample = calc.update(snapshot, now)
        assert sample.request_rate >= 0 and math.isfinite(sample.request_rate)
        assert 0 <= sample.kv_cache_usage <= 1
        if sample.metrics_present:
            assert last_good is not None
            interval_s = now - last_good[0]
            assert sample.interval_s == interval_s
            bound = sum(values) / interval_s
            assert sample.request_rate <= bound * (1 + 1e-9) + 1e-9
        if not sample.refused:
            last_good = (now, sum(values))


PEERS = [None, ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.0.0.5")]
ENDPOINTS = st.one_of(
    st.sampled_from(["", "http://127.0.0.1:8000", "https://10.0.0.5:443", "http://h1:8000",
                     "javascript:alert(1)", "http://10.0.0.6:80", "http://[::1]:80",
                     "http://0.0.0.0:80", "http://127.0.0.1:0", "http://127.0.0.1:8000/#x",
                     "http://localhost:1", "ftp://127.0.0.1:21", "http://a@127.0.0.1:1"]),
    st.text(max_size=40))
# Names as agents send them, as attackers do: escapes, NUL, very long ones.
NAMES = st.one_of(st.sampled_from(["m", "meta-llama/Llama-3.3-70B-Instruct", "m\x1b[2J",
                                   "m\x1b]52;c;eA==\x07", "m\x00", "x" * 300, "\x9b1m"]),
                  st.text(max_size=300))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(min_value=0, max_value=100))


@st.composite
def reports(draw: st.DrawFn) -> agent_pb2.Report:
    r = agent_pb2.Report(seq=draw(st.integers(min_value=0, max_value=3)),
                         interval_s=draw(FLOATS))
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        r.gpus.add(utilization=draw(FLOATS), temperature_c=draw(FLOATS), power_w=draw(FLOATS),
                   memory_total_bytes=draw(st.integers(0, 2**40)),
                   memory_used_bytes=draw(st.integers(0, 2**41)))
    for i in range(draw(st.integers(min_value=0, max_value=3))):
        d = r.deployments.add(
            deployment_id=draw(st.sampled_from(["d0", "d1", f"d{i}", ""])),
            engine=draw(st.sampled_from(["vllm", "tensorrt-llm", "sglang"])),
            model=draw(NAMES) or "m", revision=draw(NAMES), source=draw(NAMES),
            phase=draw(st.integers(min_value=0, max_value=99)), endpoint=draw(ENDPOINTS),
            request_rate=draw(st.one_of(FLOATS, st.floats(0, 1e6))),
            running_requests=draw(FLOATS), waiting_requests=draw(FLOATS),
            prompt_tokens_per_s=draw(FLOATS), generation_tokens_per_s=draw(FLOATS),
            kv_cache_usage=draw(FLOATS), tensor_parallel_size=draw(st.integers(0, 8)))
        d.ttft.p99_s = draw(FLOATS)
    return r


@FUZZ
@given(report=reports(), peer=st.sampled_from(PEERS))
def test_a_report_passes_in_range_or_is_refused_without_a_change(
        report: agent_pb2.Report, peer: ipaddress.IPv4Address | None) -> None:
    fleet = FleetState(clock=lambda: 100.0)
    fleet.hello(agent_pb2.Hello(host_id="h1", protocol_version=agent_pb2.PROTOCOL_VERSION_1), 1.0)
    before = copy.deepcopy(fleet.hosts["h1"].deployments), fleet.routing_table()
    try:
        check_report(report, "h1", peer, [])
    except InvalidArgument as err:
        assert err.message
        assert (fleet.hosts["h1"].deployments, fleet.routing_table()) == before
        return
    assert math.isfinite(report.interval_s) and report.interval_s >= 0
    ids = [d.deployment_id for d in report.deployments]
    assert len(set(ids)) == len(ids) and all(ids)
    for d in report.deployments:
        gpus = max(1, len(d.gpu_indices), d.tensor_parallel_size)
        assert 0 <= d.request_rate <= MAX_REQUEST_RATE_PER_GPU * gpus
        assert 0 <= d.kv_cache_usage <= 1 and 0 <= d.ttft.p99_s <= MAX_LATENCY_S
        assert d.endpoint == "" or d.endpoint.startswith(("http://", "https://"))
        for name, limit in (("model", 256), ("revision", 128), ("source", 1024)):
            value = getattr(d, name)
            assert len(value) <= limit and escape_controls(value) == value
    for g in report.gpus:
        assert 0 <= g.utilization <= 1 and math.isfinite(g.temperature_c)
    fleet.report("h1", report)  # what passed applies without an error
    fleet.routing_table()
