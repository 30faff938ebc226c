"""Every figure of a deployment report is range-checked: NaN, the infinities, negative
and too-large values are refused with the field's path, whatever the others hold."""

from __future__ import annotations

import math

import pytest

from gearshift.common.errors import InvalidArgument
from gearshift.controller.api.validation import (
    MAX_LATENCY_S,
    MAX_REQUEST_RATE_PER_GPU,
    MAX_REQUESTS_IN_FLIGHT_PER_GPU,
    MAX_TOKENS_PER_S_PER_GPU,
    check_hello,
    check_report,
)
from gearshift.v1 import agent_pb2

# field -> (the largest value allowed with tensor_parallel_size=2, its path in the error)
BOUNDS = {
    "request_rate": (MAX_REQUEST_RATE_PER_GPU * 2, "request_rate"),
    "running_requests": (MAX_REQUESTS_IN_FLIGHT_PER_GPU * 2, "running_requests"),
    "waiting_requests": (MAX_REQUESTS_IN_FLIGHT_PER_GPU * 2, "waiting_requests"),
    "prompt_tokens_per_s": (MAX_TOKENS_PER_S_PER_GPU * 2, "prompt_tokens_per_s"),
    "generation_tokens_per_s": (MAX_TOKENS_PER_S_PER_GPU * 2, "generation_tokens_per_s"),
    "kv_cache_usage": (1.0, "kv_cache_usage"),
    **{f"{q}.{f}": (MAX_LATENCY_S, f"{q}.{f}") for q in ("ttft", "itl", "e2e")
       for f in ("p50_s", "p99_s", "mean_s")},
}


def report(**figures: float) -> agent_pb2.Report:
    r = agent_pb2.Report(seq=1, interval_s=10.0)
    d = r.deployments.add(deployment_id="d1", engine="vllm", model="m",
                          tensor_parallel_size=2, request_rate=3.0, running_requests=4,
                          waiting_requests=1, prompt_tokens_per_s=100.0,
                          generation_tokens_per_s=200.0, kv_cache_usage=0.5)
    for q in (d.ttft, d.itl, d.e2e):
        q.present, q.p50_s, q.p99_s, q.mean_s, q.count = True, 0.05, 0.2, 0.07, 10
    for name, value in figures.items():
        msg, _, field = name.rpartition(".")
        setattr(getattr(d, msg) if msg else d, field, value)
    return r


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_figure_in_range_passes_at_its_bounds(name: str) -> None:
    high, _ = BOUNDS[name]
    check_report(report(**{name: 0.0}))
    if name in ("prompt_tokens_per_s", "generation_tokens_per_s"):
        other = ({"prompt_tokens_per_s", "generation_tokens_per_s"} - {name}).pop()
        check_report(report(**{name: high, other: 0.0}))  # the two share one bound
    elif name in ("running_requests", "waiting_requests"):
        other = ({"running_requests", "waiting_requests"} - {name}).pop()
        check_report(report(**{name: high, other: 0.0}))
    else:
        check_report(report(**{name: high}))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, "above"])
@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_figure_out_of_range_is_refused_naming_it(name: str, value: float | str) -> None:
    high, path = BOUNDS[name]
    bad = high * 1.5 + 1 if isinstance(value, str) else value
    with pytest.raises(InvalidArgument) as err:
        check_report(report(**{name: bad}))
    assert err.value.message.startswith(f"report.deployments[0].{path}")


def test_figures_that_share_a_bound_are_refused_together() -> None:
    half = MAX_TOKENS_PER_S_PER_GPU * 2 / 2
    check_report(report(prompt_tokens_per_s=half, generation_tokens_per_s=half))
    with pytest.raises(InvalidArgument, match="prompt and generation tokens per second"):
        check_report(report(prompt_tokens_per_s=half, generation_tokens_per_s=half + 1))
    half = MAX_REQUESTS_IN_FLIGHT_PER_GPU * 2 / 2
    with pytest.raises(InvalidArgument, match="running and waiting requests together"):
        check_report(report(running_requests=half, waiting_requests=half + 1))


# --- engine versions (Hello's EngineInstall, report fields 3, 27, 28) ---------------------

BAD_VERSIONS = ["x" * 65, "0.11 ; rm -rf", "-0.11", "0.11\n", "vllm\x00", ".11", "0.11/../x"]


@pytest.mark.parametrize("version", ["", "0.11.2", "1.2.0rc4", "0.10.1.dev12+g1234.cu128",
                                     "v1.0", "9" * 64])
def test_report_version_strings_that_engines_write_pass(version: str) -> None:
    check_report(report(engine_version=version, engine_release=version[:8]))


@pytest.mark.parametrize("field", ["engine_version", "engine_release"])
@pytest.mark.parametrize("bad", BAD_VERSIONS)
def test_report_bad_version_strings_are_refused_naming_the_field(field: str, bad: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_report(report(**{field: bad}))
    assert err.value.message.startswith(f"report.deployments[0].{field}: expected a version")
    assert repr(bad[:80]) in err.value.message


def test_report_image_fields_as_agents_send_them_pass() -> None:
    check_report(report(image="docker.io/vllm/vllm-openai:v0.11.0",
                        image_digest="sha256:" + "ab" * 32, pull_bytes_done=5,
                        pull_bytes_total=10))
    check_report(report(image="img@sha256:" + "0" * 64))


@pytest.mark.parametrize(("field", "bad", "needle"), [
    ("image", "img\n", "image: expected an image reference"),
    ("image", "-rm", "image: expected an image reference"),
    ("image", "i" * 513, "image: expected an image reference"),
    ("image_digest", "md5:abc", "image_digest: expected sha256:<64 hex digits>"),
])
def test_report_bad_image_fields_are_refused_naming_them(field: str, bad: str,
                                                         needle: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_report(report(**{field: bad}))
    assert err.value.message.startswith(f"report.deployments[0].{needle}"), err.value.message


@pytest.mark.parametrize("match", [agent_pb2.VERSION_MATCH_UNSPECIFIED, agent_pb2.VERSION_MATCH_KNOWN,
                                   agent_pb2.VERSION_MATCH_NEAREST, agent_pb2.VERSION_MATCH_UNKNOWN])
def test_report_each_version_match_passes(match: int) -> None:
    check_report(report(engine_version_match=match))


def test_report_unknown_version_match_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgument) as err:
        check_report(report(engine_version_match=7))
    assert err.value.message == (
        "report.deployments[0].engine_version_match: expected one of VERSION_MATCH_UNSPECIFIED, "
        "VERSION_MATCH_KNOWN, VERSION_MATCH_NEAREST, VERSION_MATCH_UNKNOWN, found 7")


def hello(**engine: object) -> agent_pb2.Hello:
    h = agent_pb2.Hello(host_id="h1", protocol_version=agent_pb2.PROTOCOL_VERSION_1)
    h.engines.add(engine="vllm", version="0.40.0", executable="/opt/vllm/bin/vllm",
                  release="0.18", version_match=agent_pb2.VERSION_MATCH_NEAREST,
                  version_source="metadata")
    h.engines.add(engine="sglang")  # nothing known of it: every field empty
    for name, value in engine.items():
        setattr(h.engines[0], name, value)
    return h


def test_hello_engines_as_agents_send_them_pass() -> None:
    check_hello(hello())
    for source in ("config", "metadata", "probe", ""):
        check_hello(hello(version_source=source))


@pytest.mark.parametrize(("field", "bad", "needle"), [
    *[("version", b, "expected a version") for b in BAD_VERSIONS],
    *[("release", b, "expected a version") for b in BAD_VERSIONS],
    ("version_match", 9, "expected one of VERSION_MATCH_UNSPECIFIED"),
    ("version_source", "pip freeze", "expected one of config, metadata, probe, image-label, image-env, image-metadata, image-tag or empty"),
    ("version_source", "m" * 10_000, "expected one of config"),
    ("executable", "/bin/vllm" * 1000, "expected up to 4096 characters"),
    ("executable", "/bin/vllm\x1b[2J", "expected up to 4096 characters without control"),
    ("image", "vllm\x1b]52;c;x\x07", "expected an image reference"),
    ("image", "x" * 600, "expected an image reference"),
])
def test_hello_bad_engine_fields_are_refused_naming_them(field: str, bad: object,
                                                         needle: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_hello(hello(**{field: bad}))
    assert err.value.message.startswith(f"hello.engines[0].{field}: {needle}")
    assert len(err.value.message) < 400  # the value is quoted, cut short


def test_hello_engine_twice_is_refused() -> None:
    h = hello()
    h.engines.add(engine="vllm", version="0.11.0")
    with pytest.raises(InvalidArgument, match=r"hello.engines\[2\].engine: 'vllm' again "
                                              r"\(first at engines\[0\]\)"):
        check_hello(h)
