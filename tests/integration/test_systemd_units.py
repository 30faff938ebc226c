"""The shipped systemd units (deploy/systemd): `systemd-analyze verify` accepts them,
`systemd-analyze security` rates them OK, and their command lines start a working
fleet with the documented files in place (run here without systemd: the test does
what systemd would, handing the credentials over in a directory and expanding the
unit's specifiers; ports become free ones). scripts/install-host.sh, the one-command
install, run into a temporary root: its venv's gearshift runs and the units it installs
pass the same verify (about 55 s: pip installs gearshift and its dependencies, twice)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from gearshift.devfleet.local_fleet import (
    LocalFleet,
    Proc,
    emulator_executable,
    free_port,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "deploy" / "systemd"
INSTALL_HOST = REPO / "scripts" / "install-host.sh"
NAMES = ("controller", "gateway", "agent")
SHIPPED_BIN = "/opt/gearshift/.venv/bin/gearshift"
# Highest exposure `systemd-analyze security` may rate each unit at ("OK" is < 4.1
# on its scale); the agent needs GPU device access and JIT-able memory for engines.
MAX_EXPOSURE = {"controller": 4.0, "gateway": 4.0, "agent": 4.0}
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None,
                                   reason="systemd-analyze is not installed on this machine")


def _unit(name: str) -> Path:
    return UNITS / f"gearshift-{name}.service"


def _local_copies(tmp_path: Path) -> list[Path]:
    """The units with the shipped executable path pointing at this checkout's."""
    here = str(Path(sys.executable).parent / "gearshift")
    out = []
    for name in NAMES:
        copy = tmp_path / _unit(name).name
        copy.write_text(_unit(name).read_text().replace(SHIPPED_BIN, here))
        out.append(copy)
    return out


def _verify(units: list[Path]) -> None:
    proc = subprocess.run([ANALYZE, "verify", *map(str, units)],  # type: ignore[list-item]
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gearshift" not in proc.stderr, proc.stderr  # no warning about our units


@needs_analyze
def test_units_verify(tmp_path: Path) -> None:
    _verify(_local_copies(tmp_path))


@needs_analyze
@pytest.mark.parametrize("name", NAMES)
def test_units_are_hardened(name: str) -> None:
    proc = subprocess.run([ANALYZE, "security", "--offline=yes", str(_unit(name))],  # type: ignore[list-item]
                          capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert found is not None, proc.stdout + proc.stderr
    score = float(found.group(1))
    print(f"gearshift-{name}.service exposure {score}")
    assert score <= MAX_EXPOSURE[name], proc.stdout


# --- the command lines, run as systemd would run them ----------------------------------

def _settings(unit: Path) -> dict[str, list[str]]:
    """Key -> values of the [Service] section (continuation lines joined)."""
    text = unit.read_text().replace("\\\n", " ")
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(" ".join(value.split()))
    return out


class Host:
    """What systemd prepares for one unit: credentials, state, cache, runtime dirs."""

    def __init__(self, root: Path, name: str, certs: Path, files: dict[str, Path]) -> None:
        self.name = name
        self.settings = _settings(_unit(name))
        self.creds = root / "credentials" / name
        self.files = files
        self.state, self.cache, self.runtime = root / "state", root / "cache", root / "run"
        for d in (self.creds, self.state, self.cache, self.runtime):
            d.mkdir(parents=True, exist_ok=True)
        for key in ("StateDirectory", "CacheDirectory", "RuntimeDirectory"):
            base = {"StateDirectory": self.state, "CacheDirectory": self.cache,
                    "RuntimeDirectory": self.runtime}[key]
            for d in self.settings.get(key, []):
                (base / d).mkdir(parents=True, exist_ok=True)

    def expand(self, text: str, ports: dict[str, str]) -> str:
        for spec, path in (("%d", self.creds), ("%S", self.state), ("%C", self.cache),
                           ("%t", self.runtime)):
            text = text.replace(spec, str(path))
        for shipped, port in ports.items():
            text = text.replace(shipped, port)
        return text

    def load_credentials(self) -> None:
        """LoadCredential= copies; a SetCredential= of the same name is the default of
        one whose file is missing (systemd.exec(5)); any other missing file is fatal."""
        defaults = dict(spec.partition(":")[::2] for spec in self.settings.get("SetCredential", []))
        for spec in self.settings.get("LoadCredential", []):
            cred, _, source = spec.partition(":")
            path = self.files.get(source)
            if path is not None and path.exists():
                shutil.copy(path, self.creds / cred)
            elif cred in defaults:
                (self.creds / cred).write_text(defaults[cred])
            else:
                raise AssertionError(f"{self.name}: credential file {source} is missing")

    def start(self, fleet: LocalFleet, ports: dict[str, str], env: dict[str, str]) -> Proc:
        self.load_credentials()
        argv = self.expand(self.settings["ExecStart"][0], ports).split()
        argv[0:1] = [sys.executable, "-m", "gearshift.cli.main"]
        unit_env = dict(env)
        for assignment in self.settings.get("Environment", []):
            key, _, value = assignment.partition("=")
            unit_env[key] = self.expand(value, ports)
        log_path = fleet.workdir / f"{self.name}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                     env={**env_base(), **unit_env}, start_new_session=True,
                                     cwd=self.expand(self.settings["WorkingDirectory"][0], ports))
        proc = Proc(self.name, popen, log_path)
        fleet.procs[self.name] = proc
        return proc


def env_base() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _ready(url: str, proc: Proc) -> str | None:
    if not proc.alive():
        raise AssertionError(f"{proc.name} exited:\n{proc.log()[-3000:]}")
    status, body = _get(url)
    return body if status == 200 else None


class Shipped:
    """Certificates, the files the units name, free ports; the controller started."""

    def __init__(self, fleet: LocalFleet, tmp_path: Path) -> None:
        certs = tmp_path / "certs"
        subprocess.run([sys.executable, "-m", "gearshift.cli.main", "certs", "init", "--out",
                        str(certs)], check=True, capture_output=True, timeout=60)
        self.agent_yaml = tmp_path / "agent.yaml"
        files = {f"/etc/gearshift/tls/{n}": certs / n for n in (
            "ca.pem", "ca-key.pem", "controller.pem", "controller-key.pem", "gateway.pem",
            "gateway-key.pem")}
        self.bootstrap_token = tmp_path / "bootstrap.token"  # made once the controller runs
        files |= {"/etc/gearshift/tokens.yaml": certs / "tokens.yaml",
                  "/etc/gearshift/gateway.token": certs / "read.token",
                  "/etc/gearshift/bootstrap.token": self.bootstrap_token}
        self.certs = certs
        self.grpc_port, self.enrol_port = str(free_port()), str(free_port())
        self.ports = {":50051": f":{self.grpc_port}", ":50052": f":{self.enrol_port}",
                      ":9400": f":{free_port()}",
                      ":8000": f":{free_port()}", ":9401": f":{free_port()}",
                      ":9402": f":{free_port()}", "/etc/gearshift/agent.yaml": str(self.agent_yaml),
                      "controller.internal": "127.0.0.1"}
        fleet.workdir.mkdir(parents=True, exist_ok=True)
        # Under the fleet's work dir: what the agent leaves running is cleaned up with it.
        self.hosts = {n: Host(fleet.workdir / n, n, certs, files) for n in NAMES}
        self.fleet = fleet
        self.controller = self.hosts["controller"].start(fleet, self.ports, {})
        body = wait_for(lambda: _ready(self.url("9400", "/readyz"), self.controller), 60,
                        "the controller's /readyz")
        assert body.startswith("ready: leader"), body

    def url(self, shipped_port: str, path: str) -> str:
        return f"http://127.0.0.1{self.ports[':' + shipped_port]}{path}"

    def start(self, name: str) -> Proc:
        return self.hosts[name].start(self.fleet, self.ports, {})

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The CLI on the admin machine, as the README has it: TLS files and a token
        from the environment."""
        env = {**env_base(), "GEARSHIFT_TLS_CA": str(self.certs / "ca.pem"),
               "GEARSHIFT_TLS_CERT": str(self.certs / "cli.pem"),
               "GEARSHIFT_TLS_KEY": str(self.certs / "cli-key.pem"),
               "GEARSHIFT_TOKEN_FILE": str(self.certs / "admin.token")}
        return subprocess.run([sys.executable, "-m", "gearshift.cli.main", "--controller",
                               f"127.0.0.1:{self.grpc_port}", *args], capture_output=True,
                              text=True, timeout=60, env=env)


def test_controller_and_agent_units_start_as_shipped(fleet: LocalFleet, tmp_path: Path) -> None:
    shipped = Shipped(fleet, tmp_path)
    created = shipped.cli("tokens", "create", "--hosts", "gpu-node-*", "--auto-approve")
    assert created.returncode == 0, created.stderr
    shipped.bootstrap_token.write_text(created.stdout)
    shipped.agent_yaml.write_text(yaml.safe_dump({
        "host_id": "gpu-node-01", "controller": f"127.0.0.1:{shipped.grpc_port}",
        "enrol_controller": f"127.0.0.1:{shipped.enrol_port}",
        "report_interval_s": 0.5, "gpus": {"source": "emulated", "emulated": {"count": 1}},
        "engines": {"vllm": {"executable": emulator_executable("vllm"),
                             "env": {"GEARSHIFT_EMULATOR_LOAD_S": "0.3"}}},
        "deployments": [{"deployment_id": "m-vllm", "model": "m", "engine": "vllm",
                         "gpu_indices": [0]}]}))
    agent = shipped.start("agent")
    wait_for(lambda: (b := _ready(shipped.url("9402", "/readyz"), agent))
             and b.startswith("ready: connected"), 60,
             "the agent enrolled by bootstrap token and connected over mutual TLS")
    assert "gearshift_agent_engine_phase" in _get(shipped.url("9402", "/metrics"))[1]
    assert "PLAINTEXT" not in shipped.controller.log() + agent.log()
    identity = shipped.hosts["agent"].state / "gearshift" / "agent" / "identity" / "agent.pem"
    assert identity.stat().st_mode & 0o777 == 0o600

    # Joined: the token file may go; the unit starts again on its stored certificate.
    agent.terminate()
    shipped.bootstrap_token.unlink()
    agent = shipped.start("agent")
    wait_for(lambda: (b := _ready(shipped.url("9402", "/readyz"), agent))
             and b.startswith("ready: connected"), 60, "the agent back without its token")
    assert "using the stored certificate" in agent.log()


def _gateway_has_metrics_listen() -> bool:
    helped = subprocess.run([sys.executable, "-m", "gearshift.cli.main", "gateway", "--help"],
                            capture_output=True, text=True, timeout=60)
    return "--metrics-listen" in helped.stdout


def test_gateway_unit_starts_as_shipped(fleet: LocalFleet, tmp_path: Path) -> None:
    if not _gateway_has_metrics_listen():
        pytest.skip("this tree's gateway has no --metrics-listen yet (the unit passes it)")
    shipped = Shipped(fleet, tmp_path)
    gateway = shipped.start("gateway")
    wait_for(lambda: _ready(shipped.url("9401", "/readyz"), gateway), 60,
             "the gateway's /readyz (routes from the controller over mutual TLS)")
    assert "refused" not in gateway.log() and "Traceback" not in gateway.log()
    assert "PLAINTEXT" not in gateway.log()


# --- scripts/install-host.sh ------------------------------------------------------------

def _install_host(*args: str) -> str:
    proc = subprocess.run([str(INSTALL_HOST), *args], capture_output=True, text=True,
                          timeout=600, env=env_base())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_install_host_help() -> None:
    out = _install_host("--help")
    assert "controller, agent or gateway" in out and "--root DIR" in out


@needs_analyze
def test_install_host_installs_a_venv_and_units_that_verify(tmp_path: Path) -> None:
    root, prefix = tmp_path / "root", tmp_path / "opt" / "gearshift"
    sysusers = () if os.geteuid() == 0 else ("--no-sysusers",)  # it writes root/etc/passwd
    out = _install_host("--root", str(root), "--prefix", str(prefix), *sysusers, *NAMES)

    gearshift = prefix / ".venv" / "bin" / "gearshift"
    helped = subprocess.run([str(gearshift), "--help"], capture_output=True, text=True,
                            timeout=60, env=env_base())
    assert helped.returncode == 0 and "SGLang" in helped.stdout, helped.stdout + helped.stderr
    units = [root / "etc" / "systemd" / "system" / _unit(n).name for n in NAMES]
    for name, unit in zip(NAMES, units, strict=True):  # the shipped unit, on this venv
        assert unit.read_text() == _unit(name).read_text().replace(SHIPPED_BIN, str(gearshift))
    _verify(units)

    etc = root / "etc" / "gearshift"
    assert (etc.stat().st_mode & 0o777, (etc / "tls").stat().st_mode & 0o777) == (0o755, 0o700)
    assert ((root / "etc" / "sysusers.d" / "gearshift.conf").read_text()
            == (UNITS / "gearshift.sysusers.conf").read_text())
    if not sysusers:
        assert "gearshift:" in (root / "etc" / "passwd").read_text()
    for needed in ("/etc/gearshift/tls/ca-key.pem", "/etc/gearshift/tokens.yaml",
                   "/etc/gearshift/bootstrap.token", "/etc/gearshift/agent.yaml",
                   "/etc/gearshift/gateway.token", "systemctl enable --now gearshift-agent"):
        assert needed in out, out

    # Again (an upgrade), with the agent's files in place: they are kept and ticked off.
    for name in ("tls/ca.pem", "bootstrap.token", "agent.yaml"):
        (etc / name).write_text("kept\n")
    out = _install_host("--root", str(root), "--prefix", str(prefix), *sysusers, "agent")
    assert "[x] /etc/gearshift/agent.yaml" in out and "still needed;" not in out, out
    assert (etc / "agent.yaml").read_text() == "kept\n"
    shutil.rmtree(prefix)  # the venv's 400 MB (kept for a look when the test fails)
