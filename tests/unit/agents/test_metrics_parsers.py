"""Engine metric parsers against the real captured outputs and hand-written variants."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fixture_paths import ENGINE_METRICS
from gearshift.agents.metrics import (
    EngineSnapshot,
    MetricsParseError,
    SkipReason,
    parse_prometheus_text,
    parse_trtllm_json,
)

DOCS_EXAMPLE = "trtllm-serve-main-docs-metrics-example.txt"


def _repo_root() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file():
            return parent
    raise AssertionError(f"no pyproject.toml above {here}")


FIXTURES = ENGINE_METRICS
needs_fixtures = pytest.mark.skipif(
    not FIXTURES.is_dir(), reason=f"engine metric fixtures not found at {FIXTURES}"
)


# Captures of an engine outside the catalog (Triton's `nv_*` families): kept, read as nothing.
OUTSIDE_CATALOG = ("triton-trtllm-backend-metrics.txt",
                   "triton-trtllm-backend-base-nv_inference-metrics.txt")


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def _fixture_names() -> list[str]:
    if not FIXTURES.is_dir():
        return []
    return sorted(p.name for p in FIXTURES.iterdir() if p.suffix in {".txt", ".json"})


@needs_fixtures
def test_fixture_folder_has_the_known_captures() -> None:
    names = set(_fixture_names())
    assert "vllm-0.11-metrics.txt" in names
    assert DOCS_EXAMPLE in names
    assert len(names) >= 7


@needs_fixtures
@pytest.mark.parametrize("name", [n for n in _fixture_names() if n not in OUTSIDE_CATALOG])
def test_every_fixture_parses_or_is_rejected_clearly(name: str) -> None:
    text = _fixture(name)
    if name == DOCS_EXAMPLE:
        with pytest.raises(MetricsParseError, match="line 18"):
            parse_trtllm_json(text)
        return
    if text.lstrip().startswith(("[", "{")):
        snapshot = parse_trtllm_json(text)
    else:
        snapshot = parse_prometheus_text(text)
    assert isinstance(snapshot, EngineSnapshot)
    assert snapshot.has_data(), f"{name}: no known metric found"
    assert snapshot.skips == ()


@needs_fixtures
def test_vllm_011_scrape_maps_every_field() -> None:
    snapshot = parse_prometheus_text(_fixture("vllm-0.11-metrics.txt"))
    assert snapshot.requests_finished == 0.0
    assert snapshot.request_errors == 0.0
    assert snapshot.prompt_tokens == 0.0
    assert snapshot.generation_tokens == 0.0
    assert snapshot.running == 0.0
    assert snapshot.waiting == 0.0
    assert snapshot.kv_cache_usage == 0.0
    assert snapshot.ttft is not None and snapshot.ttft.buckets[0] == (0.001, 0.0)
    assert snapshot.ttft.buckets[-1][0] == math.inf
    # Both ITL generations are in this scrape; the new name's buckets start at 0.01.
    assert snapshot.itl is not None and snapshot.itl.buckets[0][0] == 0.01
    assert snapshot.e2e is not None and snapshot.e2e.buckets[0][0] == 0.3


@needs_fixtures
def test_trtllm_json_object_from_issue_6364() -> None:
    snapshot = parse_trtllm_json(_fixture("trtllm-serve-1.0.0rc4-trt-backend-metrics-object.json"))
    assert snapshot.running == 1.0
    assert snapshot.waiting == 0.0
    assert snapshot.kv_cache_usage == pytest.approx(3 / 22955)
    assert snapshot.completed_in_window == 0.0
    assert snapshot.iter_latency_s == pytest.approx(0.013021209)


@needs_fixtures
def test_docs_example_is_rejected_naming_the_ellipsis_and_a_repaired_copy_parses() -> None:
    text = _fixture(DOCS_EXAMPLE)
    with pytest.raises(MetricsParseError) as caught:
        parse_trtllm_json(text)
    message = str(caught.value)
    assert "not valid JSON at line 18" in message
    assert "'...'" in message
    assert caught.value.reason is SkipReason.UNPARSEABLE

    repaired_lines = [line for line in text.splitlines() if line.strip() != "..."]
    repaired = "\n".join(repaired_lines)
    json.loads(repaired)  # the repair gives valid JSON
    snapshot = parse_trtllm_json(repaired)
    assert snapshot.running == 1.0
    assert snapshot.waiting is None
    assert snapshot.kv_cache_usage == pytest.approx(3 / 101256)
    assert snapshot.iter_latency_s == pytest.approx(0.00700688362121582)


@needs_fixtures
def test_a_page_of_an_engine_outside_the_catalog_gives_no_figures() -> None:
    """Triton's `nv_*` families name no figure of any catalog entry: nothing is read."""
    for name in OUTSIDE_CATALOG:
        assert parse_prometheus_text(_fixture(name)) == EngineSnapshot()


@needs_fixtures
def test_trtllm_prometheus_excerpts_unprefixed() -> None:
    aibrix = parse_prometheus_text(
        _fixture("trtllm-serve-prometheus-metrics-excerpt-aibrix-2004.txt")
    )
    assert aibrix.e2e is not None
    assert aibrix.e2e.sum == pytest.approx(3.4878239994868636)
    assert aibrix.e2e.buckets[-1][0] == math.inf  # the partial excerpt gets a +Inf bucket
    pr = parse_prometheus_text(_fixture("trtllm-serve-prometheus-metrics-excerpt-pr5785.txt"))
    assert pr.ttft is not None and pr.ttft.count == 2.0
    assert pr.ttft.buckets[0] == (2.5, 2.0)


def _gauge(name: str, value: str, labels: str = 'model_name="m",engine="0"') -> str:
    return f"# TYPE {name} gauge\n{name}{{{labels}}} {value}\n"


def _histogram(name: str, counts: dict[str, float], total: float) -> str:
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{le="{le}"}} {count}' for le, count in counts.items()]
    lines += [f"{name}_sum {total}", f"{name}_count {max(counts.values())}"]
    return "\n".join(lines) + "\n"


def test_old_vllm_names_are_accepted() -> None:
    text = _gauge("vllm:gpu_cache_usage_perc", "0.25") + _histogram(
        "vllm:time_per_output_token_seconds", {"0.1": 3, "+Inf": 4}, 0.5
    )
    snapshot = parse_prometheus_text(text)
    assert snapshot.kv_cache_usage == 0.25
    assert snapshot.itl is not None and snapshot.itl.count == 4


def test_new_vllm_names_win_when_both_generations_are_present() -> None:
    text = (
        _gauge("vllm:gpu_cache_usage_perc", "0.25")
        + _gauge("vllm:kv_cache_usage_perc", "0.75")
        + _histogram("vllm:time_per_output_token_seconds", {"0.1": 3, "+Inf": 4}, 0.5)
        + _histogram("vllm:inter_token_latency_seconds", {"0.2": 7, "+Inf": 9}, 1.5)
    )
    snapshot = parse_prometheus_text(text)
    assert snapshot.kv_cache_usage == 0.75
    assert snapshot.itl is not None and snapshot.itl.count == 9
    assert snapshot.itl.buckets[0] == (0.2, 7)


def test_request_success_sums_finish_reasons_and_counts_aborts_as_errors() -> None:
    text = "# TYPE vllm:request_success_total counter\n" + "".join(
        f'vllm:request_success_total{{finished_reason="{reason}",model_name="m"}} {n}\n'
        for reason, n in (("stop", 10), ("length", 5), ("abort", 2), ("error", 1))
    )
    snapshot = parse_prometheus_text(text)
    assert snapshot.requests_finished == 18
    assert snapshot.request_errors == 3


@pytest.mark.parametrize("prefix", ["", "trtllm_"])
def test_trtllm_names_with_and_without_prefix(prefix: str) -> None:
    text = (
        f"# TYPE {prefix}request_success_total counter\n"
        f'{prefix}request_success_total{{model_name="m",finished_reason="stop"}} 7\n'
        + _histogram(f"{prefix}time_to_first_token_seconds", {"0.5": 2, "+Inf": 3}, 1.0)
        + _histogram(f"{prefix}time_per_output_token_seconds", {"0.05": 5, "+Inf": 5}, 0.1)
        + _histogram(f"{prefix}e2e_request_latency_seconds", {"1.0": 1, "+Inf": 3}, 4.0)
    )
    snapshot = parse_prometheus_text(text)
    assert snapshot.requests_finished == 7
    assert snapshot.ttft is not None and snapshot.ttft.count == 3
    assert snapshot.itl is not None and snapshot.itl.count == 5
    assert snapshot.e2e is not None and snapshot.e2e.sum == 4.0


def test_histograms_are_summed_over_engines() -> None:
    text = (
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0"} 2\n'
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf"} 3\n'
        'vllm:e2e_request_latency_seconds_bucket{engine="1",le="1.0"} 4\n'
        'vllm:e2e_request_latency_seconds_bucket{engine="1",le="+Inf"} 4\n'
        'vllm:e2e_request_latency_seconds_count{engine="0"} 3\n'
        'vllm:e2e_request_latency_seconds_count{engine="1"} 4\n'
    )
    snapshot = parse_prometheus_text(text)
    assert snapshot.e2e is not None
    assert snapshot.e2e.buckets == ((1.0, 6.0), (math.inf, 7.0))
    assert snapshot.e2e.count == 7
    assert snapshot.e2e.sum is None


@pytest.mark.parametrize(
    ("value", "reason"),
    [("NaN", SkipReason.NON_FINITE), ("+Inf", SkipReason.NON_FINITE), ("-3", SkipReason.NEGATIVE)],
)
def test_bad_values_skip_the_series_with_a_reason(value: str, reason: SkipReason) -> None:
    text = _gauge("vllm:num_requests_running", value) + _gauge("vllm:num_requests_waiting", "2")
    snapshot = parse_prometheus_text(text)
    assert snapshot.running is None
    assert snapshot.waiting == 2
    assert [skip.reason for skip in snapshot.skips] == [reason]
    assert "vllm:num_requests_running" in snapshot.skips[0].detail


def test_bad_bucket_drops_the_histogram_and_bad_le_is_named() -> None:
    nan_bucket = _histogram("vllm:time_to_first_token_seconds", {"0.1": math.nan, "+Inf": 1}, 1)
    assert parse_prometheus_text(nan_bucket).ttft is None
    bad_le = 'vllm:time_to_first_token_seconds_bucket{le="soon"} 1\n'
    snapshot = parse_prometheus_text(bad_le)
    assert snapshot.ttft is None
    assert snapshot.skips[0].reason is SkipReason.BAD_LABEL
    assert 'le="soon"' in snapshot.skips[0].detail


def test_kv_fraction_above_one_is_out_of_range() -> None:
    snapshot = parse_prometheus_text(_gauge("vllm:kv_cache_usage_perc", "87"))
    assert snapshot.kv_cache_usage is None
    assert snapshot.skips[0].reason is SkipReason.OUT_OF_RANGE


def test_garbage_text_is_rejected_naming_the_line() -> None:
    text = _gauge("vllm:num_requests_running", "1") + "this is not a metric line\n"
    with pytest.raises(MetricsParseError, match=r"line 3 \('this is not a metric line'\)"):
        parse_prometheus_text(text, source="GET http://h/metrics")


def test_empty_text_has_no_data() -> None:
    assert not parse_prometheus_text("").has_data()


def test_trtllm_json_drained_array_takes_newest_gauges_and_sums_completions() -> None:
    body = json.dumps(
        [
            {"numActiveRequests": 4, "numQueuedRequests": 2, "numCompletedRequests": 1,
             "iterLatencyMS": 10.0, "kvCacheStats": {"usedNumBlocks": 10, "maxNumBlocks": 100}},
            {"numActiveRequests": 3, "numQueuedRequests": 0, "numCompletedRequests": 2,
             "iterLatencyMS": 30.0, "kvCacheStats": {"usedNumBlocks": 20, "maxNumBlocks": 100}},
        ]
    )  # fmt: skip
    snapshot = parse_trtllm_json(body)
    assert (snapshot.running, snapshot.waiting) == (3, 0)
    assert snapshot.kv_cache_usage == pytest.approx(0.2)
    assert snapshot.completed_in_window == 3
    assert snapshot.iter_latency_s == pytest.approx(0.02)


def test_trtllm_json_empty_array_is_no_samples() -> None:
    snapshot = parse_trtllm_json("[]")
    assert not snapshot.has_data()
    assert snapshot.skips == ()


def test_trtllm_json_wrong_types_are_skipped_with_reasons() -> None:
    body = json.dumps(
        [
            "not an object",
            {"numActiveRequests": "3", "numQueuedRequests": True, "numCompletedRequests": -1,
             "kvCacheStats": {"usedNumBlocks": 5, "maxNumBlocks": 0}},
            {"kvCacheStats": [1, 2]},
        ]
    )  # fmt: skip
    snapshot = parse_trtllm_json(body)
    assert not snapshot.has_data()
    reasons = [skip.reason for skip in snapshot.skips]
    assert reasons == [
        SkipReason.WRONG_TYPE,
        SkipReason.WRONG_TYPE,
        SkipReason.WRONG_TYPE,
        SkipReason.OUT_OF_RANGE,
        SkipReason.NEGATIVE,
        SkipReason.WRONG_TYPE,
    ]
    assert "[1].numActiveRequests: expected a number, got a string" in snapshot.skips[1].detail


def test_trtllm_json_nan_is_non_finite() -> None:
    snapshot = parse_trtllm_json('[{"numActiveRequests": NaN}]')
    assert snapshot.running is None
    assert snapshot.skips[0].reason is SkipReason.NON_FINITE


@pytest.mark.parametrize("body", ['"text"', "42", "null", "true"])
def test_trtllm_json_top_level_must_be_an_array(body: str) -> None:
    with pytest.raises(MetricsParseError, match="expected a JSON array") as caught:
        parse_trtllm_json(body)
    assert caught.value.reason is SkipReason.WRONG_TYPE


def test_trtllm_json_huge_numbers_and_deep_nesting_are_reported_not_raised() -> None:
    huge = parse_trtllm_json('[{"numActiveRequests": 1' + "0" * 400 + "}]")
    assert huge.running is None
    assert huge.skips[0].reason is SkipReason.NON_FINITE
    with pytest.raises(MetricsParseError, match="not valid JSON"):
        parse_trtllm_json("[" * 100_000)
    with pytest.raises(MetricsParseError, match="not valid JSON"):
        parse_trtllm_json("[" + "1" * 5000 + "]")  # beyond Python's integer digit limit
