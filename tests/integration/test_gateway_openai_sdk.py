"""The gateway as a drop-in for clients written for vLLM: the real `openai` SDK against a
gateway (static table) in front of an emulated vLLM, all in this process on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from gearshift.agents.emulator.app import build_app
from gearshift.agents.emulator.args import parse_engine_argv
from gearshift.agents.emulator.config import EmulatorOptions
from gearshift.agents.emulator.server import make_state
from gearshift.gateway.routes import table_from_mapping
from gearshift.gateway.server import Gateway, GatewayConfig

pytestmark = pytest.mark.timeout(30)

MODEL = "meta-llama/Llama-3.3-70B-Instruct"  # an id with a slash, served under its own name
FAST = EmulatorOptions(capacity_rps=40.0, load_s=0.0, ttft_base_s=0.002, itl_s=0.001,
                       output_tokens=4, engine_version="0.10.0")
MESSAGES = [{"role": "user", "content": "say something"}]


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    runner = web.AppRunner(build_app(make_state(parse_engine_argv("vllm", ["serve", MODEL]),
                                                FAST)), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    gw = Gateway(GatewayConfig(listen_port=0), registry=CollectorRegistry(),
                 table=table_from_mapping({MODEL: [{"endpoint": engine_url}]}))
    await gw.start()
    sdk = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0,
                             timeout=10.0)
    try:
        yield sdk
    finally:
        await sdk.close()
        await gw.stop()
        await runner.cleanup()


async def test_completions_plain_and_streamed(client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert chat.model == MODEL and chat.choices[0].message.content
    text = await client.completions.create(model=MODEL, prompt="one two")
    assert text.model == MODEL and text.choices[0].text
    chunks = [c async for c in await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True)]  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    pieces = [c async for c in await client.completions.create(model=MODEL, prompt="one two",
                                                               stream=True)]
    assert "".join(p.choices[0].text for p in pieces if p.choices).strip()


async def test_models_list_and_retrieve_an_id_with_a_slash(client: openai.AsyncOpenAI) -> None:
    listed = [m async for m in client.models.list()]
    assert [m.id for m in listed] == [MODEL]
    model = await client.models.retrieve(MODEL)  # the SDK sends the slash as %2F
    assert model == listed[0] and model.object == "model"


async def test_errors_raise_the_sdks_exceptions_with_the_one_shape(
        client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="gpt-9", messages=MESSAGES)  # type: ignore[arg-type]
    assert "gpt-9" in missing.value.message and missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("meta-llama/none")
    assert "meta-llama/none" in missing.value.message
    with pytest.raises(openai.BadRequestError) as bad:  # refused by the engine, not the gateway
        await client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    body = bad.value.response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == bad.value.type == "invalid_request_error"
    assert body["error"]["param"] == "max_tokens" and "max_tokens" in bad.value.message
