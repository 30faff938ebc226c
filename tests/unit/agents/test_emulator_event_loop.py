"""The emulator on uvloop (`--event-loop uvloop`): same answers, same SIGTERM drain."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
import sys

import aiohttp
import pytest
from click.testing import CliRunner

from gearshift.agents.emulator.cli import emulate

pytestmark = pytest.mark.timeout(60)
START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def spawn(*argv: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gearshift.agents.emulator", *argv,
        env={**os.environ, "GEARSHIFT_EMULATOR_LOAD_S": "0"},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)


async def wait_listening(url: str, http: aiohttp.ClientSession) -> None:
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    while True:
        try:
            async with http.get(url) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectorError:
            if asyncio.get_running_loop().time() > deadline:
                raise
        await asyncio.sleep(0.05)


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed")
async def test_uvloop_serves_and_drains_on_sigterm() -> None:
    port = free_port()
    proc = await spawn("--flavor", "vllm", "--event-loop", "uvloop", "--itl-s", "0.01", "--",
                       "serve", "m", "--host", "127.0.0.1", "--port", str(port),
                       "--shutdown-timeout", "20")
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await wait_listening(f"{base}/health", http)
            async with http.post(f"{base}/v1/completions",
                                 json={"model": "m", "prompt": "x", "max_tokens": 2}) as resp:
                body = await resp.json()
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 2
            async with http.get(f"{base}/emulator/state") as resp:
                assert (await resp.json())["options"]["event_loop"] == "uvloop"
            async with http.post(f"{base}/v1/completions",
                                 json={"model": "m", "prompt": "x", "max_tokens": 30,
                                       "stream": True}) as resp:
                await resp.content.readline()
                proc.send_signal(signal.SIGTERM)  # drains: the stream still completes
                rest = await resp.read()
        assert rest.endswith(b"data: [DONE]\n\n")
        assert await asyncio.wait_for(proc.wait(), START_TIMEOUT_S) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_unknown_event_loop_is_a_usage_error() -> None:
    result = CliRunner().invoke(emulate, ["--flavor", "vllm", "--event-loop", "trio", "--",
                                          "serve", "m"])
    assert result.exit_code == 2 and "--event-loop" in result.output
