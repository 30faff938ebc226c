"""Hosts on their own addresses: the controller and two agents (with their engines) each
in a network namespace of their own, joined by a bridge in a fourth, all made and
removed by this test. The agents start with the CA and a bootstrap token only: they
enrol at the controller's enrolment listener (server TLS) and then connect with
mutual TLS, all on non-loopback addresses. One host is cut off (its
switch port goes down) and back: the controller marks it unreachable, drains nothing
because of it (the engine serves on, no command reaches the host), and the host
rejoins on its own. Only addresses inside these namespaces are used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from gearshift.controller.enrolment.certificate_authority import init_certs
from gearshift.devfleet.local_fleet import Proc, emulator_executable, kill_strays, wait_for

SUBNET = "10.213.0"
CONTROLLER_ADDR = f"{SUBNET}.1"
HOSTS = {"host-a": f"{SUBNET}.2", "host-b": f"{SUBNET}.3"}
GRPC_PORT = 50051  # fixed: each namespace has its own ports
ENROL_PORT = 50052
OPS_PORT = 9400
REPORT_INTERVAL_S = 0.5


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Namespaces:
    """A bridge namespace and one namespace per node, each node on the bridge."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.switch = f"gs{tag}sw"
        self.nodes: dict[str, str] = {}  # node name -> namespace
        self.ports: dict[str, str] = {}  # node name -> its port on the bridge
        self._made: list[str] = []
        self._tag = tag

    def make(self, nodes: dict[str, str]) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (node, addr) in enumerate(nodes.items()):
            ns = f"gs{self._tag}n{i}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            inside, port = f"eth{i}", f"p{self._tag}{i}"
            _ip("link", "add", inside, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.nodes[node], self.ports[node] = ns, port

    def link(self, node: str, up: bool) -> None:
        _ip("-n", self.switch, "link", "set", self.ports[node], "up" if up else "down")

    def remove(self) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"gsprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="module")
def netns_ok() -> None:
    why = _netns_unavailable()
    if why is not None:
        pytest.skip(why)


class NsFleet:
    """gearshift processes started inside the namespaces."""

    def __init__(self, workdir: Path, spaces: Namespaces, certs: Path) -> None:
        self.workdir, self.spaces, self.certs = workdir, spaces, certs
        self.procs: dict[str, Proc] = {}

    def spawn(self, node: str, *args: str) -> Proc:
        log_path = self.workdir / f"{node}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                ["ip", "netns", "exec", self.spaces.nodes[node], sys.executable, "-m",
                 "gearshift.cli.main", *args], stdout=log, stderr=subprocess.STDOUT,
                env={**env, "PYTHONUNBUFFERED": "1"}, start_new_session=True, cwd=self.workdir)
        proc = Proc(node, popen, log_path)
        self.procs[node] = proc
        return proc

    def cli(self, *args: str, role: str = "read") -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
        env.update({"GEARSHIFT_TLS_CA": str(self.certs / "ca.pem"),
                    "GEARSHIFT_TLS_CERT": str(self.certs / "cli.pem"),
                    "GEARSHIFT_TLS_KEY": str(self.certs / "cli-key.pem"),
                    "GEARSHIFT_TOKEN_FILE": str(self.certs / f"{role}.token")})
        return subprocess.run(
            ["ip", "netns", "exec", self.spaces.nodes["controller"], sys.executable, "-m",
             "gearshift.cli.main", "--controller", f"{CONTROLLER_ADDR}:{GRPC_PORT}", *args],
            capture_output=True, text=True, timeout=60, env=env)

    def hosts(self) -> dict[str, dict]:
        proc = self.cli("fleet", "hosts", "-o", "json")
        assert proc.returncode == 0, proc.stderr
        return {h["host_id"]: h for h in json.loads(proc.stdout)}

    def deployments(self) -> dict[str, dict]:
        proc = self.cli("fleet", "deployments", "-o", "json")
        assert proc.returncode == 0, proc.stderr
        return {d["report"]["deployment_id"]: d for d in json.loads(proc.stdout)}

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        kill_strays(self.workdir)  # the engines: agents leave them serving


@pytest.fixture
def ns_fleet(netns_ok: None, tmp_path: Path) -> Iterator[NsFleet]:
    spaces = Namespaces()
    certs = tmp_path / "certs"
    init_certs(certs, sans=[CONTROLLER_ADDR], days=1)  # no agent certificates: they enrol
    fleet = NsFleet(tmp_path, spaces, certs)
    try:
        spaces.make({"controller": CONTROLLER_ADDR, **HOSTS})
        yield fleet
    finally:
        fleet.stop()
        spaces.remove()


def _agent_config(fleet: NsFleet, host: str, token: Path) -> Path:
    dep = {"deployment_id": f"m-{host}", "model": "m", "engine": "vllm", "gpu_indices": [0]}
    cfg = {
        "host_id": host, "controller": f"{CONTROLLER_ADDR}:{GRPC_PORT}",
        "report_interval_s": REPORT_INTERVAL_S, "bind_host": HOSTS[host],
        "workdir": str(fleet.workdir / host),
        "command_journal": str(fleet.workdir / f"{host}.journal"),
        "tls": {"ca": str(fleet.certs / "ca.pem")},
        "enrol_controller": f"{CONTROLLER_ADDR}:{ENROL_PORT}",
        "bootstrap_token_file": str(token),
        "gpus": {"source": "emulated", "emulated": {"count": 1}},
        "engines": {"vllm": {"executable": emulator_executable("vllm"),
                             "env": {"GEARSHIFT_EMULATOR_LOAD_S": "0.3"}}},
        "deployments": [dep],
    }
    path = fleet.workdir / f"{host}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _engine_pid(fleet: NsFleet, host: str) -> int:
    root = str((fleet.workdir / host / f"m-{host}").resolve())
    pids = [p.pid for p in psutil.process_iter(["cwd"]) if (p.info["cwd"] or "") == root]
    assert len(pids) == 1, pids
    return pids[0]


def _engine_answers(fleet: NsFleet, host: str, endpoint: str) -> bool:
    """A completion from inside the host's own namespace (it is cut off from the rest)."""
    code = ("import json,urllib.request as u;"
            f"r=u.Request('{endpoint}/v1/completions',data=json.dumps({{'model':'m',"
            "'prompt':'hi','max_tokens':2}).encode(),headers={'Content-Type':'application/json'});"
            "print(u.urlopen(r,timeout=10).status)")
    proc = subprocess.run(["ip", "netns", "exec", fleet.spaces.nodes[host], sys.executable, "-c",
                           code], capture_output=True, text=True, timeout=30)
    return proc.stdout.strip() == "200"


def test_host_cut_off_is_unreachable_drains_nothing_and_rejoins(ns_fleet: NsFleet) -> None:
    fleet = ns_fleet
    certs = fleet.certs
    ready = fleet.workdir / "controller.ready"
    fleet.spawn("controller", "controller", "--listen", f"{CONTROLLER_ADDR}:{GRPC_PORT}",
                "--data-dir", str(fleet.workdir / "data"),
                "--report-interval", str(REPORT_INTERVAL_S),
                "--tls-cert", str(certs / "controller.pem"),
                "--tls-key", str(certs / "controller-key.pem"), "--tls-ca", str(certs / "ca.pem"),
                "--tokens-file", str(certs / "tokens.yaml"),
                "--ca-key", str(certs / "ca-key.pem"),
                "--enrol-listen", f"{CONTROLLER_ADDR}:{ENROL_PORT}",
                "--metrics-listen", f"{CONTROLLER_ADDR}:{OPS_PORT}", "--ready-file", str(ready))
    wait_for(lambda: ready.exists() and ready.read_text().strip(), 60, "the controller")
    created = fleet.cli("tokens", "create", "--hosts", "host-*", "--auto-approve", role="admin")
    assert created.returncode == 0, created.stderr
    token = fleet.workdir / "bootstrap.token"
    token.write_text(created.stdout)
    token.chmod(0o600)
    for host in HOSTS:
        fleet.spawn(host, "agent", "--config", str(_agent_config(fleet, host, token)))

    def all_ready() -> dict[str, dict] | None:
        deps = fleet.deployments()
        ok = len(deps) == 2 and all(d["report"]["phase"] == "DEPLOYMENT_PHASE_READY"
                                    for d in deps.values())
        return deps if ok else None

    deps = wait_for(all_ready, 90, "both hosts enrolled, their engines ready over mutual TLS")
    enrolled = json.loads(fleet.cli("hosts", "list", "-o", "json").stdout)
    assert {h["host_id"]: h["state"] for h in enrolled} == {
        h: "ENROLMENT_STATE_APPROVED" for h in HOSTS}
    endpoint_b = deps["m-host-b"]["report"]["endpoint"]
    assert endpoint_b.startswith(f"http://{HOSTS['host-b']}:")  # its own address
    assert deps["m-host-a"]["report"]["endpoint"].startswith(f"http://{HOSTS['host-a']}:")
    engine_b = _engine_pid(fleet, "host-b")

    fleet.spaces.link("host-b", up=False)
    cut_at = time.monotonic()
    hosts = wait_for(lambda: (h := fleet.hosts())["host-b"]["state"] ==
                     "HOST_STATE_UNREACHABLE" and h, 30, "host-b marked unreachable")
    assert hosts["host-a"]["state"] == "HOST_STATE_CONNECTED"
    # Cut off for a while (several times the unreachable threshold): nothing happens to it.
    time.sleep(max(0.0, 6.0 - (time.monotonic() - cut_at)))
    assert _engine_answers(fleet, "host-b", endpoint_b)
    during = fleet.deployments()
    assert set(during) == {"m-host-a", "m-host-b"}
    assert during["m-host-b"]["report"]["endpoint"] == endpoint_b

    fleet.spaces.link("host-b", up=True)
    wait_for(lambda: fleet.hosts()["host-b"]["state"] == "HOST_STATE_CONNECTED", 60,
             "host-b rejoined")
    after = wait_for(all_ready, 30, "both deployments ready again")
    assert after["m-host-b"]["report"]["endpoint"] == endpoint_b
    assert after["m-host-b"]["report"]["restarts"] == 0
    assert _engine_pid(fleet, "host-b") == engine_b  # the same engine served throughout
    journal = fleet.workdir / "host-b.journal"
    commands = journal.read_text().splitlines() if journal.exists() else []
    assert commands == [], commands  # no drain, no stop, nothing sent because of the cut
    log_b = fleet.procs["host-b"].log()
    assert "PLAINTEXT" not in log_b and log_b.count("connected to controller") >= 2
    assert log_b.count("enrolled as host-b") == 1  # rejoined with its certificate
