"""Property tests: arbitrary input never escapes the parse/scrape API as an unexpected error."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gearshift.agents.metrics import (
    EngineSnapshot,
    MetricsParseError,
    RateCalculator,
    SkipReason,
    parse_prometheus_text,
    parse_trtllm_json,
    read_engine_metrics,
)
from gearshift.common.engines import ENGINE_NAMES, MetricFormat, engine_entry

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

KNOWN_NAMES = [
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "trtllm_e2e_request_latency_seconds_bucket",
    "time_per_output_token_seconds_bucket",
]
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["NaN", "+Inf", "-Inf", "-1", "1e308", "0"]),
)
LABEL_VALUES = st.sampled_from(["0.1", "+Inf", "abc", "", "stop", "abort", "used", "max"])


@st.composite
def metric_lines(draw: st.DrawFn) -> str:
    """Prometheus-looking text over the names the parser uses, with hostile values."""
    lines = []
    for _ in range(draw(st.integers(0, 12))):
        name = draw(st.sampled_from(KNOWN_NAMES))
        label = draw(st.sampled_from(["le", "finished_reason", "kv_cache_block_type", "engine"]))
        lines.append(f'{name}{{{label}="{draw(LABEL_VALUES)}"}} {draw(VALUES)}')
    return "\n".join(lines) + "\n"


json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "numActiveRequests",
                    "numQueuedRequests",
                    "numCompletedRequests",
                    "iterLatencyMS",
                    "kvCacheStats",
                    "usedNumBlocks",
                    "maxNumBlocks",
                    "x",
                ]
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=12,
)


def _parses_or_names_reason(parse: Any, text: str) -> None:
    try:
        snapshot = parse(text)
    except MetricsParseError as exc:
        assert exc.message
        assert isinstance(exc.reason, SkipReason)
        return
    assert isinstance(snapshot, EngineSnapshot)
    for skip in snapshot.skips:
        assert isinstance(skip.reason, SkipReason) and skip.detail


@FAST
@given(st.text(max_size=300))
def test_arbitrary_text_parses_or_raises_a_named_parse_error(text: str) -> None:
    _parses_or_names_reason(parse_prometheus_text, text)
    _parses_or_names_reason(parse_trtllm_json, text)


@FAST
@given(metric_lines())
def test_hostile_values_on_known_names_never_escape(text: str) -> None:
    _parses_or_names_reason(parse_prometheus_text, text)


@FAST
@given(json_values)
def test_arbitrary_json_documents_parse_or_raise_a_named_parse_error(document: Any) -> None:
    _parses_or_names_reason(parse_trtllm_json, json.dumps(document))


@FAST
@given(
    st.sampled_from(ENGINE_NAMES),
    st.one_of(st.none(), st.text(max_size=200), metric_lines()),
    st.one_of(st.none(), st.text(max_size=200), json_values.map(json.dumps)),
)
def test_read_engine_metrics_never_raises_and_explains_empty_results(
    engine: str, text: str | None, body: str | None
) -> None:
    endpoints = engine_entry(engine).metric_endpoints
    bodies = {ep.path: body if ep.format is MetricFormat.TRTLLM_ITERATIONS else text
              for ep in endpoints}
    snapshot, skips = read_engine_metrics(engine, bodies)
    given = [ep for ep in endpoints if bodies[ep.path]]
    if snapshot is None and given:
        # Only an optional endpoint (not enabled on the server) may come back silently empty.
        assert skips or all(ep.optional for ep in given)
    for skip in skips:
        assert isinstance(skip.reason, SkipReason)


OVERFLOW = (
    'vllm:request_success_total{finished_reason="stop"} 1e308\n'
    'vllm:request_success_total{finished_reason="abort"} 1e308\n'
    'vllm:time_to_first_token_seconds_bucket{le="+Inf",engine="1"} 1e308\n'
    'vllm:time_to_first_token_seconds_bucket{le="+Inf",engine="2"} 1e308\n'
)


@FAST
@given(st.lists(st.tuples(metric_lines(), st.floats(0.0, 1e6)), min_size=1, max_size=6))
@example([(OVERFLOW, 1.0), (OVERFLOW, 2.0)])
def test_rates_are_never_negative_or_nan(scrapes: list[tuple[str, float]]) -> None:
    calculator = RateCalculator()
    for text, now in scrapes:
        try:
            snapshot = parse_prometheus_text(text)
        except MetricsParseError:
            continue
        sample = calculator.update(snapshot, now)
        for value in (
            sample.request_rate,
            sample.prompt_tokens_per_s,
            sample.generation_tokens_per_s,
            sample.running_requests,
            sample.waiting_requests,
            sample.kv_cache_usage,
        ):
            assert value >= 0 and not math.isnan(value)
        assert 0.0 <= sample.kv_cache_usage <= 1.0
        for quantiles in (sample.ttft, sample.itl, sample.e2e):
            if quantiles.present:
                assert quantiles.count > 0
                assert quantiles.p50_s >= 0 and not math.isnan(quantiles.p50_s)
