"""Every RPC of every service, called with every identity over real mutual TLS.

Generated from the service descriptors: a new RPC without a rule in `METHOD_RULES`
fails here. Each method is served by a stand-in that answers an empty message, behind
the controller's `AuthInterceptor`, on a server with the certificates `gearshift certs
init` writes; each identity calls each method and the outcome must be what the rule
says (docs/security.md). Then the findings it guards against, named: an enrolled
agent's certificate, even with an admin token, can create bootstrap tokens, approve
hosts, apply policies or pause nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, empty_pb2
from google.protobuf.message_factory import GetMessageClass
from grpc import aio
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from gearshift.common.credentials import TlsFiles, secure_channel
from gearshift.controller.api.security import (
    METHOD_RULES,
    AuthInterceptor,
    Role,
    TokenStore,
    server_credentials,
)
from gearshift.controller.enrolment.certificate_authority import SigningCa, init_certs
from gearshift.v1 import agent_pb2, control_pb2, enrol_pb2

SERVICES = [agent_pb2.DESCRIPTOR.services_by_name["AgentService"],
            control_pb2.DESCRIPTOR.services_by_name["ControlService"],
            enrol_pb2.DESCRIPTOR.services_by_name["EnrolService"],
            health_pb2.DESCRIPTOR.services_by_name["Health"],
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
_ = empty_pb2, descriptor_pool  # the pools the descriptors above live in
METHODS = [(f"/{s.full_name}/{m.name}", m) for s in SERVICES for m in s.methods]
DENIED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


def test_every_rpc_of_every_service_has_a_rule() -> None:
    missing = [name for name, _m in METHODS if name not in METHOD_RULES]
    assert not missing, f"RPCs without an authorization rule: {missing}"


def _stand_in(method: Any) -> grpc.RpcMethodHandler:
    out = GetMessageClass(method.output_type)
    inp = GetMessageClass(method.input_type)
    ser = {"request_deserializer": inp.FromString, "response_serializer": out.SerializeToString}

    async def unary(request: Any, context: Any) -> Any:
        return out()

    async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
        yield out()

    if method.client_streaming and method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, **ser)
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **ser)
    if method.client_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **ser)
    return grpc.unary_unary_rpc_method_handler(unary, **ser)


class _Handlers(grpc.GenericRpcHandler):
    def __init__(self) -> None:
        self.by_name = {name: _stand_in(m) for name, m in METHODS}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        return self.by_name.get(handler_call_details.method)


async def _call(channel: aio.Channel, name: str, method: Any, token: str | None
                ) -> grpc.StatusCode:
    inp = GetMessageClass(method.input_type)
    out = GetMessageClass(method.output_type)
    kw = {"request_serializer": inp.SerializeToString, "response_deserializer": out.FromString}
    meta = (("authorization", f"Bearer {token}"),) if token else None
    try:
        if method.client_streaming and method.server_streaming:
            call = channel.stream_stream(name, **kw)(iter([inp()]), metadata=meta, timeout=10)
            async for _ in call:
                pass
        elif method.server_streaming:
            call = channel.unary_stream(name, **kw)(inp(), metadata=meta, timeout=10)
            async for _ in call:
                pass
        elif method.client_streaming:
            await channel.stream_unary(name, **kw)(iter([inp()]), metadata=meta, timeout=10)
        else:
            await channel.unary_unary(name, **kw)(inp(), metadata=meta, timeout=10)
    except aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("certs")
    made = init_certs(out, hosts=["host-a"])
    # An enrolled agent's certificate, signed at enrolment as the controller signs it.
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import (
        Encoding,
        NoEncryption,
        PrivateFormat,
    )
    key = ec.generate_private_key(ec.SECP256R1())
    ca = SigningCa.load(made["ca"], made["ca-key"])
    (out / "enrolled.pem").write_bytes(SigningCa.pem(ca.sign_host("gpu-9", key.public_key(), 3600)))
    (out / "enrolled-key.pem").write_bytes(key.private_bytes(
        Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    made["enrolled"], made["enrolled-key"] = out / "enrolled.pem", out / "enrolled-key.pem"
    return made


# identity name -> (certificate stem, the role its certificate carries)
IDENTITIES = {"agent": ("agent-host-a", Role.AGENT), "enrolled agent": ("enrolled", Role.AGENT),
              "gateway": ("gateway", Role.GATEWAY), "admin person": ("cli", Role.ADMIN),
              "read person": ("cli-read", Role.READ)}


async def _serve(certs: dict[str, Path], tokens: TokenStore | None) -> tuple[aio.Server, int]:
    server = aio.server(interceptors=[AuthInterceptor(tokens, require_identity=True)])
    server.add_generic_rpc_handlers((_Handlers(),))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(
        certs["controller"], certs["controller-key"], certs["ca"], require_client_cert=True))
    await server.start()
    return server, port


async def _outcomes(certs: dict[str, Path], tokens: TokenStore | None,
                    token: str | None) -> dict[tuple[str, str], grpc.StatusCode]:
    server, port = await _serve(certs, tokens)
    found = {}
    try:
        for ident, (stem, _role) in IDENTITIES.items():
            files = TlsFiles(certs["ca"], certs[stem], certs[f"{stem}-key"])
            async with secure_channel(f"127.0.0.1:{port}", files, None, aio=True) as channel:
                for name, method in METHODS:
                    found[(ident, name)] = await _call(channel, name, method, token)
    finally:
        await server.stop(0)
    return found


async def test_without_tokens_each_certificate_calls_what_its_role_allows(
        certs: dict[str, Path]) -> None:
    found = await _outcomes(certs, None, None)
    for (ident, name), code in found.items():
        rule = METHOD_RULES[name]
        role = IDENTITIES[ident][1]
        allowed = rule is None or role in rule
        assert (code == grpc.StatusCode.OK) == allowed, (ident, name, code)
        if not allowed:
            assert code in DENIED, (ident, name, code)


async def test_with_tokens_machines_stay_machines_and_people_need_their_token(
        certs: dict[str, Path]) -> None:
    tokens = TokenStore.from_file(certs["tokens"])
    admin = certs["admin-token"].read_text().strip()
    found = await _outcomes(certs, tokens, admin)
    for (ident, name), code in found.items():
        rule = METHOD_RULES[name]
        role = IDENTITIES[ident][1]
        if role in (Role.AGENT, Role.GATEWAY):  # the admin token changes nothing
            allowed = rule is None or role in rule
        else:  # a person: the token's role (admin) decides
            allowed = rule is None or Role.ADMIN in rule
        assert (code == grpc.StatusCode.OK) == allowed, (ident, name, code)


async def test_an_enrolled_agents_certificate_is_never_an_admin(certs: dict[str, Path]) -> None:
    """The finding: an enrolled agent's certificate called CreateBootstrapToken,
    ApproveHost, ApplyPolicy and SetPaused on a controller without --tokens-file."""
    for tokens in (None, TokenStore.from_file(certs["tokens"])):
        found = await _outcomes(certs, tokens, certs["admin-token"].read_text().strip())
        for m in ("CreateBootstrapToken", "ApproveHost", "ApplyPolicy", "SetPaused",
                  "ListHosts", "WatchRoutes", "ReportGateway"):
            code = found[("enrolled agent", f"/gearshift.v1.ControlService/{m}")]
            assert code == grpc.StatusCode.PERMISSION_DENIED, (m, code)
        assert found[("enrolled agent", "/gearshift.v1.AgentService/Connect")] == \
            grpc.StatusCode.OK
        assert found[("enrolled agent", "/gearshift.v1.EnrolService/Renew")] == \
            grpc.StatusCode.OK


def test_the_admin_rpcs_are_exactly_these() -> None:
    admin_only = {n.rsplit("/", 1)[1] for n, r in METHOD_RULES.items()
                  if r == frozenset({Role.ADMIN})}
    assert admin_only == {"ApplyPolicy", "ApproveDecision", "RejectDecision", "EvaluateNow",
                          "SetPaused", "AbortMigration", "PublishRevision",
                          "CreateBootstrapToken", "ListBootstrapTokens",
                          "RevokeBootstrapToken", "ApproveHost", "RevokeHost", "ResetHost"}
    assert METHOD_RULES["/gearshift.v1.ControlService/ReportGateway"] == \
        frozenset({Role.GATEWAY})
    assert METHOD_RULES["/gearshift.v1.AgentService/Connect"] == frozenset({Role.AGENT})
