"""Agents that join by bootstrap token, as real processes on loopback with TLS.

The controller serves mutual TLS on --listen and its enrolment listener
(server TLS only) on --enrol-listen, signing with --ca-key. Agents start with the
CA and a bootstrap token only: they make their key, enrol, connect over mutual
TLS, renew, and are refused once revoked, across a controller restart. Tokens
and hosts are managed with the CLI, as an operator would.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from gearshift.controller.enrolment.certificate_authority import init_certs
from gearshift.devfleet.local_fleet import LocalFleet
from integration.helpers import FAST_ENGINE_ENV, wait_for

DEP = [{"deployment_id": "m-1", "model": "m", "engine": "vllm", "gpu_indices": [0]}]


class Enrolment:
    """The certificates of the controller, the CLI's credentials, the controller's flags."""

    def __init__(self, fleet: LocalFleet, tmp_path: Path) -> None:
        self.fleet, self.certs = fleet, tmp_path / "certs"
        self.tmp = tmp_path
        init_certs(self.certs, hosts=[], sans=["localhost", "127.0.0.1"], days=1)

    def controller_args(self, *extra: str) -> tuple[str, ...]:
        c = self.certs
        return ("--tls-cert", str(c / "controller.pem"), "--tls-key",
                str(c / "controller-key.pem"), "--tls-ca", str(c / "ca.pem"),
                "--tokens-file", str(c / "tokens.yaml"), "--ca-key", str(c / "ca-key.pem"),
                "--enrol-listen", "127.0.0.1:0", *extra)

    def start_controller(self, *extra: str) -> None:
        if self.fleet.enrol_port:  # a restart keeps its ports (agents know them)
            extra = (*extra, "--enrol-listen", f"127.0.0.1:{self.fleet.enrol_port}")
        self.fleet.start_controller(self.controller_args(*extra))

    def cli(self, *args: str, role: str = "admin") -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
        env.update({"GEARSHIFT_TLS_CA": str(self.certs / "ca.pem"),
                    "GEARSHIFT_TLS_CERT": str(self.certs / "cli.pem"),
                    "GEARSHIFT_TLS_KEY": str(self.certs / "cli-key.pem"),
                    "GEARSHIFT_TOKEN_FILE": str(self.certs / f"{role}.token")})
        return subprocess.run([sys.executable, "-m", "gearshift.cli.main", "--controller",
                               f"localhost:{self.fleet.controller_port}", *args],
                              capture_output=True, text=True, timeout=60, env=env)

    def json(self, *args: str) -> list[dict]:
        proc = self.cli(*args, "-o", "json")
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def token(self, *args: str) -> Path:
        """`gearshift tokens create …`: the secret, written to a file of mode 0600."""
        proc = self.cli("tokens", "create", *args)
        assert proc.returncode == 0, proc.stderr
        secret = proc.stdout.strip()
        path = self.tmp / f"token-{secret[:8]}"
        path.write_text(secret + "\n")
        path.chmod(0o600)
        return path

    def start_agent(self, host: str, token: Path | None, deployments: list | None = None) -> None:
        env = {"GEARSHIFT_BOOTSTRAP_TOKEN_FILE": str(token)} if token is not None else {}
        self.fleet.start_agent(
            host, deployments if deployments is not None else DEP, FAST_ENGINE_ENV,
            tls={"ca": str(self.certs / "ca.pem"), "server_name": "localhost"},
            extra_args=("--enrol-controller", f"127.0.0.1:{self.fleet.enrol_port}"), env=env)

    def hosts(self) -> dict[str, dict]:
        proc = self.cli("fleet", "hosts", "-o", "json", role="read")
        return {h["host_id"]: h for h in json.loads(proc.stdout)} if proc.returncode == 0 else {}

    def connected(self, host: str) -> bool:
        return self.hosts().get(host, {}).get("state") == "HOST_STATE_CONNECTED"

    def enrolments(self, pending: bool = False) -> dict[str, dict]:
        rows = self.json("hosts", "list", *(("--pending",) if pending else ()))
        return {h["host_id"]: h for h in rows}


@pytest.fixture
def enrol(fleet: LocalFleet, tmp_path: Path) -> Enrolment:
    return Enrolment(fleet, tmp_path)


def test_auto_approved_join_restart_reuse_bad_requests_and_revoke(enrol: Enrolment) -> None:
    fleet = enrol.fleet
    enrol.start_controller()
    token = enrol.token("--hosts", "gpu-*", "--auto-approve", "--ttl", "1h")
    listed = enrol.json("tokens", "list")
    assert len(listed) == 1 and listed[0]["host_pattern"] == "gpu-*"
    assert token.read_text().strip() not in json.dumps(listed)  # the secret is never listed

    enrol.start_agent("gpu-1", token)
    wait_for(lambda: enrol.connected("gpu-1"), 60, "gpu-1 enrolled and connected")
    identity = fleet.workdir / "gpu-1" / "identity" / "agent.pem"
    assert stat.S_IMODE(identity.stat().st_mode) == 0o600
    assert enrol.enrolments()["gpu-1"]["state"] == "ENROLMENT_STATE_APPROVED"
    key = identity.read_text().split("-----END CERTIFICATE-----")[1]
    assert "PRIVATE KEY" in key and key.strip() not in fleet.procs["controller"].log()

    # A host the token does not allow, a malformed token: refused, nothing stored.
    enrol.start_agent("cpu-1", token, deployments=[])
    bad = enrol.tmp / "bad-token"
    bad.write_text("not-a-token\n")
    enrol.start_agent("gpu-9", bad, deployments=[])
    wait_for(lambda: "allows hosts matching 'gpu-*'; the request names 'cpu-1'"
             in fleet.procs["cpu-1"].log(), 30, "cpu-1 refused by the token's pattern")
    wait_for(lambda: "bootstrap token malformed" in fleet.procs["gpu-9"].log(), 30,
             "a malformed token refused")
    assert set(enrol.enrolments()) == {"gpu-1"}
    assert enrol.json("tokens", "list")[0]["uses"] == 1
    metrics = urllib.request.urlopen(
        f"http://127.0.0.1:{fleet.metrics_port}/metrics", timeout=10).read().decode()
    assert 'gearshift_controller_enrolments_total{outcome="issued"} 1.0' in metrics
    assert 'gearshift_controller_enrolments_total{outcome="refused"}' in metrics

    # Restarted without its token, the agent reuses its still-valid certificate.
    fleet.procs.pop("gpu-1").terminate()
    before = identity.read_bytes()
    enrol.start_agent("gpu-1", None)
    wait_for(lambda: "using the stored certificate" in fleet.procs["gpu-1"].log()
             and enrol.connected("gpu-1"), 60, "gpu-1 back with its stored certificate")
    assert identity.read_bytes() == before

    # Revoked: the stream is closed at once and every new hello refused, also after a
    # controller restart.
    proc = enrol.cli("hosts", "revoke", "gpu-1", "--reason", "stolen disk")
    assert proc.returncode == 0, proc.stderr
    wait_for(lambda: "is revoked" in fleet.procs["gpu-1"].log()
             and not enrol.connected("gpu-1"), 60, "gpu-1's stream closed and refused")
    assert enrol.enrolments()["gpu-1"]["state"] == "ENROLMENT_STATE_REVOKED"
    fleet.procs.pop("controller").terminate()
    refusals = fleet.procs["gpu-1"].log().count("is revoked")
    enrol.start_controller()
    wait_for(lambda: fleet.procs["gpu-1"].log().count("is revoked") > refusals, 60,
             "gpu-1 refused by the restarted controller")
    assert not enrol.connected("gpu-1")
    # Approving a revoked host is refused; a read token cannot revoke.
    again = enrol.cli("hosts", "approve", "gpu-1")
    assert again.returncode != 0 and "is revoked" in again.stderr
    read = enrol.cli("hosts", "revoke", "gpu-2", role="read")
    assert read.returncode == 6 and "needs admin" in read.stderr


def test_pending_until_approved_and_one_time_tokens(enrol: Enrolment) -> None:
    fleet = enrol.fleet
    enrol.start_controller()
    token = enrol.token("--hosts", "gpu-?", "--one-time")
    enrol.start_agent("gpu-2", token)
    pending = wait_for(lambda: enrol.enrolments(pending=True).get("gpu-2"), 60,
                       "gpu-2 listed as pending")
    assert pending["state"] == "ENROLMENT_STATE_PENDING"
    wait_for(lambda: "gearshift hosts approve gpu-2" in fleet.procs["gpu-2"].log(), 30,
             "the agent says what it waits for")
    assert not enrol.connected("gpu-2")

    # The one-time token is bound to gpu-2 now: another host is refused with it.
    enrol.start_agent("gpu-3", token, deployments=[])
    wait_for(lambda: "is one-time and was used by host 'gpu-2'"
             in fleet.procs["gpu-3"].log(), 30, "gpu-3 refused the used one-time token")

    assert enrol.cli("hosts", "approve", "gpu-2").returncode == 0
    wait_for(lambda: enrol.connected("gpu-2"), 60, "gpu-2 connected once approved")
    assert enrol.enrolments(pending=True) == {}
    assert set(enrol.enrolments()) == {"gpu-2"}


def test_renewal_keeps_the_stream(enrol: Enrolment) -> None:
    fleet = enrol.fleet
    enrol.start_controller("--enrolled-cert-ttl", "30")
    token = enrol.token("--hosts", "gpu-*", "--auto-approve", "--one-time")
    enrol.start_agent("gpu-4", token)
    wait_for(lambda: enrol.connected("gpu-4"), 60, "gpu-4 enrolled and connected")
    identity = fleet.workdir / "gpu-4" / "identity" / "agent.pem"
    first = identity.read_bytes()
    log = lambda: fleet.procs["gpu-4"].log()  # noqa: E731
    # Renewals at two thirds of a window of 30 s back-dated by 30 s (every ~10 s), past
    # the first certificate's expiry, on one stream; each leaves >= 20 s of validity,
    # time enough for the controller restart below on a loaded machine.
    wait_for(lambda: log().count("certificate renewed") >= 4, 120, "four renewals")
    assert "expired" not in log()
    assert identity.read_bytes() != first
    reports = enrol.hosts()["gpu-4"]["reports"]
    wait_for(lambda: int(enrol.hosts()["gpu-4"]["reports"]) > int(reports) + 4, 30,
             "reports keep flowing on the same stream")
    assert log().count("connected to controller") == 1, log()[-3000:]
    assert "stream ended" not in log()
    # The next connection presents the renewed certificate (the first one expired long
    # ago): the controller restarts, the agent reconnects.
    fleet.procs.pop("controller").terminate()
    enrol.start_controller("--enrolled-cert-ttl", "30")
    wait_for(lambda: log().count("connected to controller") == 2 and enrol.connected("gpu-4"),
             60, "gpu-4 reconnected with its renewed certificate")
