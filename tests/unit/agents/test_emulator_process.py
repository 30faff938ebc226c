"""The emulator as a process: SIGTERM semantics, faults at start, the build stand-in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys

import aiohttp

EMULATE = [sys.executable, "-m", "gearshift.agents.emulator"]
START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def spawn(*argv: str, **env: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *EMULATE, *argv, env={**os.environ, "GEARSHIFT_EMULATOR_LOAD_S": "0", **env},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)


async def wait_listening(url: str, http: aiohttp.ClientSession) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_S
    while True:
        try:
            async with http.get(url) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectorError:
            if loop.time() > deadline:
                raise
        await asyncio.sleep(0.05)


async def test_vllm_without_shutdown_timeout_aborts_inflight_requests():
    port = free_port()
    proc = await spawn("--flavor", "vllm", "--itl-s", "0.01", "--", "serve", "m",
                       "--host", "127.0.0.1", "--port", str(port))
    try:
        async with aiohttp.ClientSession() as http:
            await wait_listening(f"http://127.0.0.1:{port}/health", http)
            async with http.post(f"http://127.0.0.1:{port}/v1/completions",
                                 json={"model": "m", "prompt": "x", "max_tokens": 1000,
                                       "stream": True}) as resp:
                await resp.content.readline()
                proc.send_signal(signal.SIGTERM)
                body = b""
                # The connection is cut (ClientPayloadError): the request was aborted.
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    body = await resp.read()
        assert b"[DONE]" not in body
        assert await asyncio.wait_for(proc.wait(), START_TIMEOUT_S) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_crash_after_fault_exits_non_zero():
    port = free_port()
    proc = await spawn("--flavor", "tensorrt-llm", "--", "m", "--port", str(port),
                       GEARSHIFT_EMULATOR_FAULTS=json.dumps({"crash_after_s": 0.2}))
    try:
        assert await asyncio.wait_for(proc.wait(), START_TIMEOUT_S) != 0
        assert proc.stderr is not None
        assert b"crash fault" in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_build_stand_in_takes_its_time_and_succeeds():
    proc = await spawn("--flavor", "tensorrt-llm", "--build-s", "0.1", "--", "build",
                       "--checkpoint_dir", "/ckpt")
    assert await asyncio.wait_for(proc.wait(), START_TIMEOUT_S) == 0


async def test_bad_arguments_exit_2():
    proc = await spawn("--flavor", "vllm", "--", "serve", "m", "--port", "x")
    assert await asyncio.wait_for(proc.wait(), START_TIMEOUT_S) == 2
    assert proc.stderr is not None
    assert b"--port" in await proc.stderr.read()
