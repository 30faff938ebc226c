"""The fleet with TLS everywhere: mutual TLS for agents (the certificate names the
host), bearer tokens with read and admin roles for people and tools."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

from gearshift.controller.enrolment.certificate_authority import init_certs, issue_agent_cert
from gearshift.devfleet.local_fleet import LocalFleet
from integration.helpers import FAST_ENGINE_ENV, wait_for


def _cli(fleet: LocalFleet, certs: Path, token_file: Path | None, *args: str,
         client: tuple[Path, Path] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI trusting `certs`' CA, presenting `client` (cert, key) or certs' cli.pem."""
    cert, key = client or (certs / "cli.pem", certs / "cli-key.pem")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
    env.update({"GEARSHIFT_TLS_CA": str(certs / "ca.pem"), "GEARSHIFT_TLS_CERT": str(cert),
                "GEARSHIFT_TLS_KEY": str(key)})
    if token_file is not None:
        env["GEARSHIFT_TOKEN_FILE"] = str(token_file)
    return subprocess.run([sys.executable, "-m", "gearshift.cli.main", "--controller",
                           f"localhost:{fleet.controller_port}", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def _agent_tls(certs: Path, host: str) -> dict[str, str]:
    return {"ca": str(certs / "ca.pem"), "cert": str(certs / f"agent-{host}.pem"),
            "key": str(certs / f"agent-{host}-key.pem")}


def test_tls_mutual_auth_and_token_roles(fleet: LocalFleet, tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_certs(certs, hosts=["host-a", "host-b"], sans=["localhost", "127.0.0.1"], days=1)
    fleet.start_controller(("--tls-cert", str(certs / "controller.pem"),
                            "--tls-key", str(certs / "controller-key.pem"),
                            "--tls-ca", str(certs / "ca.pem"),
                            "--tokens-file", str(certs / "tokens.yaml")))
    # host-a with its own certificate; "host-c" presents host-b's certificate: refused.
    fleet.start_agent("host-a", [{"deployment_id": "m-a", "model": "m", "engine": "vllm",
                                  "gpu_indices": [0]}], FAST_ENGINE_ENV, tls=_agent_tls(certs, "host-a"))
    fleet.start_agent("host-c", [], FAST_ENGINE_ENV, tls=_agent_tls(certs, "host-b"))
    read, admin = certs / "read.token", certs / "admin.token"

    def hosts() -> list[dict] | None:
        proc = _cli(fleet, certs, read, "fleet", "hosts", "-o", "json")
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    seen = wait_for(lambda: (h := hosts()) and any(x["host_id"] == "host-a" for x in h) and h,
                    60, "host-a connected over mutual TLS")
    assert [h["host_id"] for h in seen] == ["host-a"]  # host-c never got in
    wait_for(lambda: "certificate names host-b, hello says host-c" in fleet.procs["host-c"].log(),
             30, "host-c refused for naming another host")

    no_token = _cli(fleet, certs, None, "fleet", "status")
    assert no_token.returncode == 6 and "missing bearer token" in no_token.stderr
    read_admin = _cli(fleet, certs, read, "pause", "--reason", "x")
    assert read_admin.returncode == 6 and "needs admin" in read_admin.stderr
    status = json.loads(_cli(fleet, certs, read, "fleet", "status", "-o", "json").stdout)
    assert status["paused"] is False  # the refused call changed nothing
    assert _cli(fleet, certs, admin, "pause", "--reason", "maintenance").returncode == 0
    assert json.loads(_cli(fleet, certs, read, "fleet", "status", "-o", "json").stdout)["paused"]
    assert "Traceback" not in no_token.stderr + read_admin.stderr

    # A client certificate from another CA, and an expired one from the right CA, are
    # refused at the TLS handshake, admin token or not: nothing changes.
    other = tmp_path / "other-ca"
    init_certs(other, hosts=["host-a"], sans=["localhost"], days=1)
    stale = tmp_path / "stale"
    stale.mkdir()
    for name in ("ca.pem", "ca-key.pem"):
        (stale / name).write_bytes((certs / name).read_bytes())
    expired = issue_agent_cert(stale, "host-a", 1,
                               now=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))
    for client in ((other / "cli.pem", other / "cli-key.pem"),
                   (expired["agent-host-a"], expired["agent-host-a-key"])):
        refused = _cli(fleet, certs, admin, "resume", client=client)
        assert refused.returncode == 5, refused.stderr  # UNAVAILABLE: no TLS session
        assert "Traceback" not in refused.stderr
    assert json.loads(_cli(fleet, certs, read, "fleet", "status", "-o", "json").stdout)["paused"]
    # No secret in the controller's log.
    log = fleet.procs["controller"].log()
    for token_file in (read, admin):
        assert token_file.read_text().strip() not in log
