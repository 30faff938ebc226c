"""The README's quickstart agent, as pasted: `gearshift agent --config
deploy/examples/agent-emulated.yaml` (only the ports moved to free ones) joins a
controller and its deployment gets ready on emulated GPUs and engines."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from grpc import aio

from gearshift.controller.server import Controller
from gearshift.devfleet.local_fleet import free_port
from gearshift.v1 import agent_pb2, control_pb2, control_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "examples" / "agent-emulated.yaml"


async def _ready_deployments(ctl: Controller) -> set[str]:
    async with aio.insecure_channel(f"127.0.0.1:{ctl.port}") as channel:
        resp = await control_pb2_grpc.ControlServiceStub(channel).ListDeployments(
            control_pb2.ListDeploymentsRequest(), timeout=5)
    return {d.report.deployment_id for d in resp.deployments
            if d.report.phase == agent_pb2.DEPLOYMENT_PHASE_READY}


def _readyz(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return str(r.read().decode())
    except OSError as exc:
        return f"not ready ({exc})"


async def test_the_quickstart_agent_serves_its_deployment(controller: Controller,
                                                          tmp_path: Path) -> None:
    venv_bin = str(Path(sys.executable).parent)  # `gearshift` on PATH, as after `make`
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
    env |= {"PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', '')}",
            "GEARSHIFT_EMULATOR_LOAD_S": "0.3", "PYTHONUNBUFFERED": "1"}
    ops = free_port()
    log = (tmp_path / "agent.log").open("wb")
    proc = subprocess.Popen(
        ["gearshift", "agent", "--config", str(EXAMPLE), "--controller",
         f"127.0.0.1:{controller.port}", "--metrics-listen", f"127.0.0.1:{ops}",
         "--drain-on-exit"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
        start_new_session=True)
    log.close()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        while not await _ready_deployments(controller):
            assert proc.poll() is None and loop.time() < deadline, \
                (tmp_path / "agent.log").read_text()[-3000:]
            await asyncio.sleep(0.2)
        assert _readyz(f"http://127.0.0.1:{ops}/readyz").startswith("ready: connected to")
        assert (tmp_path / "agent-data").is_dir()  # the work dir: under where it was run
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
