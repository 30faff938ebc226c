"""The operator listener (gearshift.common.ops_http) as any daemon runs it: a registry and callbacks,
real HTTP over loopback."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter

from gearshift.common.ops_http import OpsListener

pytestmark = pytest.mark.timeout(30)


async def get(port: int, wire: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(wire)
        got = await asyncio.wait_for(reader.read(), 5.0)  # one answer, then the close
    finally:
        writer.close()
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def test_metrics_liveness_and_readiness_from_callbacks() -> None:
    registry = CollectorRegistry()
    Counter("ops_test_things", "Things.", registry=registry).inc(3)
    state = {"ready": False, "alive": True}

    def alive() -> bool:
        if state["alive"] is None:
            raise RuntimeError("the check itself broke")
        return bool(state["alive"])

    ops = OpsListener(registry, ready=lambda: bool(state["ready"]), alive=alive)
    port = await ops.start("127.0.0.1", 0)
    try:
        status, body = await get(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and b"ops_test_things_total 3.0" in body
        assert await get(port, b"GET /readyz HTTP/1.1\r\n\r\n") == (503, b"not ready\n")
        state["ready"] = True
        assert await get(port, b"GET /readyz?verbose=1 HTTP/1.1\r\n\r\n") == (200, b"ready\n")
        assert await get(port, b"HEAD /healthz HTTP/1.1\r\n\r\n") == (200, b"")
        state["alive"] = None  # a callback that raises reads as "no", never a traceback page
        assert (await get(port, b"GET /healthz HTTP/1.1\r\n\r\n"))[0] == 503
        assert (await get(port, b"DELETE /metrics HTTP/1.1\r\n\r\n"))[0] == 405
        assert (await get(port, b"GET /v1/models HTTP/1.1\r\n\r\n"))[0] == 404
        assert (await get(port, b"GET /metrics\r\n\r\n"))[0] == 400
    finally:
        await ops.stop()


async def test_a_silent_client_is_cut_and_stop_ends_open_connections() -> None:
    ops = OpsListener(CollectorRegistry(), ready=lambda: True)
    port = await ops.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /readyz HTTP/1.1\r\n")  # and never the blank line
        await asyncio.sleep(0.05)
        await ops.stop()
        assert await asyncio.wait_for(reader.read(), 5.0) == b""
    finally:
        writer.close()
