"""The ingest bench's hand-written agent client (bench/agent_wire.py) against a real
controller: what the controller answers reaches the simulated agent as gRPC's own client
would see it, and a small bench run acks every report with either client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from gearshift.controller.server import Controller
from gearshift.v1 import agent_pb2

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import agent_wire  # noqa: E402  (bench/ is not a package)


class Stream:
    def __init__(self) -> None:
        self.bodies: list[str] = []
        self.ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def on_message(self, data: bytes) -> None:
        self.bodies.append(str(agent_pb2.ControllerMessage.FromString(data).WhichOneof("body")))

    def on_end(self, error: str) -> None:
        self.ended.set_result(error)


def hello(host_id: str) -> bytes:
    return agent_pb2.AgentMessage(hello=agent_pb2.Hello(
        host_id=host_id, agent_version="test",
        protocol_version=agent_pb2.PROTOCOL_VERSION_1)).SerializeToString()


async def test_the_controllers_status_and_acks_reach_the_wire_client(controller: Controller) -> None:
    conn = await agent_wire.connect("127.0.0.1", controller.port, "/gearshift.v1.AgentService/Connect")
    try:
        refused = Stream()
        sid = conn.open_stream(refused)
        conn.send(sid, agent_pb2.AgentMessage(report=agent_pb2.Report(seq=1)).SerializeToString())
        assert await asyncio.wait_for(refused.ended, 10) == (
            "FAILED_PRECONDITION: the first message must be a hello, found report")

        agent = Stream()
        sid = conn.open_stream(agent)
        conn.send(sid, hello("wire-1"))
        report = agent_pb2.Report(seq=1)
        report.deployments.add(deployment_id="d1", engine="vllm", model="m",
                               phase=agent_pb2.DEPLOYMENT_PHASE_READY)
        conn.send(sid, agent_pb2.AgentMessage(report=report).SerializeToString())
        for _ in range(100):
            if len(agent.bodies) == 2:
                break
            await asyncio.sleep(0.05)
        assert agent.bodies == ["welcome", "ack"]
        # Larger than HTTP/2's initial windows (64 KB): sent as the server's
        # WINDOW_UPDATEs allow, read whole, and refused for what it holds.
        big = agent_pb2.Report(seq=2)
        for i in range(300):
            big.deployments.add(deployment_id=f"d{i}", engine="vllm", model="m" * 300)
        assert big.ByteSize() > 65_535
        conn.send(sid, agent_pb2.AgentMessage(report=big).SerializeToString())
        assert await asyncio.wait_for(agent.ended, 10) == (
            "INVALID_ARGUMENT: report.deployments: at most 256, found 300")
    finally:
        conn.close()


def small_bench_run(*args: str) -> dict[str, Any]:
    """bench/ingest.py with 20 agents reporting every 0.5 s for 2 s: its JSON, once every
    report was acked on every stream (40 a second)."""
    out = subprocess.run(
        [sys.executable, str(BENCH / "ingest.py"), "--agents", "20", "--interval-s", "0.5",
         "--duration-s", "2", *args],
        capture_output=True, text=True, timeout=90, check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    assert result["streams_failed"] == 0, result["stream_errors"]
    assert result["lost_reports"] == 0
    assert result["reports_per_s"] == pytest.approx(40, rel=0.1)
    return result


@pytest.mark.parametrize("client", ["wire", "grpc"])
def test_a_small_bench_run_acks_every_report(client: str) -> None:
    result = small_bench_run("--agent-client", client)
    assert result["server"] == "controller"
    assert result["report_bytes"] == 1726
    assert result["controller_fds"] >= 20  # a connection per agent, as agent hosts hold
    if client == "wire":
        # No bandwidth-delay probe: with gRPC's default it pinged for most reports here
        # (0.64 a report; 1.0 at 10 s intervals, past the probe's longest delay). What is
        # left is keepalive's, one per connection in 20 s.
        assert 0 <= result["server_pings_per_report"] < 0.1
    else:
        assert result["server_pings_per_report"] is None  # gRPC's client hides them
    split = result["controller_split"]  # the loop's time applying reports, from its metric
    assert 0 < split["handle_us_per_report"] < 1e6
    assert 0 <= split["handle_cores"] <= split["event_loop_cores"] + 0.05
    machine = result["machine"]  # how fast the machine was, before and after
    assert len(machine["loop_1e7_add_s"]) == 2 and min(machine["loop_1e7_add_s"]) > 0
    assert 0 <= machine["steal_share"] <= 1 and machine["cpus"] >= 1


def test_the_grpc_floor_serves_the_bench_in_place_of_the_controller() -> None:
    """`--floor` (bench/grpc_floor.py): the same agents read and acked by a bare gRPC
    server, measured as the controller is, and stopped with the bench."""
    result = small_bench_run("--floor")
    assert result["server"] == "grpc-floor"
    assert result["controller_cores"] > 0 and result["controller_rss_mb"] > 0
    assert "handle_cores" not in result["controller_split"]  # no controller metrics to read
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if any("grpc_floor.py" in part for part in p.info["cmdline"] or ())]
    assert left == []


def test_the_replay_bench_digests_a_recorded_stream_the_same_each_time(tmp_path: Path) -> None:
    """bench/ingest_replay.py: what two controllers are compared on (stored rows, rollup
    rows, the fleet, every answer) depends on the recorded stream alone."""
    stream = tmp_path / "stream.bin"
    subprocess.run([sys.executable, str(BENCH / "ingest_replay.py"), "record", "--agents", "60",
                    "--intervals", "8", "-o", str(stream)], check=True, timeout=60)
    runs = [json.loads(subprocess.run(
        [sys.executable, str(BENCH / "ingest_replay.py"), "replay", str(stream)],
        capture_output=True, text=True, timeout=90, check=True).stdout) for _ in range(2)]
    assert runs[0]["digests"] == runs[1]["digests"]
    assert runs[0]["reports"] == 480 and runs[0]["rollup_rows"] > 0
    assert set(runs[0]["digests"]) == {"rollup_rows_built", "fleet", "answers", "stored"}
