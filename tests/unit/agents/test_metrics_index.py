"""The quick pass over Prometheus text reads exactly what the library's parse reads.

A page is parsed twice: as it is (the quick pass, when every line is in the strict
form) and with one more line the quick pass does not take (a sample with a
timestamp, which the library accepts), which sends the whole page through
`prometheus_client`. Snapshots, skips and errors must be the same. Pages read one
after another through a scraper's `LineCache` read as each page read alone.
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fixture_paths import ENGINE_METRICS
from gearshift.agents.metrics import MetricsParseError, parse_prometheus_text
from gearshift.agents.metrics.prometheus_index import LineCache, index_samples

LIBRARY_ONLY_LINE = "gearshift_probe_unread 1 1700000000000\n"  # a timestamp: not the strict form
PROMETHEUS_PAGES = sorted(p for p in ENGINE_METRICS.glob("*.txt")
                          if not p.read_text().lstrip().startswith(("[", "{")))


def _outcome(text: str, cache: LineCache | None = None) -> str:
    try:  # repr: NaN and -0.0 compare
        return repr(parse_prometheus_text(text, source="page", cache=cache))
    except MetricsParseError as exc:
        return f"error: {exc.message}"


def _same_either_way(text: str) -> None:
    quick, library = _outcome(text), _outcome(text + LIBRARY_ONLY_LINE)
    assert quick == library, f"quick pass:\n{quick}\nlibrary:\n{library}"


def test_the_captured_engine_pages_take_the_quick_pass_and_read_the_same() -> None:
    assert PROMETHEUS_PAGES, f"no Prometheus text fixtures under {ENGINE_METRICS}"
    for page in PROMETHEUS_PAGES:
        text = page.read_text(encoding="utf-8")
        if page.name.startswith("trtllm-serve-main-docs"):
            continue  # a JSON document with a '...' line, not Prometheus text
        assert index_samples(text) is not None, page.name
        _same_either_way(text)


NAMES = ["vllm:request_success", "vllm:request_success_total", "vllm:num_requests_running",
         "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
         "vllm:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_sum",
         "trtllm_e2e_request_latency_seconds_bucket", "nv_trt_llm_kv_cache_block_metrics",
         "nv_inference_request_success", "prompt_tokens_total", "unread_metric", "9bad", "a-b"]
LABEL_NAMES = ["le", "finished_reason", "kv_cache_block_type", "model", "engine", "__name__",
               "_x", "2x"]
LABEL_VALUES = ["0.1", "+Inf", "stop", "abort", "used", "max", "tensorrt_llm", "", 'a\\"b',
                "a\\nb", "a\\\\", "a\\tb", "a,b=\\\"c", "}"]
VALUES = ["0", "-0", "1", "+5", "2.5", "1e3", "-1", "1e308", "NaN", "nan", "+Inf", "-Inf",
          "Inf", ".5", "5.", "1_0", "0x10", "abc", "1e"]
COMMENTS = ["# HELP vllm:request_success Finished requests.", "# TYPE vllm:request_success counter",
            "# TYPE vllm:time_to_first_token_seconds histogram", "# TYPE unread_metric gauge",
            "# TYPE nv_inference_request_success counter", "# TYPE x untyped", "# TYPE x bogus",
            "# TYPE x", "# HELP", "# HELP 9bad doc", "# a comment", "#", "#no space", ""]


@st.composite
def pages(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 10))):
        if draw(st.integers(0, 4)) == 0:
            lines.append(draw(st.sampled_from(COMMENTS)))
            continue
        labels = [f'{draw(st.sampled_from(LABEL_NAMES))}="{draw(st.sampled_from(LABEL_VALUES))}"'
                  for _ in range(draw(st.integers(0, 3)))]
        written = "{" + draw(st.sampled_from([",", ", "])).join(labels) + "}" if labels else ""
        if not labels and draw(st.booleans()):
            written = "{}"
        sep = draw(st.sampled_from([" ", "  ", "\t"]))
        stamp = draw(st.sampled_from(["", "", " 1700000000000"]))
        lines.append(f"{draw(st.sampled_from(NAMES))}{written}{sep}{draw(st.sampled_from(VALUES))}"
                     f"{stamp}")
    return "\n".join(lines) + "\n"


STRICT_LABEL_NAMES = ["le", "finished_reason", "kv_cache_block_type", "model", "engine", "_x"]
STRICT_LABEL_VALUES = [v for v in LABEL_VALUES if v != "a\\tb"]
STRICT_VALUES = [v for v in VALUES if v not in ("1_0", "0x10", "abc", "1e")]
STRICT_COMMENTS = [*COMMENTS[:5], "# a comment", "#", ""]


@st.composite
def strict_pages(draw: st.DrawFn) -> str:
    """Pages in the quick pass's strict form, over the names and labels the reader uses."""
    lines = []
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.integers(0, 5)) == 0:
            lines.append(draw(st.sampled_from(STRICT_COMMENTS)))
            continue
        names = draw(st.lists(st.sampled_from(STRICT_LABEL_NAMES), max_size=3, unique=True))
        labels = ",".join(f'{n}="{draw(st.sampled_from(STRICT_LABEL_VALUES))}"' for n in names)
        lines.append(f"{draw(st.sampled_from(NAMES[:-2]))}{{{labels}}} "
                     f"{draw(st.sampled_from(STRICT_VALUES))}")
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strict_pages())
def test_strict_pages_take_the_quick_pass_and_read_as_the_library_reads_them(text: str) -> None:
    assert index_samples(text) is not None
    _same_either_way(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pages())
@example("# TYPE vllm:request_success counter\nvllm:request_success 1\n"
         "vllm:request_success_total 2\n")  # one name in both spellings
@example('vllm:num_requests_running{model="a",model="b"} 1\n')  # a repeated label
@example("vllm:num_requests_running -0\n")
@example("this is not a metric line\n")
def test_any_page_reads_the_same_through_the_quick_pass_and_the_library(text: str) -> None:
    _same_either_way(text)


@st.composite
def page_sequences(draw: st.DrawFn) -> list[str]:
    """Pages that share lines (as an engine's successive scrapes do), in any order, some
    repeated, some outside the strict form."""
    pool = draw(st.lists(st.one_of(pages(), strict_pages()), min_size=1, max_size=3))
    lines = [line for page in pool for line in page.split("\n")]
    return ["\n".join(draw(st.lists(st.sampled_from(lines), max_size=14))) + "\n"
            for _ in range(draw(st.integers(2, 5)))]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_sequences())
@example(["# TYPE vllm:request_success counter\nvllm:request_success 1\n",
          "vllm:request_success 1\nvllm:request_success_total 2\n"])  # the TYPE line went
@example(['vllm:num_requests_running{model="a"} 1\n',
          'vllm:num_requests_running{model="a"} 1\nvllm:num_requests_running{model="a"} 1\n'])
@example(["# TYPE vllm:request_success counter\nvllm:request_success 1\n"  # a typed counter,
          "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
          "vllm:request_success 2\n"] * 2)  # then the same name in an untyped family
@example(["vllm:request_success 1\n# TYPE vllm:num_requests_running gauge\n"
          "vllm:num_requests_running 0\nvllm:request_success 2\n",
          "# TYPE vllm:request_success counter\nvllm:request_success 1\n"  # the same lines,
          "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"  # now typed
          "vllm:request_success 2\n"])
def test_pages_read_through_one_line_cache_read_as_each_page_alone(texts: list[str]) -> None:
    cache = LineCache()
    for text in texts:
        assert _outcome(text, cache) == _outcome(text)


def test_a_captured_page_and_its_next_scrape_read_the_same_through_the_line_cache() -> None:
    """The vLLM capture, then the same page one scrape later: counters and buckets moved,
    a series gone, one new, lines in another order."""
    first = (ENGINE_METRICS / "vllm-0.11-metrics.txt").read_text(encoding="utf-8")
    lines = first.split("\n")
    moved = [line.replace(" 0.0", " 3.0") if "_bucket{" in line and i % 3 == 0 else line
             for i, line in enumerate(lines)]
    second = "\n".join([*moved[len(moved) // 2:], *moved[:len(moved) // 2 - 2],
                        'vllm:num_requests_running{engine="1",model_name="m"} 2.0'])
    assert second != first
    cache = LineCache()
    for text in (first, second, first, second):
        assert _outcome(text, cache) == _outcome(text)
    assert index_samples(second, cache) is not None
