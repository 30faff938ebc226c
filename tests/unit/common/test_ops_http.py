"""The operators' listener, through a real HTTP client over loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter

from gearshift.common.ops_http import OpsListener, parse_listen


class Flags:
    def __init__(self) -> None:
        self.ready: bool | tuple[bool, str] = (False, "adopting engines")
        self.alive = True

    def is_ready(self) -> bool | tuple[bool, str]:
        return self.ready

    def is_alive(self) -> bool:
        if not self.alive:
            raise RuntimeError("loop stuck")
        return True


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Flags, Counter]]:
    registry = CollectorRegistry()
    counter = Counter("gearshift_test_things_total", "Things.", registry=registry)
    flags = Flags()
    ops = OpsListener(registry, flags.is_ready, flags.is_alive)
    port = await ops.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", flags, counter
    finally:
        await ops.stop()


async def _get(url: str, method: str = "GET") -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as s, s.request(method, url) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


async def test_metrics_come_from_the_given_registry(served: tuple[str, Flags, Counter]) -> None:
    url, _flags, counter = served
    counter.inc(3)
    status, ctype, body = await _get(f"{url}/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    assert "gearshift_test_things_total 3.0" in body


async def test_readyz_follows_the_callback_with_its_reason(
        served: tuple[str, Flags, Counter]) -> None:
    url, flags, _ = served
    assert await _get(f"{url}/readyz") == (503, "text/plain; charset=utf-8",
                                           "not ready: adopting engines\n")
    flags.ready = True
    assert (await _get(f"{url}/readyz"))[::2] == (200, "ready\n")
    flags.ready = (True, "leader, epoch 3")
    assert (await _get(f"{url}/readyz"))[2] == "ready: leader, epoch 3\n"


async def test_healthz_is_alive_and_a_failing_check_means_no(
        served: tuple[str, Flags, Counter]) -> None:
    url, flags, _ = served
    assert (await _get(f"{url}/healthz"))[::2] == (200, "ok\n")
    flags.alive = False
    assert (await _get(f"{url}/healthz"))[::2] == (503, "not alive: check failed\n")


async def test_other_paths_and_methods_are_refused(served: tuple[str, Flags, Counter]) -> None:
    url, _, _ = served
    assert (await _get(f"{url}/config"))[0] == 404
    assert (await _get(f"{url}/metrics", "POST"))[0] == 405
    status, _, body = await _get(f"{url}/healthz", "HEAD")
    assert status == 200 and body == ""


async def test_garbage_gets_400_and_the_listener_keeps_serving(
        served: tuple[str, Flags, Counter]) -> None:
    url, _, _ = served
    port = int(url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"NONSENSE\r\n\r\n")
    answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 400")
    assert (await _get(f"{url}/healthz"))[0] == 200


@pytest.mark.parametrize("value", ["", "8080", "host:", ":9", "h:70000", "h:x"])
def test_parse_listen_names_the_flag_and_value(value: str) -> None:
    with pytest.raises(ValueError, match="--metrics-listen: expected HOST:PORT"):
        parse_listen(value)


def test_parse_listen_reads_ipv6_in_brackets() -> None:
    assert parse_listen("[::1]:9100") == ("::1", 9100)
    assert parse_listen("0.0.0.0:0") == ("0.0.0.0", 0)
