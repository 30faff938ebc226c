"""What clients written for vLLM expect of the API port: `GET /health`, `GET /v1/models/{id}`
(ids with slashes), and every error, the gateway's own or an engine's, in OpenAI's one shape."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

import pytest
from yarl import URL

from gearshift.v1 import control_pb2

pytestmark = pytest.mark.timeout(30)

LLAMA = "meta-llama/Llama-3.3-70B-Instruct"
SHAPE_KEYS = {"message", "type", "param", "code"}


def the_error(body: bytes) -> dict[str, Any]:
    """The body's error object, checked to be OpenAI's shape and nothing else."""
    doc = json.loads(body)
    assert list(doc) == ["error"] and set(doc["error"]) == SHAPE_KEYS, doc
    return doc["error"]  # type: ignore[no-any-return]


async def get(http, url: str, method: str = "GET"):  # type: ignore[no-untyped-def]
    """(status, headers, body); `url` is sent as written (no re-encoding of %2F)."""
    async with http.request(method, URL(url, encoded=True)) as r:
        return r.status, r.headers, await r.read()


async def test_health_on_the_api_port_follows_the_routing_table(controller, upstreams, gateways,
                                                                http) -> None:
    a = await upstreams("a")
    gw = await gateways(controller=controller.address, backoff_initial_s=0.02,
                        backoff_max_s=0.05)
    status, _h, body = await get(http, f"{gw.url}/health")
    assert status == 503 and the_error(body)["type"] == "server_error"
    await controller.tables.put(control_pb2.RoutingTable(version=1, models=[
        control_pb2.ModelRoute(model="llama", endpoints=[
            control_pb2.RouteEndpoint(deployment_id="d", endpoint=a.url, weight=1.0)])]))
    while gw.router.table.version != 1:
        await asyncio.sleep(0.01)
    status, _h, body = await get(http, f"{gw.url}/health")
    assert (status, body) == (200, b"")
    assert (await get(http, f"{gw.url}/health", "HEAD"))[0] == 200
    for path in ("/metrics", "/healthz", "/readyz"):  # those stay on --metrics-listen
        assert (await get(http, f"{gw.url}{path}"))[0] == 404
    assert (await get(http, f"{gw.metrics_url}/health"))[0] == 404


async def test_a_model_by_id_with_slashes_plain_or_percent_encoded(upstreams, gateways,
                                                                   http) -> None:
    a = await upstreams("a")
    gw = await gateways({LLAMA: [{"endpoint": a.url}], "qwen": [{"endpoint": a.url}]})
    _s, _h, body = await get(http, f"{gw.url}/v1/models")
    listed = {m["id"]: m for m in json.loads(body)["data"]}
    for path in (LLAMA, LLAMA.replace("/", "%2F"), LLAMA.replace("/", "%2f"), "qwen"):
        status, headers, body = await get(http, f"{gw.url}/v1/models/{path}")
        assert status == 200 and headers["Content-Type"] == "application/json"
        model = json.loads(body)
        assert model == listed[model["id"]] and model["object"] == "model"
    for missing in ("meta-llama", "meta-llama/", "", "%ff%fe", LLAMA + "/x"):
        status, _h, body = await get(http, f"{gw.url}/v1/models/{missing}")
        err = the_error(body)
        assert status == 404, missing
        assert (err["type"], err["code"], err["param"]) == \
            ("not_found_error", "model_not_found", "model")
    status, _h, body = await get(http, f"{gw.url}/v1/models/qwen", "POST")
    assert status == 405 and the_error(body)["type"] == "invalid_request_error"
    assert a.hits == 0


async def test_the_gateways_own_errors_type_follows_the_status(upstreams, gateways, http) -> None:
    a = await upstreams("a")
    gw = await gateways({"llama": [{"endpoint": a.url}], "idle": [{"endpoint": a.url, "weight": 0}]})
    cases: list[tuple[str, Any, int, str]] = [
        ("/v1/completions", {"model": "gpt-9"}, 404, "not_found_error"),
        ("/v1/completions", b"{not json", 400, "invalid_request_error"),
        ("/v1/completions", {"model": "idle"}, 503, "server_error"),
        ("/nope", {}, 404, "not_found_error"),
    ]
    for path, payload, status, err_type in cases:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        async with http.post(f"{gw.url}{path}", data=data) as r:
            assert r.status == status, (path, payload)
            assert the_error(await r.read())["type"] == err_type, (path, payload)
    # a request the listener cannot read is refused in the same shape
    for wire, status, err_type in ((b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 400,
                                    "invalid_request_error"),
                                   (b"GET / HTTP/3\r\n\r\n", 505, "server_error")):
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(wire)
        head, _, body = (await reader.read()).partition(b"\r\n\r\n")
        writer.close()
        assert head.startswith(b"HTTP/1.1 %d " % status)
        assert the_error(body)["type"] == err_type
    assert a.hits == 0


def answer(status: int, body: bytes, ctype: bytes = b"application/json",
           extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %d Whatever\r\nContent-Type: %s\r\n%sContent-Length: %d\r\n\r\n%s"
            % (status, ctype, extra, len(body), body))


VLLM_400 = {"error": {"message": "'max_tokens' must be at least 1, got 0.",
                      "type": "BadRequestError", "param": "max_tokens", "code": 400}}
TOP_LEVEL_404 = {"object": "error", "message": "The model `x` does not exist.",
                 "type": "NotFoundError", "param": None, "code": 404}
FASTAPI_422 = {"detail": [{"loc": ["body", "messages"], "msg": "Field required"}]}
OPENAI_400 = {"error": {"message": "too long", "type": "invalid_request_error", "param": "messages",
                        "code": "context_length_exceeded"}}


@pytest.mark.parametrize(("wire", "status", "expected"), [
    # vLLM's own shape: message and param kept, its type and numeric code are not
    (answer(400, json.dumps(VLLM_400).encode()), 400,
     {"message": "'max_tokens' must be at least 1, got 0.", "type": "invalid_request_error",
      "param": "max_tokens", "code": None}),
    # the top-level shape of older vLLM, SGLang and trtllm-serve
    (answer(404, json.dumps(TOP_LEVEL_404).encode()), 404,
     {"message": "The model `x` does not exist.", "type": "not_found_error", "param": None,
      "code": None}),
    # vLLM's --api-key refusal
    (answer(401, b'{"error": "Unauthorized"}'), 401,
     {"message": "Unauthorized", "type": "authentication_error", "param": None, "code": None}),
    (answer(422, json.dumps(FASTAPI_422).encode()), 422,
     {"message": json.dumps(FASTAPI_422["detail"]), "type": "invalid_request_error",
      "param": None, "code": None}),
    (answer(429, b""), 429,
     {"message": "The engine answered HTTP 429 (Too Many Requests) without a message.",
      "type": "rate_limit_error", "param": None, "code": None}),
    (answer(500, b"Internal Server Error", b"text/plain; charset=utf-8"), 500,
     {"message": "Internal Server Error", "type": "server_error", "param": None, "code": None}),
    (answer(400, json.dumps(OPENAI_400).encode()), 400, OPENAI_400["error"]),
    (answer(400, gzip.compress(json.dumps(VLLM_400).encode()), extra=b"Content-Encoding: gzip\r\n"),
     400, {"message": "'max_tokens' must be at least 1, got 0.", "type": "invalid_request_error",
           "param": "max_tokens", "code": None}),
], ids=["vllm", "top-level", "api-key", "fastapi", "empty", "text", "openai", "gzip"])
async def test_an_engine_error_is_relayed_in_the_one_shape(engine, gateways, http,  # type: ignore[no-untyped-def]
                                                           wire: bytes, status: int,
                                                           expected: dict[str, Any]) -> None:
    async def script(_n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await e.read_request(r)
            w.write(wire)
            await w.drain()

    e = await engine(script)
    gw = await gateways({"llama": [{"endpoint": f"http://127.0.0.1:{e.port}"}]})
    for stream in (False, True):  # a refused stream has not started: it is reshaped too
        async with http.post(f"{gw.url}/v1/chat/completions",
                             json={"model": "llama", "stream": stream}) as r:
            assert r.status == status
            assert r.headers["Content-Type"] == "application/json"
            assert "Content-Encoding" not in r.headers
            assert the_error(await r.read()) == expected


async def test_a_large_engine_error_is_not_collected_and_a_started_stream_not_rewritten(  # type: ignore[no-untyped-def]
        engine, gateways, http) -> None:
    event = b'data: {"error": {"message": "boom", "type": "BadRequestError", "code": 400}}\n\n'
    answers = [answer(400, b'{"error": {"message": "' + b"m" * 100_000 + b'"}}'),
               answer(200, event, b"text/event-stream")]

    async def script(n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await e.read_request(r)
        w.write(answers[n - 1])
        await w.drain()

    e = await engine(script)
    gw = await gateways({"llama": [{"endpoint": f"http://127.0.0.1:{e.port}"}]})
    async with http.post(f"{gw.url}/v1/completions", json={"model": "llama"}) as r:
        body = await r.read()
        assert r.status == 400 and len(body) < 1000
        err = the_error(body)
        assert err["type"] == "invalid_request_error" and "larger than" in err["message"]
    async with http.post(f"{gw.url}/v1/completions", json={"model": "llama", "stream": True}) as r:
        assert r.status == 200 and await r.read() == event
