"""Enrolment with two controllers on one PostgreSQL database (127.0.0.1:5432, trust
auth; skipped with the reason when it cannot be reached): an agent enrols through
either enrolment listener; a host revoked through the leader is refused by the
other controller, both as a follower (its enrolment listener) and once it leads
(the agent's hello)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest

from gearshift.agents.enrolment import make_csr, new_key
from gearshift.common.credentials import TlsFiles, secure_channel
from gearshift.controller.enrolment.certificate_authority import init_certs
from gearshift.devfleet.ha_fleet import HaFleet
from gearshift.devfleet.ports import free_port
from gearshift.v1 import enrol_pb2, enrol_pb2_grpc
from integration.helpers import FAST_ENGINE_ENV, wait_for

PG_ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres connect_timeout=3"


@pytest.fixture
def pg_url() -> Iterator[str]:
    name = f"enrol_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as err:
        pytest.skip(f"PostgreSQL not reachable at 127.0.0.1:5432 as postgres: {err}")
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def ha(tmp_path: Path, pg_url: str) -> Iterator[HaFleet]:
    fleet = HaFleet(tmp_path / "ha", report_interval_s=0.5, db_url=pg_url, controllers=2,
                    lease_ttl_s=3.0)
    try:
        yield fleet
    finally:
        fleet.stop()


def test_revoked_on_the_leader_refused_by_the_other_controller(ha: HaFleet,
                                                               tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_certs(certs, sans=["localhost", "127.0.0.1"], days=1)
    enrol_ports = {name: free_port() for name in ha.names}
    for name in ha.names:
        ha.start_controller((
            "--tls-cert", str(certs / "controller.pem"),
            "--tls-key", str(certs / "controller-key.pem"), "--tls-ca", str(certs / "ca.pem"),
            "--tokens-file", str(certs / "tokens.yaml"), "--ca-key", str(certs / "ca-key.pem"),
            "--enrol-listen", f"127.0.0.1:{enrol_ports[name]}"), name)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
        env.update({"GEARSHIFT_TLS_CA": str(certs / "ca.pem"),
                    "GEARSHIFT_TLS_CERT": str(certs / "cli.pem"),
                    "GEARSHIFT_TLS_KEY": str(certs / "cli-key.pem"),
                    "GEARSHIFT_TOKEN_FILE": str(certs / "admin.token")})
        return subprocess.run([sys.executable, "-m", "gearshift.cli.main", "--controller",
                               ha.controller_addr, *args], capture_output=True, text=True,
                              timeout=60, env=env)

    created = cli("tokens", "create", "--hosts", "gpu-*", "--auto-approve")
    assert created.returncode == 0, created.stderr
    token = tmp_path / "bootstrap.token"
    token.write_text(created.stdout)
    enrol_addrs = ",".join(f"127.0.0.1:{p}" for p in enrol_ports.values())
    for host in ("gpu-1", "gpu-2"):
        ha.start_agent(host, [{"deployment_id": f"m-{host}", "model": "m", "engine": "vllm",
                               "gpu_indices": [0]}], FAST_ENGINE_ENV,
                       tls={"ca": str(certs / "ca.pem"), "server_name": "localhost"},
                       extra_args=("--enrol-controller", enrol_addrs),
                       env={"GEARSHIFT_BOOTSTRAP_TOKEN_FILE": str(token)})
    log = {h: (lambda h=h: ha.procs[h].log()) for h in ("gpu-1", "gpu-2")}
    for host in log:
        wait_for(lambda h=host: "connected to controller" in log[h](), 90,
                 f"{host} enrolled and connected")
    leader = "c1" if "connected to controller c1" in log["gpu-1"]() else "c2"
    other = "c2" if leader == "c1" else "c1"

    revoked = cli("hosts", "revoke", "gpu-1")
    assert revoked.returncode == 0, revoked.stderr
    wait_for(lambda: "is revoked" in log["gpu-1"](), 30, "gpu-1's stream closed at once")
    # The other controller, a follower, refuses the host at its enrolment listener.
    channel = secure_channel(f"127.0.0.1:{enrol_ports[other]}",
                             TlsFiles(certs / "ca.pem", server_name="localhost"), aio=False)
    with channel, pytest.raises(grpc.RpcError) as refused:
        enrol_pb2_grpc.EnrolServiceStub(channel).Enrol(enrol_pb2.EnrolRequest(
            bootstrap_token=token.read_text().strip(), csr_pem=make_csr("gpu-1", new_key())),
            timeout=30)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    assert "host 'gpu-1' is revoked" in refused.value.details()  # type: ignore[attr-defined]

    # The leader goes; the other controller leads and refuses gpu-1's hello, while
    # gpu-2 carries on with it.
    ha.procs.pop(leader).terminate()
    refused_by_other = f"controller {ha.addr(other)}: stream ended: host 'gpu-1' is revoked"
    wait_for(lambda: refused_by_other in log["gpu-1"](), 90,
             f"gpu-1 refused by {other} once it leads")
    wait_for(lambda: f"connected to controller {other}" in log["gpu-2"](), 60,
             f"gpu-2 connected to {other}")
    assert f"connected to controller {other}" not in log["gpu-1"]()
