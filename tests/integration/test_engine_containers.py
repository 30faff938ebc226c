"""Engines as containers, on real Podman: the agent runs vLLM, TensorRT-LLM and SGLang
from their (emulated) images through Podman's Docker-compatible API, as an operator's
`containers: {runtime: podman}` config asks.

- One agent moves model `m` vLLM -> TensorRT-LLM -> SGLang under gateway load, on the
  GPUs it has, with no failed request. The agent is SIGKILLed and started again: it
  adopts the same container. An engine container is killed: it is restarted, and the
  exit code is in the agent log. `gearshift agent drain` leaves no container.
- A move to an image that does not exist rolls back with the runtime's own message.
- An image pulled from a real registry (Debian's docker-registry on loopback) shows the
  pulling phase with its bytes in the agent's report.

The images are those of `make image-engines` (scripts/build-engine-images.sh; podman's
layer cache makes a rebuild with unchanged sources take seconds). Skipped, with the
reason, where podman is missing or cannot run containers. Cost: about 3 minutes in all
once the images exist (about 4 more to build them on a fresh machine)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gearshift.agents.config import parse_agent_config
from gearshift.agents.daemon import Agent
from gearshift.common.spec import DeploymentSpec, Phase
from gearshift.devfleet.local_fleet import LocalFleet
from gearshift.devfleet.podman_service import EMULATED_IMAGES, PodmanService, configured_ulimits
from gearshift.devfleet.ports import free_port
from gearshift.v1 import agent_pb2
from integration.docker_daemon import DockerDaemon
from integration.helpers import FAST_ENGINE_ENV, gateway_load, gearshift, gearshift_json, wait_for
from integration.moves import _apply, _engines, _migration_done
from integration.podman import REPO, podman_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(os.geteuid() != 0, reason="runs podman as root (rootful "
                                 "engine containers, as on a GPU host)")]

IMAGES = EMULATED_IMAGES
CONTROLLER_ARGS = ("--history-resolution", "0.5", "--canary-steps", "0.5",
                   "--analysis-intervals", "2")
ENGINE_ENV = {**FAST_ENGINE_ENV, "sglang": {"GEARSHIFT_EMULATOR_LOAD_S": "0.3"}}
DEPLOYMENT_LABEL = "dev.gearshift.deployment"
HOST_LABEL = "dev.gearshift.host"


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], str]]:
    """(podman's environment, the URL of a Podman API service of this module's own), with
    the emulated engine images built as `make image-engines` builds them."""
    env = podman_env()
    started = time.monotonic()
    build = subprocess.run([str(REPO / "scripts" / "build-engine-images.sh")],
                           capture_output=True, text=True, env={**env, "CONTAINER": "podman"},
                           timeout=1500)
    assert build.returncode == 0, build.stderr[-4000:]
    assert build.stdout.split() == list(IMAGES.values()), build.stdout
    print(f"engine images ready in {time.monotonic() - started:.0f} s")
    service = PodmanService(tmp_path_factory.mktemp("podman"), env)
    service.start()
    try:
        yield env, service.url
    finally:
        service.stop()


@dataclass
class Runtime:
    """A container runtime as its own command line sees it (`podman` or `docker`)."""

    name: str
    env: dict[str, str]
    url: str

    def cli(self, *args: str) -> str:
        return subprocess.run([self.name, *args], capture_output=True, text=True,
                              env=self.env, timeout=120, check=True).stdout

    def containers(self, host_id: str) -> list[dict]:
        """This host's engine containers: `inspect` of each (the same shape in both)."""
        ids = self.cli("ps", "--all", "--quiet", "--no-trunc", "--filter",
                       f"label={HOST_LABEL}={host_id}").split()
        return json.loads(self.cli("inspect", *ids)) if ids else []

    def remove_host_containers(self, host_id: str) -> None:
        for c in self.containers(host_id):
            subprocess.run([self.name, "rm", "--force", c["Id"]], env=self.env,
                           capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def docker(podman: tuple[dict[str, str], str]) -> Iterator[Runtime]:
    """A dockerd of this module's own with the emulated engine images loaded."""
    daemon = DockerDaemon()
    daemon.start()
    try:
        daemon.load_from_podman(list(IMAGES.values()), podman[0])
        yield Runtime("docker", daemon.env, daemon.url)
    finally:
        daemon.stop()


@pytest.fixture(params=["podman", "docker"])
def runtime(request: pytest.FixtureRequest, podman: tuple[dict[str, str], str]) -> Runtime:
    if request.param == "docker":
        return request.getfixturevalue("docker")
    return Runtime("podman", *podman)


@pytest.fixture
def container_fleet(fleet: LocalFleet, runtime: Runtime) -> Iterator[tuple[LocalFleet, Runtime]]:
    fleet.containers = {"runtime": runtime.name, "endpoint": runtime.url}
    if runtime.name == "podman":
        fleet.containers["ulimits"] = configured_ulimits(runtime.env)
    fleet.images = dict(IMAGES)
    try:
        yield fleet, runtime
    finally:
        fleet.stop()
        for host in ("host-a", "host-b"):  # a failed test's leftovers (its asserts say why)
            runtime.remove_host_containers(host)


def _drain(fleet: LocalFleet, host_id: str) -> str:
    cmd = [sys.executable, "-m", "gearshift.cli.main", "agent", "drain", "--config",
           str(fleet.workdir / f"{host_id}.yaml"), "--grace", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_model_moves_between_engine_images_under_load(
        container_fleet: tuple[LocalFleet, Runtime], tmp_path: Path) -> None:
    fleet, rt = container_fleet
    fleet.start_controller(CONTROLLER_ARGS)
    fleet.start_agent("host-a", [{"deployment_id": "m-vllm-0", "model": "m", "engine": "vllm",
                                  "source": "org/m", "revision": "r1", "gpu_indices": [0]}],
                      ENGINE_ENV)
    wait_for(lambda: any(d["report"]["phase"] == "DEPLOYMENT_PHASE_READY"
                         for d in gearshift_json(fleet, "fleet", "deployments")), 120, "m ready")
    [first] = rt.containers("host-a")
    assert first["Config"]["Labels"][DEPLOYMENT_LABEL] == "m-vllm-0"
    assert first["State"]["Status"] == "running"
    [dep] = gearshift_json(fleet, "fleet", "deployments")
    assert dep["report"]["image"] == IMAGES["vllm"]
    assert dep["report"]["image_digest"].startswith("sha256:")
    hosts = gearshift(fleet, "fleet", "hosts").stdout
    assert "0.11.0" in hosts, hosts  # the version read from the image's label
    fleet.start_gateway()

    with gateway_load(fleet.gateway_url, "m") as load:
        for engine in ("tensorrt-llm", "sglang"):
            _apply(fleet, tmp_path, f"to-{engine}", "auto", engine)
            done = wait_for(lambda e=engine: _migration_done(fleet, e), 240,
                            f"the move to {engine}")
            assert done["phase"] == "done", done
            wait_for(lambda e=engine: _engines(fleet) == {e}, 60, f"only {engine} serving m")
            phases = [s["to_phase"] for s in gearshift_json(fleet, "migrations", "show",
                                                            done["id"])["steps"]]
            assert phases.index("pulling") < phases.index("starting"), phases  # image first
            running = [c for c in rt.containers("host-a") if c["State"]["Status"] == "running"]
            assert [c["Config"]["Labels"][DEPLOYMENT_LABEL] for c in running] == \
                done["target_deployments"], running  # the source's container is gone

        # The agent dies; its successor adopts the container, which never stopped.
        [serving] = rt.containers("host-a")
        fleet.procs["host-a"].kill()
        fleet.start_agent("host-a", [], ENGINE_ENV)
        wait_for(lambda: "adopted engine container" in fleet.procs["host-a"].log(), 60,
                 "the new agent to adopt the container")
        [still] = rt.containers("host-a")
        assert still["Id"] == serving["Id"] and still["State"]["Status"] == "running"
        time.sleep(3)  # traffic through the adopted engine
        assert load.failed == 0, load.errors[:5]

        # The engine container dies: the agent restarts it, and says why in its log.
        rt.cli("kill", "--signal", "KILL", serving["Id"])
        wait_for(lambda: "exited with code 137" in fleet.procs["host-a"].log(), 60,
                 "the agent to log the container's exit code")
        wait_for(lambda: any(d["report"]["phase"] == "DEPLOYMENT_PHASE_READY"
                             and d["report"]["restarts"] >= 1
                             for d in gearshift_json(fleet, "fleet", "deployments")), 120,
                 "the restarted engine to be ready")
        # (requests in flight when the only replica was killed fail: not counted here)
    assert load.sent > 100

    fleet.procs["host-a"].terminate()
    drained = _drain(fleet, "host-a")
    assert "removed" in drained, drained
    assert rt.containers("host-a") == []


@pytest.mark.parametrize("runtime", ["podman"], indirect=True)
def test_a_move_to_a_missing_image_rolls_back_with_the_runtimes_message(
        container_fleet: tuple[LocalFleet, Runtime], tmp_path: Path) -> None:
    fleet, rt = container_fleet
    fleet.images["tensorrt-llm"] = "localhost/gearshift-emulated-tensorrt-llm:0.0.0-missing"
    fleet.start_controller(CONTROLLER_ARGS)
    fleet.start_agent("host-a", [{"deployment_id": "m-vllm-0", "model": "m", "engine": "vllm",
                                  "source": "org/m", "revision": "r1", "gpu_indices": [0]}],
                      ENGINE_ENV)
    wait_for(lambda: any(d["report"]["phase"] == "DEPLOYMENT_PHASE_READY"
                         for d in gearshift_json(fleet, "fleet", "deployments")), 120, "m ready")
    fleet.start_gateway()
    with gateway_load(fleet.gateway_url, "m", rps=10) as load:  # traffic makes the rule fire
        _apply(fleet, tmp_path, "to-trt", "auto", "tensorrt-llm", cooldown="1h")
        rolled = wait_for(lambda: next((m for m in gearshift_json(fleet, "migrations", "list")
                                        if m["phase"] == "rolled_back"), None), 120,
                          "the move to roll back")
    assert load.failed == 0, load.errors[:5]
    shown = gearshift(fleet, "migrations", "show", rolled["id"]).stdout
    # Podman's own words for a registry it cannot reach (localhost serves none here).
    assert "0.0.0-missing" in shown and "pinging container registry" in shown, shown
    explained = gearshift(fleet, "decisions", "explain", rolled["decision_id"]).stdout
    assert "pinging container registry" in explained, explained
    assert _engines(fleet) == {"vllm"}
    fleet.procs["host-a"].terminate()
    _drain(fleet, "host-a")
    assert rt.containers("host-a") == []


@pytest.fixture
def registry(podman: tuple[dict[str, str], str], tmp_path: Path) -> Iterator[str]:
    """Debian's docker-registry (the CNCF distribution registry) on a loopback port."""
    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.skip("docker-registry is not installed (scripts/podman-setup.sh installs it)")
    port = free_port()
    config = tmp_path / "registry.yml"
    config.write_text(yaml.safe_dump({
        "version": 0.1, "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(tmp_path / "registry")}},
        "http": {"addr": f"127.0.0.1:{port}"}}))
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: subprocess.run(["curl", "-fsS", f"http://127.0.0.1:{port}/v2/"],
                                        capture_output=True).returncode == 0, 30,
                 "the registry to answer")
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


async def _slow_link(upstream: str, bytes_per_s: float) -> asyncio.Server:
    """A TCP relay on loopback to `upstream` whose answers move at `bytes_per_s`: a
    registry at the far end of a WAN link (Podman reports pull progress once a second,
    so a pull over loopback ends before it says anything)."""
    host, port = upstream.rsplit(":", 1)

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, rate: float) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
                if rate:
                    await asyncio.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            dst.close()

    async def relay(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pump(r, uw, 0), pump(ur, w, bytes_per_s))

    return await asyncio.start_server(relay, "127.0.0.1", 0)


async def test_an_image_pulled_from_a_registry_reports_its_progress(
        podman: tuple[dict[str, str], str], registry: str, tmp_path: Path) -> None:
    env, _ = podman
    # An image with a layer of its own (24 MB that do not compress), pushed and then
    # removed here, so that the pull has bytes to move, over a link of 8 MB/s.
    pushed = f"{registry}/gearshift-emulated-vllm:0.11.0-pull"
    context = tmp_path / "ctx"
    context.mkdir()
    (context / "Containerfile").write_text(
        f"FROM {IMAGES['vllm']}\nRUN head -c 24000000 /dev/urandom > /blob\n")
    for cmd in (["build", "--tag", pushed, str(context)],
                ["push", "--tls-verify=false", pushed], ["rmi", pushed]):
        done = subprocess.run(["podman", *cmd], capture_output=True, text=True, env=env,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    link = await _slow_link(registry, 8e6)
    far = f"127.0.0.1:{link.sockets[0].getsockname()[1]}"
    ref = pushed.replace(registry, far)
    # The service pulls from the plain-HTTP registry as registries.conf allows.
    conf = tmp_path / "registries.conf"
    conf.write_text(f'[[registry]]\nlocation = "{far}"\ninsecure = true\n')
    service = PodmanService(tmp_path / "svc", {**env, "CONTAINERS_REGISTRIES_CONF": str(conf)})
    service.start()
    cfg = parse_agent_config({
        "host_id": "pull-host", "workdir": str(tmp_path / "agent"),
        "gpus": {"source": "emulated", "emulated": {"count": 1}},
        "containers": {"runtime": "podman", "endpoint": service.url, "ulimits": configured_ulimits(env)},
        "engines": {"vllm": {"image": ref, "env": FAST_ENGINE_ENV["vllm"]}}})
    agent = Agent(cfg)
    import aiohttp
    agent._session = aiohttp.ClientSession()
    seen: list[agent_pb2.DeploymentReport] = []
    try:
        spec = DeploymentSpec(deployment_id="p-vllm-0", model="p", engine="vllm")
        starting = asyncio.ensure_future(agent.start_deployment(spec))
        while not starting.done():
            report = await agent.build_report()
            seen += [d for d in report.deployments
                     if d.phase == agent_pb2.DEPLOYMENT_PHASE_PULLING]
            await asyncio.sleep(0.02)
        sup = await starting
        assert await sup.wait_ready(60), sup.last_message
        assert seen, "no report in the pulling phase"
        assert max(d.pull_bytes_total for d in seen) > 20_000_000, seen[-1]
        assert any(0 < d.pull_bytes_done < d.pull_bytes_total for d in seen), seen
        report = await agent.build_report()
        [d] = report.deployments
        assert d.image == ref and d.image_digest.startswith("sha256:")
        assert agent.version_source("vllm") == "image-label"
        assert sup.phase is Phase.READY
    finally:
        await agent.shutdown(drain=True, grace_s=2)
        service.stop()
        link.close()
        subprocess.run(["podman", "rmi", "--force", ref], env=env, capture_output=True,
                       timeout=120)
        Runtime("podman", env, "").remove_host_containers("pull-host")
    assert Runtime("podman", env, "").containers("pull-host") == []


def test_an_agent_as_an_operator_configures_it_with_podman_defaults(
        podman: tuple[dict[str, str], str], tmp_path: Path) -> None:
    """`containers: {runtime: podman}` and an image, nothing else: the agent starts
    Podman's API service at its default socket where none answers, runs the engine as a
    labelled container, a SIGKILLed agent's successor finds it serving, and `gearshift
    agent drain --config` leaves no container (no controller: fail static)."""
    env, _ = podman
    host, port = "owner-host", free_port()
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "host_id": host, "workdir": "work", "controller": "127.0.0.1:1",
        "gpus": {"source": "emulated", "emulated": {"count": 1}},
        "containers": {"runtime": "podman"},
        "engines": {"vllm": {"image": IMAGES["vllm"], "env": FAST_ENGINE_ENV["vllm"]}},
        "deployments": [{"deployment_id": "own-vllm-0", "model": "m", "engine": "vllm",
                         "port": port}]}))
    socket_path = Path("/run/podman/podman.sock")
    served_before = socket_path.exists()
    agent_env = {k: v for k, v in env.items() if k != "CONTAINERS_CONF"} \
        if Path("/etc/containers/containers.conf").exists() else env
    rt = Runtime("podman", env, "")
    cmd = [sys.executable, "-m", "gearshift.cli.main", "agent", "--config", str(config)]

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(cmd, env=agent_env, cwd=tmp_path, start_new_session=True,
                                stdout=(tmp_path / "agent.log").open("ab"),
                                stderr=subprocess.STDOUT)

    def serving() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    agent = start()
    try:
        wait_for(serving, 120, "the engine container to serve")
        [first] = rt.containers(host)
        assert first["Config"]["Labels"][DEPLOYMENT_LABEL] == "own-vllm-0"
        agent.kill()
        agent.wait(10)
        agent = start()
        wait_for(lambda: "adopted engine container" in (tmp_path / "agent.log").read_text(),
                 60, "the new agent to adopt the container")
        [still] = rt.containers(host)
        assert still["Id"] == first["Id"] and serving()
        agent.terminate()
        agent.wait(30)
        drained = subprocess.run([*cmd[:-3], "agent", "drain", "--config", str(config),
                                  "--grace", "5"], env=agent_env, cwd=tmp_path,
                                 capture_output=True, text=True, timeout=120)
        assert drained.returncode == 0, drained.stderr
        assert rt.containers(host) == []
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        rt.remove_host_containers(host)
        if not served_before:  # the service this test had the agent start
            subprocess.run(["pkill", "-f", "podman system service --time=0 "
                            "unix:///run/podman/podman.sock"], capture_output=True)
