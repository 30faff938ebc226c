"""The router over real loopback HTTP: routing, streaming, retries, leaving, errors, metrics."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Callable

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gearshift.gateway.routes import table_from_mapping

pytestmark = pytest.mark.timeout(30)


def refused_url() -> str:
    """An http URL on a loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def eventually(cond: Callable[[], bool]) -> None:
    """Wait until `cond()` holds (the pytest timeout bounds the wait)."""
    while not cond():
        await asyncio.sleep(0.01)


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text, 0 if absent."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


async def test_routes_by_model_and_weight(upstreams, gateways, http) -> None:
    a, b, c = await upstreams("a"), await upstreams("b"), await upstreams("c")
    gw = await gateways({
        "llama": [{"endpoint": a.url, "weight": 0.8}, {"endpoint": b.url, "weight": 0.2}],
        "qwen": [{"endpoint": c.url}],
    }, rng=random.Random(42).random)
    for _ in range(200):
        async with http.post(f"{gw.url}/v1/completions",
                             json={"model": "llama", "prompt": "hi"}) as r:
            assert r.status == 200
    async with http.post(f"{gw.url}/v1/chat/completions", json={"model": "qwen"},
                         headers={"Authorization": "Bearer k"}) as r:
        body = await r.json()
    assert body == {"served_by": "c", "model": "qwen", "path": "/v1/chat/completions",
                    "auth": "Bearer k"}
    assert a.hits + b.hits == 200 and c.hits == 1
    assert 130 < a.hits < 190  # 80% of 200 = 160, seed fixed
    async with http.get(f"{gw.url}/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["llama", "qwen"]


async def test_client_errors(upstreams, gateways, http) -> None:
    a = await upstreams("a")
    gw = await gateways({"llama": [{"endpoint": a.url}],
                         "idle": [{"endpoint": a.url, "weight": 0}]})
    async with http.post(f"{gw.url}/v1/completions", json={"model": "gpt-9"}) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]
    assert "llama" not in err["message"]  # the 404 does not list the models
    async with http.post(f"{gw.url}/v1/completions", data=b"{not json") as r:
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "invalid_json"
    async with http.post(f"{gw.url}/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 400
        assert "model" in (await r.json())["error"]["message"]
    async with http.post(f"{gw.url}/v1/completions", json=[1, 2]) as r:
        assert r.status == 400
    async with http.post(f"{gw.url}/v1/completions", json={"model": "idle"}) as r:
        assert r.status == 503
        assert (await r.json())["error"]["code"] == "no_endpoint"
    assert a.hits == 0
    async with http.get(f"{gw.metrics_url}/readyz") as r:
        assert r.status == 200


async def test_stream_is_passed_through_unbuffered(upstreams, gateways, http) -> None:
    a = await upstreams("a")
    gw = await gateways({"llama": [{"endpoint": a.url}]})
    async with http.post(f"{gw.url}/v1/completions",
                         json={"model": "llama", "stream": True}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        first = await r.content.readuntil(b"\n\n")
        # the upstream is still holding the rest of its stream
        assert b'"served_by": "a"' in first
        assert a.finished_streams == 0
        a.release.set()
        rest = await r.content.read()
    assert rest.endswith(b"data: [DONE]\n\n") and a.finished_streams == 1


async def test_retry_before_first_byte_on_refused_connection(upstreams, gateways, http) -> None:
    good = await upstreams("good")
    dead = refused_url()
    gw = await gateways({"llama": [{"endpoint": dead, "weight": 1},
                                   {"endpoint": good.url, "weight": 1}]},
                        rng=lambda: 0.0)  # always try the dead one first while it is eligible
    statuses = []
    for _ in range(20):
        async with http.post(f"{gw.url}/v1/completions", json={"model": "llama"}) as r:
            statuses.append(r.status)
    assert statuses == [200] * 20 and good.hits == 20
    async with http.get(f"{gw.metrics_url}/metrics") as r:
        text = await r.text()
    assert sample(text, "gearshift_gateway_retries_total", model="llama") >= 1
    assert sample(text, "gearshift_gateway_errors_total", model="llama") == 0


async def test_retry_on_upstream_503_and_pass_through_when_all_fail(upstreams, gateways,
                                                                     http) -> None:
    busy, good = await upstreams("busy", "503"), await upstreams("good")
    gw = await gateways({"llama": [{"endpoint": busy.url}, {"endpoint": good.url}],
                         "solo": [{"endpoint": busy.url}]}, rng=lambda: 0.0)
    async with http.post(f"{gw.url}/v1/completions", json={"model": "llama"}) as r:
        assert r.status == 200 and (await r.json())["served_by"] == "good"
    assert busy.hits == 1
    async with http.post(f"{gw.url}/v1/completions", json={"model": "solo"}) as r:
        assert r.status == 503
        assert "busy overloaded" in (await r.json())["error"]["message"]


async def test_all_endpoints_refusing_gives_502(gateways, http) -> None:
    gw = await gateways({"llama": [{"endpoint": refused_url()}, {"endpoint": refused_url()}]})
    async with http.post(f"{gw.url}/v1/completions", json={"model": "llama"}) as r:
        assert r.status == 502
        assert "2 tried" in (await r.json())["error"]["message"]


async def test_no_retry_after_first_byte(upstreams, gateways, http) -> None:
    cut, good = await upstreams("cut", "truncate"), await upstreams("good")
    gw = await gateways({"llama": [{"endpoint": cut.url}, {"endpoint": good.url}]},
                        rng=lambda: 0.0)
    got = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(f"{gw.url}/v1/completions",
                             json={"model": "llama", "stream": True}) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                got += chunk
    assert b'"served_by": "cut"' in got
    assert cut.hits == 1 and good.hits == 0
    async with http.get(f"{gw.metrics_url}/metrics") as r:
        text = await r.text()
    assert sample(text, "gearshift_gateway_errors_total", model="llama", reason="truncated") == 1
    assert sample(text, "gearshift_gateway_retries_total", model="llama") == 0
    stats = {s.deployment_id: s for s in gw.router.deployment_stats()}
    assert stats[f"llama@{cut.url}"].errors_total == 1


async def test_leaving_gets_no_new_requests_while_in_flight_finish(upstreams, gateways,
                                                                   http) -> None:
    old, new = await upstreams("old"), await upstreams("new")
    gw = await gateways({"llama": [{"endpoint": old.url, "deployment_id": "old"}]})

    async def stream() -> bytes:
        async with http.post(f"{gw.url}/v1/completions",
                             json={"model": "llama", "stream": True}) as r:
            return await r.read()

    in_flight = asyncio.create_task(stream())
    await eventually(lambda: old.hits == 1)
    assert {s.deployment_id: s.in_flight for s in gw.router.deployment_stats()} == {"old": 1}
    gw.router.set_table(table_from_mapping({"llama": [
        {"endpoint": old.url, "deployment_id": "old", "leaving": True},
        {"endpoint": new.url, "deployment_id": "new", "weight": 1},
    ]}))
    for _ in range(10):
        async with http.post(f"{gw.url}/v1/completions", json={"model": "llama"}) as r:
            assert (await r.json())["served_by"] == "new"
    assert old.hits == 1 and not in_flight.done()
    old.release.set()
    body = await in_flight
    assert body.endswith(b"data: [DONE]\n\n")
    assert {s.deployment_id: s.in_flight for s in gw.router.deployment_stats()} == \
        {"old": 0, "new": 0}


async def test_counters_of_deployments_that_left_the_table_are_dropped(upstreams, gateways,
                                                                       http) -> None:
    a, b = await upstreams("a"), await upstreams("b")
    gw = await gateways({"llama": [{"endpoint": a.url, "deployment_id": "d-old"}]})
    async with http.post(f"{gw.url}/v1/completions", json={"model": "llama"}) as r:
        assert r.status == 200
    assert [s.deployment_id for s in gw.router.deployment_stats()] == ["d-old"]
    for i in range(50):  # deployments come and go: the report stays the table's size
        gw.router.set_table(table_from_mapping({"llama": [
            {"endpoint": b.url, "deployment_id": f"d-{i}"}]}))
        async with http.post(f"{gw.url}/v1/completions", json={"model": "llama"}) as r:
            assert r.status == 200
    assert [s.deployment_id for s in gw.router.deployment_stats()] == ["d-49"]


async def test_metrics_and_health_only_on_the_metrics_listener(upstreams, gateways,
                                                              http) -> None:
    a = await upstreams("a")
    gw = await gateways({"llama": [{"endpoint": a.url, "deployment_id": "d1"}]})
    async with http.post(f"{gw.url}/v1/completions", json={"model": "llama"}) as r:
        assert r.status == 200
    async with http.post(f"{gw.url}/v1/completions", json={"model": "nope"}) as r:
        assert r.status == 404
    async with http.get(f"{gw.metrics_url}/metrics") as r:
        text = await r.text()
    # the API port serves the API, and vLLM's /health (test_openai_compat.py)
    for path in ("/metrics", "/healthz", "/readyz"):
        async with http.get(f"{gw.url}{path}") as r:
            assert r.status == 404
            assert "gearshift_gateway" not in await r.text()
    async with http.get(f"{gw.metrics_url}/v1/models") as r:
        assert r.status == 404
    assert sample(text, "gearshift_gateway_client_connections_limit") == 4096
    assert sample(text, "gearshift_gateway_requests_total", model="llama", deployment="d1",
                  code="200") == 1
    assert sample(text, "gearshift_gateway_ttft_seconds_count", model="llama") == 1
    assert sample(text, "gearshift_gateway_in_flight", model="llama", deployment="d1") == 0
    assert sample(text, "gearshift_gateway_errors_total", model="unknown",
                  reason="unknown_model") == 1
    assert "nope" not in text  # unknown model names do not become label values
