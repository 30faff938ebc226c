"""`AgentService.Connect`: one long-lived bidirectional stream per agent.

The first message must be a `Hello`; the controller answers with a `Welcome`
and then acknowledges every `Report`. Commands for the agent are queued on its
`AgentConnection` and written on the same stream. A message that fails
validation ends that agent's stream with a clear status; other agents are not
disturbed.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import grpc
from grpc import aio

from gearshift.common.errors import GearshiftError, InvalidArgument
from gearshift.controller.fleet import FleetState, HostEntry
from gearshift.controller.interceptors import grpc_status
from gearshift.controller.metrics import ControllerMetrics
from gearshift.controller.security import check_peer_host
from gearshift.controller.validation import IPAddress, check_hello, check_report, peer_ip
from gearshift.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
OUTBOX_LIMIT = 1024


class AgentConnection:
    """The controller's side of one agent's stream.

    Its outbox is a deque and a future made only while the stream's writer waits:
    a fleet holds one per agent, and an `asyncio.Queue` (with its own deques of
    getters and putters) weighed about 3 KB each.
    """

    __slots__ = ("_waiter", "closed", "end_message", "end_status", "endpoints_ok", "host_id",
                 "outbox", "peer", "peer_addr", "token")

    def __init__(self, host_id: str, *, peer: str = "",
                 peer_addr: IPAddress | None = None) -> None:
        self.host_id = host_id
        self.outbox: deque[agent_pb2.ControllerMessage | None] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False
        # Given in the Welcome; a second stream for this host must present it.
        self.token = secrets.token_urlsafe(24)
        self.peer = peer
        self.peer_addr = peer_addr  # parsed once: endpoints must be on it
        self.endpoints_ok: set[str] = set()  # already checked on this stream
        # Why the controller ended the stream (None: the agent ended it, or a refusal below).
        self.end_status: grpc.StatusCode | None = None
        self.end_message = ""

    def send(self, msg: agent_pb2.ControllerMessage) -> bool:
        if self.closed:
            return False
        if len(self.outbox) >= OUTBOX_LIMIT:
            log.warning("outbox of %s is full; dropping a message", self.host_id)
            return False
        self.outbox.append(msg)
        self._wake()
        return True

    def close(self, status: grpc.StatusCode | None = None, message: str = "") -> None:
        """End the stream; a controller-side reason ends it with that status."""
        if status is not None and self.end_status is None:
            self.end_status, self.end_message = status, message
        if not self.closed:
            self.closed = True
            self.outbox.append(None)  # after what is queued: the writer ends there
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_message(self) -> agent_pb2.ControllerMessage | None:
        """The next message to write; None once the stream is to end."""
        while not self.outbox:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.outbox.popleft()


ReportHook = Callable[[str, HostEntry, agent_pb2.Report, float], None]
HelloHook = Callable[[HostEntry], None]
ResultHook = Callable[[str, agent_pb2.CommandResult], None]


class AgentService(agent_pb2_grpc.AgentServiceServicer):
    def __init__(
        self,
        fleet: FleetState,
        metrics: ControllerMetrics,
        *,
        report_interval_s: float,
        epoch: int,
        controller_id: str,
        on_hello: HelloHook | None = None,
        on_report: ReportHook | None = None,
        on_command_result: ResultHook | None = None,
        require_peer_host: bool = False,
        refuse_host: Callable[[str], str | None] = lambda _host: None,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.report_interval_s = report_interval_s
        self.epoch = epoch
        self.controller_id = controller_id
        self.connections: dict[str, AgentConnection] = {}
        self._on_hello = on_hello
        self._on_report = on_report
        self._on_result = on_command_result
        self.require_peer_host = require_peer_host  # mutual TLS: the certificate names the host
        self.refuse_host = refuse_host  # why a host may not connect (revoked), or None

    async def Connect(
        self,
        request_iterator: AsyncIterator[agent_pb2.AgentMessage],
        context: aio.ServicerContext,
    ) -> AsyncIterator[agent_pb2.ControllerMessage]:
        # Messages are read with `context.read()`, not through `request_iterator`: gRPC's
        # iterator keeps the last message it yielded while it awaits the next, a whole
        # report interval, and a parsed report holds its protobuf arena (about 11 KB for
        # 8 deployments): a hundred MB over a fleet of 10,000.
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT_S)
        except TimeoutError:
            first = aio.EOF
        if first is aio.EOF:
            self.metrics.rejected.labels("no_hello").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"expected a hello within {HELLO_TIMEOUT_S:.0f} s")
            return
        if first.WhichOneof("body") != "hello":
            self.metrics.rejected.labels("no_hello").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the first message must be a hello, found {first.WhichOneof('body')}")
            return
        try:
            check_hello(first.hello)
            check_peer_host(context, first.hello.host_id, require=self.require_peer_host)
        except GearshiftError as exc:
            self.metrics.rejected.labels("bad_hello").inc()
            await context.abort(grpc_status(exc), exc.message)
            return
        refusal = self.refuse_host(first.hello.host_id)
        if refusal is not None:
            self.metrics.rejected.labels("revoked").inc()
            log.warning("refused a hello from %s: %s", context.peer(), refusal)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
            return

        host_id = first.hello.host_id
        previous = self.connections.get(host_id)
        if previous is not None and not previous.closed:
            token = first.hello.session_token
            if not (token and hmac.compare_digest(token.encode(), previous.token.encode())):
                self.metrics.rejected.labels("host_taken").inc()
                log.warning("a stream from %s claims host %s, connected from %s; refused",
                            context.peer(), host_id, previous.peer)
                await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                    f"host {host_id!r} is connected on another stream; a "
                                    "reconnect must present that stream's session token")
                return
            log.info("host %s reconnected; closing its previous stream", host_id)
            previous.close(grpc.StatusCode.ABORTED,
                           f"host {host_id!r} reconnected on a new stream; this one is closed")
        conn = AgentConnection(host_id, peer=context.peer(), peer_addr=peer_ip(context.peer()))
        self.connections[host_id] = conn
        entry = self.fleet.hello(first.hello, self.report_interval_s)
        self.metrics.agents_connected.inc()
        log.info("agent %s connected (%d GPUs, %s)", host_id, len(first.hello.gpus),
                 ", ".join(f"{e.engine} {e.version}" for e in first.hello.engines) or "no engines")
        if self._on_hello is not None:
            self._on_hello(entry)
        yield agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(
            report_interval_s=self.report_interval_s, controller_epoch=self.epoch,
            controller_id=self.controller_id, session_token=conn.token))

        reader = asyncio.create_task(self._read(context, host_id, entry, conn))
        try:
            while True:
                msg = await conn.next_message()
                if msg is None:
                    break
                yield msg
                del msg  # gRPC's writer keeps the last one it wrote; this frame need not
            failure = reader.exception() if reader.done() else None
            if isinstance(failure, GearshiftError):
                await context.abort(grpc_status(failure), failure.message)
            elif failure is not None:  # a bug: still end with a status and a message
                await context.abort(grpc.StatusCode.INTERNAL,
                                    f"the controller failed on this agent's message: "
                                    f"{type(failure).__name__}")
            elif conn.end_status is not None:
                await context.abort(conn.end_status, conn.end_message)
        finally:
            reader.cancel()
            conn.closed = True
            if self.connections.get(host_id) is conn:
                del self.connections[host_id]
                self.fleet.disconnected(host_id, entry)
            self.metrics.agents_connected.dec()
            log.info("agent %s stream closed", host_id)

    async def _read(self, context: aio.ServicerContext, host_id: str,
                    entry: HostEntry, conn: AgentConnection) -> None:
        try:
            while (msg := await context.read()) is not aio.EOF:
                kind = msg.WhichOneof("body")
                if kind == "report":
                    self._handle_report(host_id, entry, msg.report, conn)
                elif kind == "command_result":
                    if self._on_result is not None:
                        self._on_result(host_id, msg.command_result)
                elif kind == "hello":
                    self.metrics.rejected.labels("second_hello").inc()
                    raise InvalidArgument("a second hello on the same stream; reconnect instead")
                else:
                    self.metrics.rejected.labels("empty").inc()
                    raise InvalidArgument("empty agent message (no body set)")
                del msg  # not kept while the next one is awaited (see Connect)
        except GearshiftError as exc:
            log.warning("agent %s: %s; closing its stream", host_id, exc.message)
            raise
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            conn.close()

    def _handle_report(self, host_id: str, entry: HostEntry, report: agent_pb2.Report,
                       conn: AgentConnection) -> None:
        t0 = time.perf_counter()
        try:
            check_report(report, host_id, conn.peer_addr, conn.endpoints_ok)
        except GearshiftError:
            self.metrics.rejected.labels("bad_report").inc()
            raise
        applied = self.fleet.report(host_id, report)
        if applied:
            self.metrics.reports.inc()
            self.metrics.deployment_samples.inc(len(report.deployments))
            if self._on_report is not None:
                self._on_report(host_id, entry, report, self.fleet.now())
        ack = agent_pb2.ControllerMessage()
        ack.ack.seq = report.seq
        conn.send(ack)
        self.metrics.report_seconds.observe(time.perf_counter() - t0)

    def send_command(self, host_id: str, command: agent_pb2.Command) -> bool:
        conn = self.connections.get(host_id)
        if conn is None:
            return False
        return conn.send(agent_pb2.ControllerMessage(command=command))
