"""TLS, mutual TLS and bearer tokens end to end: a real grpc.aio server on 127.0.0.1.

Certificates come from `init_certs` in a temp dir. The servicer implements a few
ControlService methods and AgentService.Connect (which checks that the client
certificate names the host of the Hello) and records every call that reached it,
so "no side effect" is asserted as "the handler never ran".
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

pytest.importorskip("cryptography")

from gearshift.common.credentials import TlsFiles, secure_channel, token_metadata
from gearshift.common.errors import PermissionDenied
from gearshift.controller.api.interceptors import ErrorInterceptor, grpc_status
from gearshift.controller.api.security import (
    AuthInterceptor,
    TokenStore,
    check_peer_host,
    peer_host_id,
    server_credentials,
)
from gearshift.controller.enrolment.certificate_authority import init_certs, issue_agent_cert
from gearshift.v1 import agent_pb2, agent_pb2_grpc, control_pb2, control_pb2_grpc

CALL_TIMEOUT_S = 10.0


class Recorder(control_pb2_grpc.ControlServiceServicer, agent_pb2_grpc.AgentServiceServicer):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.peer_hosts: list[str | None] = []

    async def ListHosts(self, request: Any, context: Any) -> Any:
        self.calls.append("ListHosts")
        self.peer_hosts.append(peer_host_id(context))
        return control_pb2.ListHostsResponse(hosts=[control_pb2.Host(host_id="h")])

    async def ApplyPolicy(self, request: Any, context: Any) -> Any:
        self.calls.append("ApplyPolicy")
        return control_pb2.ApplyPolicyResponse(changed=True)

    async def WatchRoutes(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.calls.append("WatchRoutes")
        yield control_pb2.RoutingTable(version=7)

    async def Connect(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        async for msg in request_iterator:
            if msg.HasField("hello"):
                try:
                    check_peer_host(context, msg.hello.host_id)
                except PermissionDenied as exc:
                    await context.abort(grpc_status(exc), exc.message)
                self.calls.append(f"Hello {msg.hello.host_id}")
                yield agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(controller_id="c"))
                return


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("certs")
    return init_certs(d, ["host-a", "host-b"], ["127.0.0.1", "localhost"], 30)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return init_certs(tmp_path_factory.mktemp("other"), ["host-a"], ["127.0.0.1"], 30)


@pytest.fixture(scope="module")
def tokens(certs: dict[str, Path]) -> dict[str, str]:
    return {role: certs[f"{role}-token"].read_text().strip() for role in ("admin", "read")}


async def start_server(certs: dict[str, Path], recorder: Recorder,
                       require_client_cert: bool = True) -> tuple[aio.Server, str]:
    server = aio.server(interceptors=[AuthInterceptor(TokenStore.from_file(certs["tokens"])),
                                      ErrorInterceptor()])
    control_pb2_grpc.add_ControlServiceServicer_to_server(recorder, server)
    agent_pb2_grpc.add_AgentServiceServicer_to_server(recorder, server)
    creds = server_credentials(certs["controller"], certs["controller-key"], certs["ca"],
                               require_client_cert)
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def served(certs: dict[str, Path]) -> AsyncIterator[tuple[Recorder, str]]:
    recorder = Recorder()
    server, addr = await start_server(certs, recorder)
    try:
        yield recorder, addr
    finally:
        await server.stop(None)


def client_tls(certs: dict[str, Path], name: str) -> TlsFiles:
    return TlsFiles(certs["ca"], certs[name], certs[f"{name}-key"])


async def list_hosts(addr: str, tls: TlsFiles | None, token: str | None) -> Any:
    async with secure_channel(addr, tls, token) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        return await stub.ListHosts(control_pb2.ListHostsRequest(), timeout=CALL_TIMEOUT_S)


async def apply_policy(addr: str, tls: TlsFiles, token: str | None) -> Any:
    async with secure_channel(addr, tls, token) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        return await stub.ApplyPolicy(control_pb2.ApplyPolicyRequest(yaml_text="x"),
                                      timeout=CALL_TIMEOUT_S)


async def test_mtls_with_read_token_lists_and_names_no_host_for_cli(
        served: tuple[Recorder, str], certs: dict[str, Path], tokens: dict[str, str]) -> None:
    recorder, addr = served
    reply = await list_hosts(addr, client_tls(certs, "cli"), tokens["read"])
    assert [h.host_id for h in reply.hosts] == ["h"]
    # The CLI certificate is verified, but it names no host: it cannot pass as an agent.
    assert recorder.peer_hosts == [None]


async def test_admin_token_applies(served: tuple[Recorder, str], certs: dict[str, Path],
                                   tokens: dict[str, str]) -> None:
    recorder, addr = served
    reply = await apply_policy(addr, client_tls(certs, "cli"), tokens["admin"])
    assert reply.changed
    assert recorder.calls == ["ApplyPolicy"]


async def test_read_token_on_admin_call_is_denied_without_side_effect(
        served: tuple[Recorder, str], certs: dict[str, Path], tokens: dict[str, str]) -> None:
    recorder, addr = served
    with pytest.raises(grpc.RpcError) as err:
        await apply_policy(addr, client_tls(certs, "cli"), tokens["read"])
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.details() == "role read cannot call ApplyPolicy (needs admin)"
    assert recorder.calls == []


@pytest.mark.parametrize(("token", "details"), [
    (None, "missing bearer token"),
    ("not-a-token-of-this-controller", "invalid token"),
])
async def test_missing_or_unknown_token_is_unauthenticated(
        served: tuple[Recorder, str], certs: dict[str, Path], token: str | None,
        details: str) -> None:
    recorder, addr = served
    for call in (list_hosts, apply_policy):
        with pytest.raises(grpc.RpcError) as err:
            await call(addr, client_tls(certs, "gateway"), token)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.value.details() == details
    assert recorder.calls == []


async def test_server_stream_needs_a_token_too(served: tuple[Recorder, str],
                                               certs: dict[str, Path],
                                               tokens: dict[str, str]) -> None:
    recorder, addr = served
    async with secure_channel(addr, client_tls(certs, "gateway"), None) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            async for _ in stub.WatchRoutes(control_pb2.WatchRoutesRequest(),
                                            timeout=CALL_TIMEOUT_S):
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert recorder.calls == []
    async with secure_channel(addr, client_tls(certs, "gateway"), tokens["read"]) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        tables = [t async for t in stub.WatchRoutes(control_pb2.WatchRoutesRequest(),
                                                    timeout=CALL_TIMEOUT_S)]
    assert [t.version for t in tables] == [7]


async def hello(addr: str, tls: TlsFiles, host_id: str) -> list[Any]:
    async with secure_channel(addr, tls, None) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        call = stub.Connect(timeout=CALL_TIMEOUT_S)
        await call.write(agent_pb2.AgentMessage(hello=agent_pb2.Hello(host_id=host_id)))
        await call.done_writing()
        return [m async for m in call]


async def test_agent_cert_names_its_host_and_hello_for_another_is_refused(
        served: tuple[Recorder, str], certs: dict[str, Path]) -> None:
    recorder, addr = served
    replies = await hello(addr, client_tls(certs, "agent-host-a"), "host-a")
    assert replies[0].welcome.controller_id == "c"
    with pytest.raises(grpc.RpcError) as err:
        await hello(addr, client_tls(certs, "agent-host-a"), "host-b")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.details() == "certificate names host-a, hello says host-b"
    with pytest.raises(grpc.RpcError) as err:
        await hello(addr, client_tls(certs, "gateway"), "host-a")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert recorder.calls == ["Hello host-a"]


async def test_peer_host_id_reads_the_agent_certificate(
        served: tuple[Recorder, str], certs: dict[str, Path], tokens: dict[str, str]) -> None:
    recorder, addr = served
    await list_hosts(addr, client_tls(certs, "agent-host-b"), tokens["read"])
    assert recorder.peer_hosts == ["host-b"]


async def test_client_cert_from_another_ca_is_refused_at_the_handshake(
        served: tuple[Recorder, str], other_ca: dict[str, Path], certs: dict[str, Path],
        tokens: dict[str, str]) -> None:
    recorder, addr = served
    foreign = TlsFiles(certs["ca"], other_ca["agent-host-a"], other_ca["agent-host-a-key"])
    with pytest.raises(grpc.RpcError) as err:
        await list_hosts(addr, foreign, tokens["admin"])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as err:  # no client certificate at all
        await list_hosts(addr, TlsFiles(certs["ca"]), tokens["admin"])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert recorder.calls == []


async def test_server_from_another_ca_is_refused_by_the_client(
        served: tuple[Recorder, str], other_ca: dict[str, Path], certs: dict[str, Path],
        tokens: dict[str, str]) -> None:
    recorder, addr = served
    wrong_trust = TlsFiles(other_ca["ca"], other_ca["cli"], other_ca["cli-key"])
    with pytest.raises(grpc.RpcError) as err:
        await list_hosts(addr, wrong_trust, tokens["read"])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert recorder.calls == []


async def test_expired_client_cert_is_refused(
        served: tuple[Recorder, str], certs: dict[str, Path], tokens: dict[str, str],
        tmp_path: Path) -> None:
    recorder, addr = served
    # Same CA, certificate valid for one day three days ago.
    ca_dir = certs["ca"].parent
    expired_dir = tmp_path / "expired"
    expired_dir.mkdir()
    for name in ("ca.pem", "ca-key.pem"):
        (expired_dir / name).write_bytes((ca_dir / name).read_bytes())
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=3)
    issued = issue_agent_cert(expired_dir, "host-a", 1, now=past)
    expired = TlsFiles(certs["ca"], issued["agent-host-a"], issued["agent-host-a-key"])
    with pytest.raises(grpc.RpcError) as err:
        await list_hosts(addr, expired, tokens["read"])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert recorder.calls == []
    # The same CA with a current validity window is accepted: only the date was wrong.
    fresh = issue_agent_cert(expired_dir, "host-b", 1)
    await list_hosts(addr, TlsFiles(certs["ca"], fresh["agent-host-b"], fresh["agent-host-b-key"]),
                     tokens["read"])
    assert recorder.peer_hosts == ["host-b"]


async def test_expired_server_cert_is_refused_by_the_client(tmp_path: Path) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=3)
    old = init_certs(tmp_path, ["host-a"], ["127.0.0.1"], 1, now=past)
    recorder = Recorder()
    server, addr = await start_server(old, recorder, require_client_cert=False)
    try:
        with pytest.raises(grpc.RpcError) as err:
            await list_hosts(addr, TlsFiles(old["ca"]), old["admin-token"].read_text().strip())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)
    assert recorder.calls == []


async def test_server_tls_without_client_certs_still_checks_tokens(
        certs: dict[str, Path], tokens: dict[str, str]) -> None:
    recorder = Recorder()
    server, addr = await start_server(certs, recorder, require_client_cert=False)
    try:
        reply = await list_hosts(addr, TlsFiles(certs["ca"]), tokens["read"])
        assert len(reply.hosts) == 1
        # No client certificate was requested, so no host can be claimed from one.
        assert recorder.peer_hosts == [None]
        with pytest.raises(grpc.RpcError) as err:
            await hello(addr, client_tls(certs, "agent-host-a"), "host-a")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await server.stop(None)


def blocking_calls(addr: str, token: str) -> list[grpc.StatusCode]:
    codes = []
    with secure_channel(addr, None, token, aio=False) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        for method, request in ((stub.ListHosts, control_pb2.ListHostsRequest()),
                                (stub.ApplyPolicy, control_pb2.ApplyPolicyRequest())):
            try:
                method(request, timeout=CALL_TIMEOUT_S)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
    return codes


async def test_plaintext_loopback_carries_the_token(
        certs: dict[str, Path], tokens: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder()
    server = aio.server(interceptors=[AuthInterceptor(TokenStore.from_file(certs["tokens"]))])
    control_pb2_grpc.add_ControlServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        reply = await list_hosts(f"127.0.0.1:{port}", None, tokens["admin"])
        assert len(reply.hosts) == 1
        assert "PLAINTEXT gRPC to 127.0.0.1" in caplog.text
        assert tokens["admin"] not in caplog.text
        # The blocking channel (the CLI's) adds the token the same way; it runs in a
        # thread because this event loop also serves the calls.
        codes = await asyncio.to_thread(blocking_calls, f"127.0.0.1:{port}", tokens["read"])
        assert codes == [grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED]
        # Per-call metadata works on a channel without a token.
        async with secure_channel(f"127.0.0.1:{port}", None, None) as channel:
            stub = control_pb2_grpc.ControlServiceStub(channel)
            out = await stub.ApplyPolicy(control_pb2.ApplyPolicyRequest(),
                                         metadata=token_metadata(tokens["admin"]),
                                         timeout=CALL_TIMEOUT_S)
            assert out.changed
    finally:
        await server.stop(None)
    assert recorder.calls == ["ListHosts", "ListHosts", "ApplyPolicy"]
