"""EngineSupervisor runs the emulator as a real child process, exactly as the agent will."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from gearshift.agents.runtimes.base import get_runtime
from gearshift.agents.runtimes.supervisor import EngineSupervisor
from gearshift.common.engine_versions import release_for
from gearshift.common.errors import FailedPrecondition
from gearshift.common.spec import DeploymentSpec, Phase

READY_TIMEOUT_S = 30.0


def emulator(flavor: str) -> list[str]:
    return [sys.executable, "-m", "gearshift.agents.emulator", "--flavor", flavor, "--"]


def fast_env(**extra: str) -> dict[str, str]:
    env = {"GEARSHIFT_EMULATOR_LOAD_S": "0.1", "GEARSHIFT_EMULATOR_TTFT_BASE_S": "0.002",
           "GEARSHIFT_EMULATOR_ITL_S": "0.002"}
    env.update(extra)
    return env


@asynccontextmanager
async def supervised(tmp_path: Path, *, engine: str = "vllm", env: dict[str, str] | None = None,
                     **kwargs) -> AsyncIterator[EngineSupervisor]:
    spec_fields = {"deployment_id": "d1", "model": "m1", "engine": engine}
    spec_fields.update(kwargs.pop("spec", {}))
    spec = DeploymentSpec(**spec_fields)
    options = {"health_interval_s": 0.05, "restart_backoff_s": (0.05, 0.2),
               "executable": emulator(engine)}
    options.update(kwargs)
    sup = EngineSupervisor(spec, get_runtime(engine), env=env if env is not None else fast_env(),
                           workdir=tmp_path, **options)
    try:
        yield sup
    finally:
        await sup.stop(grace_s=0.0)
        assert sup.pid is None


async def fault(sup: EngineSupervisor, body: dict) -> None:
    async with aiohttp.ClientSession() as http, \
            http.post(f"{sup.endpoint}/emulator/faults", json=body) as resp:
        assert resp.status == 200


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_start_becomes_ready_and_serves(tmp_path):
    phases: list[Phase] = []
    async with supervised(tmp_path, on_change=lambda s: phases.append(s.phase)) as sup:
        await sup.start()
        assert sup.port != 0 and sup.pid is not None
        assert await sup.wait_ready(READY_TIMEOUT_S), sup.last_message
        async with aiohttp.ClientSession() as http, http.post(
                f"{sup.endpoint}/v1/completions",
                json={"model": "m1", "prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 200
        assert sup.served_model_name == "m1"
        assert "serve" in sup.log_path.read_text()
        with pytest.raises(FailedPrecondition):
            await sup.start()
    assert phases[0] is Phase.READY and phases[-1] is Phase.STOPPED
    assert sup.phase is Phase.STOPPED


async def test_connections_are_refused_while_loading(tmp_path):
    async with supervised(tmp_path, env=fast_env(GEARSHIFT_EMULATOR_LOAD_S="1.5")) as sup:
        await sup.start()
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientConnectorError):
                await http.get(f"{sup.endpoint}/health")
            assert sup.phase is Phase.STARTING
            assert await sup.wait_ready(READY_TIMEOUT_S), sup.last_message
            async with http.get(f"{sup.endpoint}/health") as resp:
                assert resp.status == 200


async def test_crash_is_restarted(tmp_path):
    async with supervised(tmp_path) as sup:
        await sup.start()
        assert await sup.wait_ready(READY_TIMEOUT_S)
        first_pid = sup.pid
        assert first_pid is not None
        with contextlib.suppress(aiohttp.ClientError):  # it may die before answering
            await fault(sup, {"crash": True})
        while sup.restarts == 0:
            await asyncio.sleep(0.02)
        assert await sup.wait_ready(READY_TIMEOUT_S), sup.last_message
        assert sup.restarts == 1
        assert sup.pid != first_pid and gone(first_pid)


async def test_gives_up_after_max_restarts(tmp_path):
    env = fast_env(GEARSHIFT_EMULATOR_FAULTS=json.dumps({"crash_after_s": 0}))
    async with supervised(tmp_path, env=env, max_restarts=1) as sup:
        await sup.start()
        assert not await sup.wait_ready(READY_TIMEOUT_S)
        assert sup.phase is Phase.FAILED
        assert sup.restarts == 1
        assert "gave up" in sup.last_message


async def test_failing_health_marks_unhealthy_and_recovers(tmp_path):
    async with supervised(tmp_path) as sup:
        await sup.start()
        assert await sup.wait_ready(READY_TIMEOUT_S)
        await fault(sup, {"health": "fail"})
        while sup.phase is not Phase.UNHEALTHY:
            await asyncio.sleep(0.02)
        assert "503" in sup.last_message
        await fault(sup, {"health": "ok"})
        assert await sup.wait_ready(READY_TIMEOUT_S)
        assert sup.restarts == 0


async def test_drain_finishes_the_inflight_stream_then_exits(tmp_path):
    async with supervised(tmp_path, spec={"shutdown_timeout_s": 20.0}) as sup:
        await sup.start()
        assert await sup.wait_ready(READY_TIMEOUT_S)
        pid = sup.pid
        assert pid is not None
        async with aiohttp.ClientSession() as http, http.post(
                f"{sup.endpoint}/v1/completions",
                json={"model": "m1", "prompt": "x", "max_tokens": 300, "stream": True}) as resp:
            first = await resp.content.readline()  # the stream has begun
            assert first.startswith(b"data: ")
            drain = asyncio.create_task(sup.drain(grace_s=20.0))
            while sup.phase is not Phase.DRAINING:
                await asyncio.sleep(0.01)
            # Once the engine handles SIGTERM it stops listening: new connections are
            # refused while the in-flight stream goes on.
            refused = False
            async with aiohttp.ClientSession() as other:
                for _ in range(200):
                    try:
                        async with other.get(f"{sup.endpoint}/health"):
                            pass
                    except aiohttp.ClientConnectorError:
                        refused = True
                        break
                    await asyncio.sleep(0.005)
            assert refused
            rest = await resp.read()
            await drain
    events = [e for e in (first + rest).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert len(events) == 301  # every token arrived, then [DONE]
    assert sup.phase is Phase.STOPPED
    assert "code 0" in sup.last_message and "killed" not in sup.last_message
    assert gone(pid)


async def test_stop_kills_an_engine_that_ignores_sigterm(tmp_path):
    env = fast_env(GEARSHIFT_EMULATOR_FAULTS=json.dumps({"ignore_sigterm": True}))
    async with supervised(tmp_path, env=env) as sup:
        await sup.start()
        assert await sup.wait_ready(READY_TIMEOUT_S)
        pid = sup.pid
        assert pid is not None
        await sup.stop(grace_s=0.3)
        assert sup.phase is Phase.STOPPED
        assert "killed after" in sup.last_message
        assert gone(pid)
    assert "ignoring SIGTERM" in sup.log_path.read_text()


async def test_cancelled_drain_leaves_no_process(tmp_path):
    env = fast_env(GEARSHIFT_EMULATOR_FAULTS=json.dumps({"ignore_sigterm": True}))
    async with supervised(tmp_path, env=env) as sup:
        await sup.start()
        assert await sup.wait_ready(READY_TIMEOUT_S)
        pid = sup.pid
        assert pid is not None
        drain = asyncio.create_task(sup.drain(grace_s=60.0))
        while sup.phase is not Phase.DRAINING:
            await asyncio.sleep(0.01)
        drain.cancel()
        with pytest.raises(asyncio.CancelledError):
            await drain
        for _ in range(500):
            if gone(pid):
                break
            await asyncio.sleep(0.01)
        assert gone(pid)


async def test_missing_executable_fails_clearly(tmp_path):
    spec = DeploymentSpec(deployment_id="d1", model="m1", engine="vllm")
    sup = EngineSupervisor(spec, get_runtime("vllm"), executable=["/nonexistent/vllm"],
                           workdir=tmp_path)
    with pytest.raises(FailedPrecondition, match="/nonexistent/vllm"):
        await sup.start()
    assert sup.phase is Phase.FAILED
    await sup.stop()
    assert sup.phase is Phase.FAILED


async def test_trtllm_engine_through_the_emulator(tmp_path):
    async with supervised(tmp_path, engine="tensorrt-llm", spec={"port": 0}) as sup:
        await sup.start()
        assert await sup.wait_ready(READY_TIMEOUT_S), sup.last_message
        urls = sup.endpoints
        assert (tmp_path / "d1.extra-llm-api-options.yaml").is_file()
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{sup.endpoint}/v1/completions",
                                 json={"model": sup.served_model_name, "prompt": "x",
                                       "max_tokens": 3}) as resp:
                assert resp.status == 200
            for url in urls.health_urls:
                async with http.get(url) as resp:
                    assert resp.status == 200
            prometheus_url, json_url = urls.metric_urls
            async with http.get(prometheus_url) as resp:
                assert "trtllm_e2e_request_latency_seconds_count" in await resp.text()
            stats: list = []
            for _ in range(100):
                async with http.get(json_url) as resp:
                    stats += await resp.json()
                if any(s["numCompletedRequests"] for s in stats):
                    break
                await asyncio.sleep(0.02)
        assert sum(s["numCompletedRequests"] for s in stats) == 1


# --- a release without --shutdown-timeout (vLLM before 0.18) ------------------------------

OLD_VLLM = "0.11.0"


def old_vllm() -> list[str]:
    """The emulator as vLLM 0.11.0: it refuses --shutdown-timeout, as that release's
    parser does, and aborts in-flight requests on SIGTERM, as its launcher does."""
    return [sys.executable, "-m", "gearshift.agents.emulator", "--flavor", "vllm",
            "--engine-version", OLD_VLLM, "--"]


async def stream(http: aiohttp.ClientSession, sup: EngineSupervisor, tokens: int,
                 started: asyncio.Event) -> list[str]:
    """One streamed completion; its events, or the error that cut it."""
    body = {"model": "m1", "prompt": "x", "max_tokens": tokens, "stream": True}
    async with http.post(f"{sup.endpoint}/v1/completions", json=body) as resp:
        first = await resp.content.readline()
        started.set()
        rest = await resp.read()
    return [e for e in (first + rest).decode().split("\n\n") if e]


def complete(events: list[str] | BaseException, tokens: int) -> bool:
    return isinstance(events, list) and events[-1] == "data: [DONE]" and len(events) == tokens + 1


@asynccontextmanager
async def old_vllm_ready(tmp_path: Path) -> AsyncIterator[EngineSupervisor]:
    release = release_for("vllm", OLD_VLLM)
    assert not release.row.flags.drain_timeout  # the table: no drain flag on this release
    async with supervised(tmp_path, spec={"shutdown_timeout_s": 20.0}, release=release.row,
                          executable=old_vllm(),
                          env=fast_env(GEARSHIFT_EMULATOR_ITL_S="0.005")) as sup:
        await sup.start()
        assert await sup.wait_ready(READY_TIMEOUT_S), sup.last_message
        assert "--shutdown-timeout" not in sup.log_path.read_text()
        yield sup


async def in_flight(sup: EngineSupervisor, n: int, tokens: int
                    ) -> tuple[aiohttp.ClientSession, asyncio.Future]:
    http = aiohttp.ClientSession()
    events = [asyncio.Event() for _ in range(n)]
    streams = asyncio.gather(*(stream(http, sup, tokens, e) for e in events),
                             return_exceptions=True)
    await asyncio.gather(*(e.wait() for e in events))  # every stream has begun
    return http, streams


async def test_drain_on_a_release_without_shutdown_timeout_lets_in_flight_requests_finish(
        tmp_path):
    async with old_vllm_ready(tmp_path) as sup:
        pid = sup.pid
        http, streams = await in_flight(sup, 6, tokens=300)
        async with http:
            drain = asyncio.create_task(sup.drain(grace_s=60.0))
            while sup.phase is not Phase.DRAINING:
                await asyncio.sleep(0.01)
            assert "aborts in-flight requests on SIGTERM" in sup.last_message
            results = await streams
            await drain
        assert sup.phase is Phase.STOPPED
        assert sup.last_message == "engine exited with code 0"  # nothing cut short or killed
    assert sum(not complete(r, 300) for r in results) == 0, results  # 0 failed
    assert pid is not None and gone(pid)


async def test_without_the_wait_that_release_aborts_in_flight_requests(tmp_path):
    """The control: `stop` sends SIGTERM at once, and vLLM 0.11 cuts the streams."""
    async with old_vllm_ready(tmp_path) as sup:
        http, streams = await in_flight(sup, 3, tokens=300)
        async with http:
            await sup.stop(grace_s=10.0)
            results = await streams
    assert sum(not complete(r, 300) for r in results) == 3


async def test_drain_of_that_release_stops_it_when_the_grace_runs_out(tmp_path):
    async with old_vllm_ready(tmp_path) as sup:
        http, streams = await in_flight(sup, 1, tokens=100_000)  # ~8 minutes of tokens
        async with http:
            await sup.drain(grace_s=2.0)
            (result,) = await streams
        assert sup.phase is Phase.STOPPED
        assert "; SIGTERM with 1 request(s) still in flight after 1.5 s" in sup.last_message
    assert not complete(result, 100_000)
