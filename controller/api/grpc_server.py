"""The controller's gRPC server: interceptors, services, health, reflection and the port.

`build_server` assembles the server the controller serves on, before it starts:
bearer tokens (``--tokens-file`` or ``$GEARSHIFT_TOKENS``) are checked first, then
the leader gate and the error mapping; TLS (mutual when a CA is given) or, only
on loopback, plaintext.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from gearshift.common.errors import ConfigError
from gearshift.controller.api.control_service import ControlService
from gearshift.controller.api.interceptors import ErrorInterceptor
from gearshift.controller.api.security import (
    AuthInterceptor,
    TokenStore,
    check_plaintext_listen,
    server_credentials,
)
from gearshift.controller.config import ControllerConfig
from gearshift.controller.ha.leadership import LeaderGate, Leadership
from gearshift.controller.ingest.agent_service import AgentService
from gearshift.v1 import agent_pb2, agent_pb2_grpc, control_pb2, control_pb2_grpc, enrol_pb2_grpc

# Logs under the controller process's logger name, which operators filter on.
log = logging.getLogger("gearshift.controller.server")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# New streams gRPC core holds until the Python server asks for them. The asyncio server
# asks for one call at a time and each answer passes through the event loop, which also
# carries every connected agent's reports; when a fleet connects at once (start-up, a
# controller restart, a network blip) streams arrive faster than that.
# Core's defaults (grpc.server.max_pending_requests 1,000, hard limit 3,000, see
# src/core/server/server.h) then drop a random share of the queued streams
# above 1,000 and all above 3,000: those agents see CANCELLED (or INTERNAL from their
# first write) and come back later, adding load. A pending stream costs core a few
# KB, so the controller queues twice its design fleet (10,000 agents) instead.
MAX_PENDING_STREAMS = 20_000
# Core also cancels a stream that waited 30 s in that queue (its default): 10,000 agents
# connecting within one report interval on a busy machine wait longer (CANCELLED at
# connect for a sixth of them at 30 s), and each would reconnect into the same queue.
MAX_UNREQUESTED_S = 120
ENROL_MAX_MESSAGE_BYTES = 64 * 1024  # a token and a CSR
# HTTP/2 flow control without gRPC's bandwidth-delay probe. With it, core sends a PING
# for the first DATA frame a connection reads once the probe's delay has passed (100 ms,
# growing towards 10 s while the estimate holds: src/core/lib/transport/bdp_estimator.cc),
# to grow the receive window for bulk transfers. An agent's connection carries one small
# report (about 2 KB) every interval, so every report drew a PING and its ack: a frame
# more each way and a round of core's threads per report, 0.05-0.15 core at 10,000 agents
# (docs/architecture.md, "Scale targets"), for a window that the default 64 KiB already
# leaves far from full. The largest message (MAX_MESSAGE_BYTES) still passes at that
# window's pace: 64 KiB a round trip.
BDP_PROBE = 0
# The controller's server options (the ingest bench's gRPC floor, bench/grpc_floor.py,
# serves with the same).
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.bdp_probe", BDP_PROBE),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.server.max_pending_requests", MAX_PENDING_STREAMS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_STREAMS),
    ("grpc.server_max_unrequested_time_in_server", MAX_UNREQUESTED_S),
]


@dataclass
class GrpcServer:
    """A bound, not yet started server and its health service."""

    server: aio.Server
    health: HealthServicer
    services: tuple[str, ...]  # full names of the agent and control services
    port: int

    async def serving(self) -> None:
        """Mark the agent and control services (and the server as a whole) SERVING."""
        for name in self.services:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)


def load_tokens(config: ControllerConfig) -> TokenStore | None:
    """Bearer tokens from ``--tokens-file``, else ``$GEARSHIFT_TOKENS``; None: no tokens."""
    if config.tokens_file is not None:
        return TokenStore.from_file(config.tokens_file)
    if os.environ.get("GEARSHIFT_TOKENS"):
        return TokenStore.from_env("GEARSHIFT_TOKENS")
    return None


def build_server(config: ControllerConfig, agents: AgentService, control: ControlService,
                 leadership: Callable[[], Leadership | None],
                 enrol: Any = None) -> GrpcServer:
    """The server with its interceptors and services, bound to ``config.listen``."""
    tokens = load_tokens(config)
    interceptors: list[aio.ServerInterceptor] = [LeaderGate(leadership), ErrorInterceptor()]
    client_certs = config.tls_cert is not None and config.tls_ca is not None
    if tokens is not None or client_certs:
        # Refuse before any handler runs: every call by its caller's identity.
        interceptors.insert(0, AuthInterceptor(tokens, require_identity=client_certs))
    if tokens is not None:
        log.info("bearer tokens required of people on the control API (%s)", tokens.describe())
    elif client_certs:
        log.warning("no --tokens-file: people's calls are decided by their certificate's role "
                    "(spiffe://gearshift/role/read|admin; `gearshift certs init` writes cli.pem "
                    "as admin); an agent's or a gateway's certificate can never act as a "
                    "person (docs/security.md)")
    server = aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    agent_pb2_grpc.add_AgentServiceServicer_to_server(agents, server)
    control_pb2_grpc.add_ControlServiceServicer_to_server(control, server)
    if enrol is not None:  # Renew: authenticated by the agent's current certificate
        enrol_pb2_grpc.add_EnrolServiceServicer_to_server(enrol, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (
        agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
        control_pb2.DESCRIPTOR.services_by_name["ControlService"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    if config.tls_cert is not None and config.tls_key is not None:
        creds = server_credentials(config.tls_cert, config.tls_key, config.tls_ca,
                                   require_client_cert=config.tls_ca is not None)
        port = server.add_secure_port(config.listen, creds)
    else:
        check_plaintext_listen(config.listen)
        port = server.add_insecure_port(config.listen)
    if port == 0:
        raise ConfigError(f"--listen: cannot bind {config.listen}")
    return GrpcServer(server, health, names[:2], port)


def build_enrol_server(config: ControllerConfig, enrol: Any) -> tuple[aio.Server, int]:
    """The enrolment listener (``--enrol-listen``): server-side TLS only, EnrolService alone.

    gRPC asks a client for a certificate on every handshake of a port or on none, so
    agents that have no certificate yet get a port of their own; everything else
    stays behind mutual TLS on ``--listen`` (docs/enrolment.md).
    """
    assert config.tls_cert is not None and config.tls_key is not None
    server = aio.server(
        interceptors=[ErrorInterceptor()],
        options=[("grpc.max_receive_message_length", ENROL_MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", ENROL_MAX_MESSAGE_BYTES)])
    enrol_pb2_grpc.add_EnrolServiceServicer_to_server(enrol, server)
    creds = server_credentials(config.tls_cert, config.tls_key, None, require_client_cert=False)
    port = server.add_secure_port(config.enrol_listen, creds)
    if port == 0:
        raise ConfigError(f"--enrol-listen: cannot bind {config.enrol_listen}")
    return server, port
