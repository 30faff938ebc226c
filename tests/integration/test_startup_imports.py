"""What the everyday commands import: each one loads only what it needs.

Each command runs in its own child process through the CLI's `main` (as the installed
`gearshift` script does); when the child exits it writes the names in `sys.modules`,
and the test compares them with that command's allowed set, naming every module that
should not be there. `fleet status` and the agent run against a real controller on
loopback (SQLite): the agent until its engine's figures have reached the controller,
then stopped with SIGTERM, so its connect, scrape and report paths have all run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc
import pytest

from gearshift.devfleet.local_fleet import LocalFleet, Proc, wait_ready_file
from gearshift.v1 import agent_pb2, agent_pb2_grpc, control_pb2, control_pb2_grpc
from integration.helpers import FAST_ENGINE_ENV, wait_for

REPO = Path(__file__).resolve().parents[2]
POLICY_FILE = REPO / "policies" / "examples" / "default.yaml"

# Runs the CLI's entry point and, at exit, writes sys.modules to the path in argv[1].
RUNNER = """
import atexit, json, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
from gearshift.cli.main import main
main()
"""

# Third-party packages by top-level name, each with what it imports of its own.
CLICK = {"click"}
YAML = {"yaml"}
PYDANTIC = {"pydantic", "pydantic_core", "annotated_types", "typing_extensions",
            "typing_inspection"}
CRON = {"apscheduler", "tzlocal", "tzdata"}  # a policy's `schedule` is checked as a cron expression
# grpc's __init__ imports its sibling packages (tools, health, reflection) when installed.
GRPC = {"grpc", "grpc_tools", "grpc_health", "grpc_reflection", "grpc_status", "google",
        "typing_extensions"}
RICH = {"rich", "pygments", "markdown_it", "mdurl"}
AIOHTTP = {"aiohttp", "aiohappyeyeballs", "aiosignal", "attr", "frozenlist", "multidict",
           "propcache", "yarl", "idna"}
PROMETHEUS = {"prometheus_client"}
PSUTIL = {"psutil"}  # the agent identifies the engines it adopts by process start time

# gearshift modules. SHARED is `gearshift.common` as a client uses it (errors, the
# controller's addresses, client credentials, identity): nothing of the controller.
ROOT = {"gearshift", "gearshift.cli", "gearshift.cli.main", "gearshift.cli.lazy_group"}
ERRORS = {"gearshift.common", "gearshift.common.errors"}
# the catalog, its entries' types and its version tables
ENGINES = {"gearshift.common.engines", "gearshift.common.engine_facts",
           "gearshift.common.engine_versions"}
SHARED = ERRORS | {"gearshift.common.endpoints", "gearshift.common.credentials",
                   "gearshift.common.identity"}
POLICY_LOADER = {"gearshift.policies", "gearshift.policies.loader", "gearshift.policies.schema",
                 "gearshift.policies.rules", "gearshift.policies.signals",
                 "gearshift.policies.model_history",  # the signals module's history half
                 "gearshift.policies.economics", "gearshift.policies.costmodel",
                 "gearshift.policies.trace", "gearshift.policies.semantics",
                 "gearshift.common.frozen_records"}  # the records' constructor (stdlib only)
CONTROL_CLIENT = {"gearshift.cli.client", "gearshift.cli.output", "gearshift.v1",
                  "gearshift.v1.control_pb2", "gearshift.v1.control_pb2_grpc",
                  "gearshift.v1.agent_pb2", "gearshift.common.enum_labels",
                  "gearshift.v1.enrol_pb2"}  # messages of ControlService's enrolment calls
AGENT_PACKAGES = ("gearshift.agents.metrics", "gearshift.agents.runtimes")  # and their modules
AGENT = {"gearshift.agents", "gearshift.agents.config", "gearshift.agents.daemon",
         "gearshift.agents.commands", "gearshift.agents.gpus", "gearshift.cli.daemons",
         "gearshift.agents.engine_version", "gearshift.common.spec", *ENGINES,
         "gearshift.agents.handover", "gearshift.agents.ops_metrics", "gearshift.common.ops_http",
         "gearshift.v1", "gearshift.v1.agent_pb2", "gearshift.v1.agent_pb2_grpc"}


# Loaded by the first forecast or capacity fit (a policy asking for one), never at start:
# together they were most of the controller's start-up memory.
LEARNING_LIBRARIES = {"sklearn", "scipy"}


def _base_modules() -> set[str]:
    """What a bare interpreter of this environment has loaded (site, path hooks)."""
    out = subprocess.run([sys.executable, "-c", "import sys; print('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


BASE = _base_modules()


def not_allowed(modules: Iterable[str], third_party: set[str], gearshift: set[str],
                gearshift_packages: tuple[str, ...] = ()) -> list[str]:
    """Modules outside the allowed set, listed by top-level package for third parties."""
    bad: set[str] = set()
    for name in modules:
        top = name.partition(".")[0]
        if name in BASE or top in sys.stdlib_module_names or top == "__main__":
            continue
        if top == "gearshift":
            if name not in gearshift and not name.startswith(
                    tuple(p + "." for p in gearshift_packages)) and name not in gearshift_packages:
                bad.add(name)
        elif top.startswith(("_cython_", "cython_runtime", "_sysconfigdata_")):
            continue  # made by any Cython extension module; sysconfig's own data
        elif top not in third_party:
            bad.add(top)
    return sorted(bad)


def _cli_argv(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-c", RUNNER, str(out), *args]


def run_cli(tmp_path: Path, *args: str, expect_rc: int = 0) -> list[str]:
    out = tmp_path / "modules.json"
    proc = subprocess.run(_cli_argv(out, *args), capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect_rc, f"{args}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def assert_allowed(what: str, modules: list[str], third_party: set[str], gearshift: set[str],
                   gearshift_packages: tuple[str, ...] = ()) -> None:
    bad = not_allowed(modules, third_party, gearshift, gearshift_packages)
    assert not bad, f"`{what}` imported modules outside its allowed set: {', '.join(bad)}"


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    fleet = LocalFleet(tmp_path_factory.mktemp("imports") / "fleet", report_interval_s=0.5)
    try:
        fleet.start_controller()
        yield fleet
    finally:
        fleet.stop()


def test_help_imports_click_and_the_command_registry_only(tmp_path: Path) -> None:
    """And the catalog, for the engines the root help names (about 25 ms of imports)."""
    modules = run_cli(tmp_path, "--help")
    assert_allowed("gearshift --help", modules, CLICK,
                   ROOT | ERRORS | {"gearshift.common.engines", "gearshift.common.engine_facts"})


def test_policy_validate_needs_no_grpc_numpy_or_controller(tmp_path: Path) -> None:
    modules = run_cli(tmp_path, "policy", "validate", str(POLICY_FILE))
    assert_allowed("gearshift policy validate", modules, CLICK | YAML | PYDANTIC | CRON,
                   ROOT | ERRORS | ENGINES | {"gearshift.cli.policy_cmds"} | POLICY_LOADER)


def test_fleet_status_imports_the_client_side_only(tmp_path: Path, controller: LocalFleet) -> None:
    modules = run_cli(tmp_path, "--controller", controller.controller_addr, "fleet", "status")
    assert_allowed("gearshift fleet status", modules, CLICK | GRPC | RICH,
                   ROOT | SHARED | CONTROL_CLIENT | {"gearshift.cli.fleet"})


def test_the_check_names_what_should_not_be_there() -> None:
    # The allowed-set check itself, on a list as a heavier command would produce it.
    modules = ["click", "json", "numpy.core", "sklearn", "gearshift.cli.main",
               "gearshift.controller.errors", "gearshift.agents.metrics.scraper"]
    assert not_allowed(modules, CLICK, ROOT, AGENT_PACKAGES) == [
        "gearshift.controller.errors", "numpy", "sklearn"]


def _deployment_reported(addr: str, deployment_id: str) -> bool:
    with grpc.insecure_channel(addr) as channel:
        resp = control_pb2_grpc.ControlServiceStub(channel).ListDeployments(
            control_pb2.ListDeploymentsRequest(), timeout=5)
    return any(d.report.deployment_id == deployment_id and d.report.metrics_present
               and d.report.phase == agent_pb2.DEPLOYMENT_PHASE_READY for d in resp.deployments)


def test_agent_imports_no_controller_policy_or_learning_code(tmp_path: Path,
                                                             controller: LocalFleet) -> None:
    dep = {"deployment_id": "imports-vllm", "model": "imports", "engine": "vllm",
           "gpu_indices": [0]}
    config = controller.agent_config("imports-host", [dep], FAST_ENGINE_ENV)
    out = tmp_path / "modules.json"
    log = (tmp_path / "agent.log").open("wb")
    proc = subprocess.Popen(_cli_argv(out, "agent", "--config", str(config)), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    log.close()
    try:
        wait_for(lambda: _deployment_reported(controller.controller_addr, "imports-vllm"), 90,
                 "the agent's engine ready, with figures, at the controller")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    modules = json.loads(out.read_text())
    assert "gearshift.agents.metrics.scraper" in modules  # the scrape path really ran
    assert_allowed("gearshift agent", modules, CLICK | YAML | PYDANTIC | GRPC | AIOHTTP | PROMETHEUS | PSUTIL,
                   ROOT | SHARED | AGENT, AGENT_PACKAGES)


def _report_once(addr: str) -> None:
    """One agent's Hello and a Report with figures, through the controller's ingest path."""
    dep = agent_pb2.DeploymentReport(
        deployment_id="imports-d0", model="imports", engine="vllm", engine_version="0.11.0",
        phase=agent_pb2.DEPLOYMENT_PHASE_READY, endpoint="http://127.0.0.1:8000",
        request_rate=5.0, metrics_present=True)
    dep.ttft.present, dep.ttft.p50_s, dep.ttft.p99_s, dep.ttft.count = True, 0.05, 0.2, 10
    hello = agent_pb2.AgentMessage(hello=agent_pb2.Hello(
        host_id="imports-host", agent_version="test",
        protocol_version=agent_pb2.PROTOCOL_VERSION_1, emulated_gpus=True))
    report = agent_pb2.AgentMessage(report=agent_pb2.Report(seq=1, interval_s=0.5,
                                                            deployments=[dep]))
    with grpc.insecure_channel(addr) as channel:
        replies = agent_pb2_grpc.AgentServiceStub(channel).Connect(iter([hello, report]),
                                                                   timeout=30)
        kinds = [m.WhichOneof("body") for m in replies]
    assert kinds == ["welcome", "ack"], kinds


def test_controller_loads_no_learning_library_until_a_fit(tmp_path: Path) -> None:
    out = tmp_path / "modules.json"
    ready = tmp_path / "controller.ready"
    log = (tmp_path / "controller.log").open("wb")
    popen = subprocess.Popen(
        _cli_argv(out, "controller", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
                  "--metrics-port", "0", "--report-interval", "0.5", "--ready-file", str(ready)),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    log.close()
    proc = Proc("controller", popen, tmp_path / "controller.log")
    try:
        port = int(wait_ready_file(ready, proc).split()[0])
        _report_once(f"127.0.0.1:{port}")  # stopping then folds its minute into the learner
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(30) == 0, proc.log()[-3000:]
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(5)
    modules = json.loads(out.read_text())
    assert "gearshift.controller.decisions.learning" in modules  # the learner was there, and fed
    assert "gearshift.policies.capacity" in modules
    loaded = sorted(LEARNING_LIBRARIES & {m.partition(".")[0] for m in modules})
    assert not loaded, f"the controller imported {loaded} before any fit"
