"""The agent drives an emulated engine release through its production path: version read
from the package METADATA next to the engine's interpreter, the version-table row picked,
the command line in that release's flags, the row reported per deployment.

The emulator runs as that release (`--engine-version`): it refuses options the release does
not know, as the real parser does, so a command line in the wrong release's flags fails here
as it would on a GPU host.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from gearshift.agents.config import AgentConfig
from gearshift.agents.daemon import Agent
from gearshift.common.engine_versions import version_table
from gearshift.common.errors import InvalidArgument
from gearshift.common.spec import DeploymentSpec, Phase
from gearshift.controller.store.database import Store, default_sqlite_url
from gearshift.devfleet.local_fleet import LocalFleet, gearshift_cmd, spawn
from gearshift.v1 import agent_pb2
from integration.helpers import FAST_ENGINE_ENV, engine_prefix, gearshift, gearshift_json, wait_for

WAIT_S = 60.0
FAST = {"GEARSHIFT_EMULATOR_LOAD_S": "0.1", "GEARSHIFT_EMULATOR_TTFT_BASE_S": "0.002",
        "GEARSHIFT_EMULATOR_ITL_S": "0.002"}


def agent_config(tmp_path: Path, python: Path, emulated: str, **deployment: object
                 ) -> AgentConfig:
    return AgentConfig.model_validate({
        "host_id": "h1", "controller": "127.0.0.1:9",  # nothing listens: fail static
        "workdir": str(tmp_path / "agent"), "report_interval_s": 0.2, "drain_on_exit": True,
        "gpus": {"source": "none"},
        "engines": {"tensorrt-llm": {
            "executable": [str(python), "-m", "gearshift.agents.emulator",
                           "--flavor", "tensorrt-llm", "--engine-version", emulated, "--"],
            "env": FAST}},
        "deployments": [{"deployment_id": "t1", "model": "m1", "engine": "tensorrt-llm",
                         "source": "org/model", **deployment}],
    })


@contextlib.asynccontextmanager
async def running(config: AgentConfig) -> AsyncIterator[Agent]:
    agent = Agent(config)
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        agent.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def settled(agent: Agent, deployment_id: str, phases: set[Phase]) -> Phase:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while loop.time() < deadline:
        sup = agent.supervisors.get(deployment_id)
        if sup is not None and sup.phase in phases:
            return sup.phase
        await asyncio.sleep(0.05)
    raise AssertionError(f"{deployment_id} never reached {phases}")


async def test_release_without_config_alias_starts_with_extra_llm_api_options(tmp_path: Path):
    python = engine_prefix(tmp_path / "venv", dist="tensorrt_llm", version="1.1.0")
    async with running(agent_config(tmp_path, python, "1.1.0")) as agent:
        assert await settled(agent, "t1", {Phase.READY, Phase.FAILED}) is Phase.READY
        sup = agent.supervisors["t1"]
        argv = sup.log_path.read_text()
        assert "--extra_llm_api_options" in argv and " --config " not in argv
        assert agent.version_source("tensorrt-llm") == "metadata"
        report = await agent.build_report()
        (dep,) = report.deployments
        assert dep.engine_version == "1.1.0" and dep.engine_release == "1.0"
        assert dep.engine_version_match == agent_pb2.VERSION_MATCH_KNOWN
        # Read under the release's names: that release's Prometheus names have no prefix.
        async with aiohttp.ClientSession() as http, http.post(
                f"{sup.endpoint}/v1/completions",
                json={"model": sup.served_model_name, "prompt": "a b", "max_tokens": 4}) as resp:
            assert resp.status == 200, await resp.text()
        (dep,) = (await agent.build_report()).deployments
        assert dep.ttft.present and dep.ttft.count == 1


async def test_release_with_the_alias_gets_config(tmp_path: Path):
    python = engine_prefix(tmp_path / "venv", dist="tensorrt_llm", version="1.2.1")
    async with running(agent_config(tmp_path, python, "1.2.1")) as agent:
        assert await settled(agent, "t1", {Phase.READY, Phase.FAILED}) is Phase.READY
        assert " --config " in agent.supervisors["t1"].log_path.read_text()


async def test_unknown_version_runs_as_the_newest_row_and_is_flagged(tmp_path: Path):
    """No METADATA and no probe answer: the newest row's `--config`, which the emulated
    1.1.0 refuses exactly as trtllm-serve 1.1 would; the report flags the version."""
    python = engine_prefix(tmp_path / "venv", dist=None)
    async with running(agent_config(tmp_path, python, "1.1.0")) as agent:
        await settled(agent, "t1", {Phase.RESTARTING, Phase.FAILED})
        assert "No such option: --config" in agent.supervisors["t1"].log_path.read_text()
        report = await agent.build_report()
        (dep,) = report.deployments
        assert dep.engine_version == "" and dep.engine_release == "1.3"
        assert dep.engine_version_match == agent_pb2.VERSION_MATCH_UNKNOWN


async def test_pinned_version_mismatch_is_refused_before_anything_starts(tmp_path: Path):
    python = engine_prefix(tmp_path / "venv", dist="tensorrt_llm", version="1.1.0")
    config = agent_config(tmp_path, python, "1.1.0")
    agent = Agent(config.model_copy(update={"deployments": []}))
    agent.read_package_versions()
    spec = DeploymentSpec(deployment_id="t2", model="m1", engine="tensorrt-llm",
                          engine_version="1.2")
    with pytest.raises(InvalidArgument, match=re.escape(
            "pins tensorrt-llm 1.2, this host has tensorrt-llm 1.1.0")):
        await agent.start_deployment(spec)
    assert "t2" not in agent.supervisors


def column_text(table: str, header: str) -> str:
    """The text of one column of a table the CLI printed, its folded lines joined without
    spaces (a cell wraps at spaces and folds long words)."""
    heads = [line.split("┃") for line in table.splitlines() if line.startswith("┃")]
    names = ["".join(parts).replace(" ", "") for parts in zip(*heads, strict=True)]
    at = names.index(header.replace(" ", ""))
    body = [line.split("│") for line in table.splitlines() if line.startswith("│")]
    return "".join(cells[at] for cells in body).replace(" ", "")


def test_a_release_outside_the_table_is_flagged_by_fleet_hosts_and_deployments(
        fleet: LocalFleet, tmp_path: Path) -> None:
    """A live controller and agent as processes, the CLI as a person runs it: vLLM 0.40.0
    (newer than the table), read from its METADATA, runs as the newest row and every view
    says so; the controller's stored host row keeps the row and the match."""
    python = engine_prefix(tmp_path / "venv", dist="vllm", version="0.40.0")
    fleet.start_controller()
    path = fleet.agent_config("host-new", [{"deployment_id": "v40", "model": "m1",
                                            "engine": "vllm", "source": "org/m1"}],
                              FAST_ENGINE_ENV)
    config = yaml.safe_load(path.read_text())
    config["engines"]["vllm"] = {
        "executable": [str(python), "-m", "gearshift.agents.emulator", "--flavor", "vllm",
                       "--engine-version", "0.40.0", "--"],
        "env": FAST_ENGINE_ENV["vllm"]}  # no version: the agent reads the METADATA
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    fleet.procs["host-new"] = spawn("host-new", gearshift_cmd("agent", "--config", str(path)),
                                    fleet.workdir)
    newest = version_table("vllm").rows[-1].label

    def ready() -> dict | None:
        deps = gearshift_json(fleet, "fleet", "deployments")
        return deps[0] if deps and deps[0]["report"]["phase"] == "DEPLOYMENT_PHASE_READY" \
            else None

    dep = wait_for(ready, 60, "the 0.40.0 deployment ready")["report"]
    assert (dep["engine_version"], dep["engine_release"], dep["engine_version_match"]) == (
        "0.40.0", newest, "VERSION_MATCH_NEAREST")
    flag = f"vllm 0.40.0 [as {newest}: outside the version table]"
    (host,) = gearshift_json(fleet, "fleet", "hosts")
    (vllm,) = [e for e in host["engines"] if e["engine"] == "vllm"]
    assert (vllm["version"], vllm["release"], vllm["version_match"], vllm["version_source"]) \
        == ("0.40.0", newest, "VERSION_MATCH_NEAREST", "metadata")
    for command in (("fleet", "hosts"), ("fleet", "deployments"),
                    ("fleet", "deployments", "-o", "wide")):
        out = gearshift(fleet, *command).stdout
        cell = column_text(out, "engines" if command[1] == "hosts" else "engine")
        assert flag.replace(" ", "") in cell, (command, out)

    def stored() -> list | None:
        row = Store.open(default_sqlite_url(fleet.workdir / "data")).get_host("host-new")
        return row.engines if row is not None else None

    engines = wait_for(stored, 30, "the host row written")
    assert {"engine": "vllm", "version": "0.40.0", "release": newest,
            "version_match": "nearest", "version_source": "metadata"}.items() <= \
        next(e for e in engines if e["engine"] == "vllm").items()
