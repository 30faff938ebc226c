"""The images as shipped, run as containers: a controller, two agents whose engines are
the emulator, and a gateway, each in its own container on a private podman network, with
mutual TLS (the agents join by bootstrap token: no agent key is made outside its
container) and the hardening the Kubernetes manifests
ask for (read-only root filesystem, no capabilities, no privilege escalation, user
10001). Clients load the gateway through its published loopback port while a policy
moves model `m` from vLLM to TensorRT-LLM: no request fails, and every container stops
cleanly on SIGTERM (exit 0) and is removed with its network.

The images are built with `scripts/build-images.sh` as `make image-emulator` builds them
(podman's layer cache makes a rebuild with unchanged sources take seconds). Skipped, with
the reason, where podman is missing or cannot run containers; `scripts/podman-setup.sh`
(run by `.ci/run` and `make test`) installs and configures it on Debian as root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
import yaml

from gearshift.controller.enrolment.certificate_authority import init_certs
from integration.helpers import gateway_load, wait_for
from integration.moves import POLICY
from integration.podman import podman_env as _podman_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(os.geteuid() != 0, reason="runs podman as root: it makes the "
                                 "base image with debootstrap and hands files to the containers' "
                                 "user (chown)")]

REPO = Path(__file__).resolve().parents[2]
LOCAL_BASE_IMAGE = "localhost/gearshift-debian:bookworm"
APP_UID = 10001
HOSTS = ("host-a", "host-b")
VENV_PYTHON = "/opt/gearshift/.venv/bin/python"
HARDENING = ("--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
             "--user", f"{APP_UID}:{APP_UID}")
CONTROLLER_ARGS = ("--report-interval", "1", "--history-resolution", "0.5",
                   "--canary-steps", "0.5", "--analysis-intervals", "2")
STOP_GRACE_S = 30
T = TypeVar("T")


def _run(cmd: list[str], env: dict[str, str], timeout: float = 120,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def images() -> Iterator[tuple[dict[str, str], str, str]]:
    """(podman's environment, control-plane image, emulator agent image), built as
    `make image-emulator` builds them."""
    env = _podman_env()
    started = time.monotonic()
    build = _run([str(REPO / "scripts" / "build-images.sh")],
                 {**env, "CONTAINER": "podman", "ENGINE": "emulator",
                  "ENGINE_IMAGE": LOCAL_BASE_IMAGE, "CONTROL_BASE_IMAGE": LOCAL_BASE_IMAGE},
                 timeout=1500)
    names = build.stdout.split()
    assert len(names) == 2, build.stdout
    print(f"images built in {time.monotonic() - started:.0f} s: {names}")
    yield env, names[0], names[1]


@dataclass
class Pod:
    """Containers and a network made by one test, all labelled with its tag."""

    env: dict[str, str]
    workdir: Path
    tag: str = field(default_factory=lambda: f"gs{uuid.uuid4().hex[:8]}")
    containers: list[str] = field(default_factory=list)

    @property
    def network(self) -> str:
        return f"{self.tag}-net"

    def podman(self, *args: str, timeout: float = 120,
               check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(["podman", *args], self.env, timeout, check)

    def start(self, name: str, image: str, *args: str, publish: tuple[int, ...] = (),
              mounts: dict[Path, str] | None = None, env: dict[str, str] | None = None) -> str:
        """Start container `name` (its DNS name on the network) detached; returns its id."""
        cname = f"{self.tag}-{name}"
        cmd = ["run", "--detach", "--name", cname, "--label", f"gearshift.test={self.tag}",
               "--network", self.network, "--network-alias", name, "--hostname", name,
               *HARDENING]
        for port in publish:
            cmd += ["--publish", f"127.0.0.1::{port}"]
        for src, dst in (mounts or {}).items():
            cmd += ["--volume", f"{src}:{dst}"]
        for k, v in (env or {}).items():
            cmd += ["--env", f"{k}={v}"]
        self.podman(*cmd, image, *args)
        self.containers.append(cname)
        return cname

    def port(self, name: str, port: int) -> int:
        out = self.podman("port", f"{self.tag}-{name}", f"{port}/tcp").stdout.strip()
        return int(out.splitlines()[0].rpartition(":")[2])

    def logs(self, name: str) -> str:
        proc = self.podman("logs", f"{self.tag}-{name}", check=False)
        return proc.stdout + proc.stderr

    def state(self, name: str) -> dict:
        out = self.podman("inspect", "--format", "{{json .State}}", f"{self.tag}-{name}").stdout
        return json.loads(out)

    def remove_all(self) -> None:
        for cname in reversed(self.containers):
            self.podman("rm", "--force", "--time", "5", cname, check=False, timeout=60)
        self.podman("network", "rm", "--force", self.network, check=False, timeout=60)


def test_images_are_labelled_non_root_and_start_under_tini(
        images: tuple[dict[str, str], str, str]) -> None:
    env, control_image, agent_image = images
    for image in (control_image, agent_image):
        config = json.loads(_run(["podman", "image", "inspect", "--format", "{{json .Config}}",
                                  image], env).stdout)
        labels = config["Labels"]
        assert labels["org.opencontainers.image.version"] == _project_version(), image
        assert labels["org.opencontainers.image.source"].startswith("https://"), image
        assert labels["org.opencontainers.image.revision"] not in ("", "unknown"), image
        assert config["User"] == f"{APP_UID}:{APP_UID}", image
        assert config["Entrypoint"][:2] == ["tini", "--"], image
        # No build secret (the CA bundle given to pip) is left in the image.
        probe = _run(["podman", "run", "--rm", "--network", "none", "--entrypoint", "/bin/sh",
                      image, "-c", "id -u; test ! -e /run/secrets/ca && echo clean"], env)
        assert probe.stdout.split() == [str(APP_UID), "clean"], probe.stdout
    assert "dev.gearshift.engine" in json.loads(_run(
        ["podman", "image", "inspect", "--format", "{{json .Config.Labels}}", agent_image],
        env).stdout)


def _project_version() -> str:
    for line in (REPO / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise AssertionError("no version in pyproject.toml")


def _owned_dir(path: Path, files: dict[str, Path] | None = None) -> Path:
    """A directory (with copies of `files`) the containers' user owns: their key files
    stay mode 0600, as on a host or in a Kubernetes Secret with fsGroup."""
    path.mkdir(parents=True, exist_ok=True)
    for name, src in (files or {}).items():
        shutil.copyfile(src, path / name)
        os.chmod(path / name, 0o600)
    for p in [path, *path.iterdir()]:
        os.chown(p, APP_UID, APP_UID)
    return path


def _agent_config(host: str) -> str:
    engines = {flavor: {"executable": [VENV_PYTHON, "-m", "gearshift.agents.emulator",
                                       "--flavor", flavor, "--"],
                        "version": "emulated", "env": {"GEARSHIFT_EMULATOR_LOAD_S": "0.3"}}
               for flavor in ("vllm", "tensorrt-llm")}
    deployments = [{"deployment_id": "m-vllm-0", "model": "m", "engine": "vllm",
                    "source": "org/m", "revision": "r1", "gpu_indices": [0]}] \
        if host == "host-a" else []
    cfg = {"host_id": host, "controller": "controller:50051", "report_interval_s": 1.0,
           "workdir": "/var/lib/gearshift/agent",
           # No certificate: the agent enrols with the bootstrap token at the controller's
           # enrolment listener and keeps what it is given in its work dir.
           "tls": {"ca": "/etc/gearshift/tls/ca.pem"},
           "enrol_controller": "controller:50052",
           "bootstrap_token_file": "/etc/gearshift/tls/bootstrap.token",
           "drain_on_exit": True,  # in a container, engines end with it: stop them gently
           "gpus": {"source": "emulated", "emulated": {"count": 4}},
           "engines": engines, "deployments": deployments}
    return yaml.safe_dump(cfg, sort_keys=False)


def _wait(fn: Callable[[], T | None], timeout_s: float, what: str,
          logs: Callable[[], str]) -> T:
    """`wait_for`, with the log of the container waited on in the error."""
    try:
        return wait_for(fn, timeout_s, what)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n--- log ---\n{logs()[-3000:]}") from None


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_fleet_in_containers_moves_a_model_with_zero_failed_requests(
        images: tuple[dict[str, str], str, str], tmp_path: Path) -> None:
    env, control_image, agent_image = images
    pod = Pod(env, tmp_path)
    certs = tmp_path / "certs"
    init_certs(certs, sans=["controller", "127.0.0.1", "localhost"], days=1)
    tls = "/etc/gearshift/tls"
    try:
        pod.podman("network", "create", "--label", f"gearshift.test={pod.tag}", pod.network)
        pod.start("controller", control_image, "controller", "--listen", "0.0.0.0:50051",
                  "--data-dir", "/var/lib/gearshift/data", "--metrics-listen", "0.0.0.0:9400",
                  "--tls-cert", f"{tls}/controller.pem", "--tls-key", f"{tls}/controller-key.pem",
                  "--tls-ca", f"{tls}/ca.pem", "--tokens-file", f"{tls}/tokens.yaml",
                  "--ca-key", f"{tls}/ca-key.pem", "--enrol-listen", "0.0.0.0:50052",
                  *CONTROLLER_ARGS, publish=(50051, 9400),
                  mounts={_owned_dir(tmp_path / "controller-tls", {
                      n: certs / n for n in ("ca.pem", "ca-key.pem", "controller.pem",
                                             "controller-key.pem", "tokens.yaml")}): f"{tls}:ro",
                          _owned_dir(tmp_path / "controller-data"): "/var/lib/gearshift/data"})
        ops = pod.port("controller", 9400)
        _wait(lambda: _http_ok(f"http://127.0.0.1:{ops}/readyz"), 60,
                 "the controller ready", lambda: pod.logs("controller"))
        grpc_port = pod.port("controller", 50051)

        def cli(token: str, *args: str) -> subprocess.CompletedProcess[str]:
            cli_env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
            cli_env.update({"GEARSHIFT_TLS_CA": str(certs / "ca.pem"),
                            "GEARSHIFT_TLS_CERT": str(certs / "cli.pem"),
                            "GEARSHIFT_TLS_KEY": str(certs / "cli-key.pem"),
                            "GEARSHIFT_TOKEN_FILE": str(certs / f"{token}.token")})
            return _run([sys.executable, "-m", "gearshift.cli.main", "--controller",
                         f"127.0.0.1:{grpc_port}", *args], cli_env, 60)

        def cli_json(*args: str) -> object:
            return json.loads(cli("read", *args, "-o", "json").stdout)

        # One reusable, auto-approved bootstrap token for both hosts, as the README has it
        # for the Kubernetes DaemonSet.
        created = cli("admin", "tokens", "create", "--hosts", "host-*", "--auto-approve",
                      "--ttl", "1h")
        (certs / "bootstrap.token").write_text(created.stdout)
        for host in HOSTS:
            conf = _owned_dir(tmp_path / f"{host}-conf", {
                "ca.pem": certs / "ca.pem", "bootstrap.token": certs / "bootstrap.token"})
            (conf / "agent.yaml").write_text(_agent_config(host))
            os.chown(conf / "agent.yaml", APP_UID, APP_UID)
            pod.start(host, agent_image, "agent", "--config", f"{tls}/agent.yaml",
                      "--metrics-listen", "0.0.0.0:9402",
                      # engines listen on, and are reached at, the container's own name
                      env={"GEARSHIFT_BIND_HOST": host},
                      mounts={conf: f"{tls}:ro",
                              _owned_dir(tmp_path / f"{host}-work"): "/var/lib/gearshift/agent"})

        def m_ready() -> list[dict] | None:
            deps = cli_json("fleet", "deployments")
            assert isinstance(deps, list)
            return deps if any(d["report"]["phase"] == "DEPLOYMENT_PHASE_READY"
                               for d in deps) else None

        deps = _wait(m_ready, 90, "m ready on host-a, in its container",
                        lambda: pod.logs("host-a"))
        assert deps[0]["report"]["endpoint"].startswith("http://host-a:")
        hosts = cli_json("fleet", "hosts")
        assert isinstance(hosts, list)
        assert sorted(h["host_id"] for h in hosts) == list(HOSTS)
        # Each joined with a key it made itself, kept in its work dir (mode 0600).
        enrolled = cli_json("hosts", "list")
        assert isinstance(enrolled, list)
        assert sorted((h["host_id"], h["state"]) for h in enrolled) == \
            [(h, "ENROLMENT_STATE_APPROVED") for h in HOSTS], enrolled
        for host in HOSTS:
            identity = tmp_path / f"{host}-work" / "identity" / "agent.pem"
            assert identity.stat().st_mode & 0o777 == 0o600, host
            assert "PRIVATE KEY" not in "".join(
                p.read_text() for p in (tmp_path / f"{host}-conf").iterdir())

        pod.start("gateway", control_image, "gateway", "--controller", "controller:50051",
                  "--listen", "0.0.0.0:8000", "--metrics-listen", "0.0.0.0:9401",
                  publish=(8000, 9401),
                  env={"GEARSHIFT_TLS_CA": f"{tls}/ca.pem",
                       "GEARSHIFT_TLS_CERT": f"{tls}/gateway.pem",
                       "GEARSHIFT_TLS_KEY": f"{tls}/gateway-key.pem",
                       "GEARSHIFT_TOKEN_FILE": f"{tls}/read.token"},
                  mounts={_owned_dir(tmp_path / "gateway-tls", {
                      n: certs / n for n in ("ca.pem", "gateway.pem", "gateway-key.pem",
                                             "read.token")}): f"{tls}:ro"})
        gw_ops = pod.port("gateway", 9401)
        _wait(lambda: _http_ok(f"http://127.0.0.1:{gw_ops}/readyz"), 60,
                 "the gateway ready (a routing table)", lambda: pod.logs("gateway"))
        gateway_url = f"http://127.0.0.1:{pod.port('gateway', 8000)}"

        policy = tmp_path / "move.yaml"
        policy.write_text(POLICY.format(name="move", mode="auto", prefer="tensorrt-llm",
                                         rule="prefer-tensorrt-llm", cooldown="0s"))
        with gateway_load(gateway_url, "m") as load:
            cli("admin", "policy", "apply", str(policy))

            def moved() -> dict | None:
                for mig in cli_json("migrations", "list"):  # type: ignore[union-attr]
                    if mig["to_engine"] == "tensorrt-llm" and \
                            mig["phase"] in ("done", "rolled_back", "aborted"):
                        return mig
                return None

            done = _wait(moved, 180, "the move to tensorrt-llm",
                            lambda: pod.logs("controller"))
            assert done["phase"] == "done", done
            wait_for(lambda: {d["report"]["engine"] for d in cli_json("fleet", "deployments")
                              if d["report"]["model"] == "m"} == {"tensorrt-llm"},  # type: ignore
                     60, "only tensorrt-llm serving m")
        assert load.sent > 50
        assert load.failed == 0, load.errors[:5]

        # A clean stop: SIGTERM through tini, each process drains and exits 0.
        for name in ("gateway", *HOSTS, "controller"):
            pod.podman("stop", "--time", str(STOP_GRACE_S), f"{pod.tag}-{name}",
                       timeout=STOP_GRACE_S + 30)
            state = pod.state(name)
            assert state["ExitCode"] == 0, (name, state, pod.logs(name)[-3000:])
            assert "Traceback" not in pod.logs(name), (name, pod.logs(name)[-3000:])
    finally:
        pod.remove_all()
    left = pod.podman("ps", "--all", "--quiet", "--filter", f"label=gearshift.test={pod.tag}")
    assert left.stdout.strip() == ""
    nets = pod.podman("network", "ls", "--quiet", "--filter", f"name={pod.network}")
    assert nets.stdout.strip() == ""
