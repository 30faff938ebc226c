"""A CLI that cannot connect says why and what to set: the real `gearshift` command
(a subprocess, with only the GEARSHIFT_* variables each case sets) against real servers
on 127.0.0.1: a controller with mutual TLS and tokens, a plaintext one, and a free port.

Certificates come from `init_certs`, as in test_tls_tokens.py; the servers run on the
test's event loop, so each CLI runs as an asyncio subprocess (the loop keeps serving).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from grpc import aio

pytest.importorskip("cryptography")

from gearshift.controller.api.interceptors import ErrorInterceptor
from gearshift.controller.api.security import AuthInterceptor, TokenStore, server_credentials
from gearshift.controller.enrolment.certificate_authority import init_certs
from gearshift.v1 import control_pb2, control_pb2_grpc

CLI_TIMEOUT_S = 30.0
EXIT_UNAVAILABLE, EXIT_UNAUTHENTICATED = 5, 6


class Status(control_pb2_grpc.ControlServiceServicer):
    async def FleetStatus(self, request: Any, context: Any) -> Any:
        return control_pb2.FleetStatusResponse(controller_id="tls-controller")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return init_certs(tmp_path_factory.mktemp("certs"), ["host-a"], ["127.0.0.1", "localhost"], 30)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return init_certs(tmp_path_factory.mktemp("other"), ["host-a"], ["127.0.0.1"], 30)


@pytest.fixture
async def tls_addr(certs: dict[str, Path]) -> AsyncIterator[str]:
    """A controller that wants mutual TLS and a bearer token, as `gearshift controller
    --tls-cert … --tls-ca … --tokens-file …` serves."""
    server = aio.server(interceptors=[AuthInterceptor(TokenStore.from_file(certs["tokens"])),
                                      ErrorInterceptor()])
    control_pb2_grpc.add_ControlServiceServicer_to_server(Status(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(
        certs["controller"], certs["controller-key"], certs["ca"], True))
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.fixture
async def plaintext_addr() -> AsyncIterator[str]:
    server = aio.server()
    control_pb2_grpc.add_ControlServiceServicer_to_server(Status(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def full_client(certs: dict[str, Path]) -> dict[str, str]:
    return {"GEARSHIFT_TLS_CA": str(certs["ca"]), "GEARSHIFT_TLS_CERT": str(certs["cli"]),
            "GEARSHIFT_TLS_KEY": str(certs["cli-key"]),
            "GEARSHIFT_TOKEN_FILE": str(certs["read-token"])}


async def fleet_status(addr: str, env: dict[str, str]) -> tuple[int, str]:
    """`gearshift --controller ADDR fleet status` with only `env` of the GEARSHIFT_* variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gearshift.cli.main", "--controller", addr, "fleet", "status",
        env={**clean, **env}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


def hint(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("hint: ")]
    assert lines, f"no hint in:\n{stderr}"
    return lines[0]


async def test_full_credentials_connect(tls_addr: str, certs: dict[str, Path]) -> None:
    code, err = await fleet_status(tls_addr, full_client(certs))
    assert code == 0, err


async def test_plaintext_client_to_tls_controller_names_the_tls_variables(
        tls_addr: str) -> None:
    code, err = await fleet_status(tls_addr, {})
    assert code == EXIT_UNAVAILABLE
    assert "Socket closed" in err  # gRPC's own words stay
    h = hint(err)
    assert "wants TLS" in h
    assert all(v in h for v in ("GEARSHIFT_TLS_CA", "GEARSHIFT_TLS_CERT", "GEARSHIFT_TLS_KEY"))


async def test_plaintext_client_with_token_to_tls_controller_hints_not_crashes(
        tls_addr: str, certs: dict[str, Path]) -> None:
    # A token without TLS goes through an intercepted channel: this crashed with an
    # AttributeError traceback while the CLI waited for the connection.
    code, err = await fleet_status(tls_addr, {"GEARSHIFT_TOKEN_FILE": str(certs["read-token"])})
    assert code == EXIT_UNAVAILABLE, err
    assert "Traceback" not in err
    assert "GEARSHIFT_TLS_CA" in hint(err)


async def test_wrong_ca_names_the_ca_variable(tls_addr: str, certs: dict[str, Path],
                                              other_ca: dict[str, Path]) -> None:
    code, err = await fleet_status(tls_addr, {**full_client(certs),
                                              "GEARSHIFT_TLS_CA": str(other_ca["ca"])})
    assert code == EXIT_UNAVAILABLE
    h = hint(err)
    assert "not signed by the CA in $GEARSHIFT_TLS_CA" in h and str(other_ca["ca"]) in h


async def test_no_client_certificate_names_cert_and_key(tls_addr: str,
                                                        certs: dict[str, Path]) -> None:
    env = full_client(certs)
    del env["GEARSHIFT_TLS_CERT"], env["GEARSHIFT_TLS_KEY"]
    code, err = await fleet_status(tls_addr, env)
    assert code == EXIT_UNAVAILABLE
    h = hint(err)
    assert "client certificate" in h and "$GEARSHIFT_TLS_CERT" in h and "$GEARSHIFT_TLS_KEY" in h


async def test_client_certificate_of_another_ca_is_named_refused(
        tls_addr: str, certs: dict[str, Path], other_ca: dict[str, Path]) -> None:
    env = {**full_client(certs), "GEARSHIFT_TLS_CERT": str(other_ca["cli"]),
           "GEARSHIFT_TLS_KEY": str(other_ca["cli-key"])}
    code, err = await fleet_status(tls_addr, env)
    assert code == EXIT_UNAVAILABLE
    h = hint(err)
    assert "refused the client certificate" in h and str(other_ca["cli"]) in h


async def test_missing_token_names_the_token_variables(tls_addr: str,
                                                       certs: dict[str, Path]) -> None:
    env = full_client(certs)
    del env["GEARSHIFT_TOKEN_FILE"]
    code, err = await fleet_status(tls_addr, env)
    assert code == EXIT_UNAUTHENTICATED
    assert "missing bearer token" in err
    h = hint(err)
    assert "$GEARSHIFT_TOKEN_FILE" in h and "$GEARSHIFT_TOKEN" in h


async def test_invalid_token_says_the_controller_does_not_know_it(
        tls_addr: str, certs: dict[str, Path]) -> None:
    env = full_client(certs)
    del env["GEARSHIFT_TOKEN_FILE"]
    code, err = await fleet_status(tls_addr, {**env, "GEARSHIFT_TOKEN": "not-a-token"})
    assert code == EXIT_UNAUTHENTICATED
    h = hint(err)
    assert "does not know the token" in h and "$GEARSHIFT_TOKEN_FILE" in h


async def test_tls_client_to_plaintext_controller_says_unset_tls(
        plaintext_addr: str, certs: dict[str, Path]) -> None:
    code, err = await fleet_status(plaintext_addr, {"GEARSHIFT_TLS_CA": str(certs["ca"])})
    assert code == EXIT_UNAVAILABLE
    assert "does not speak TLS" in hint(err)


async def test_nothing_listening_names_the_controller_flag() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        code, err = await fleet_status(addr, {})
    assert code == EXIT_UNAVAILABLE
    h = hint(err)
    assert f"nothing listens on {addr}" in h
    assert "--controller" in h and "$GEARSHIFT_CONTROLLER" in h and "controller runs" in h
