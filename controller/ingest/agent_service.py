"""`AgentService.Connect`: one long-lived bidirectional stream per agent.

The first message must be a `Hello`; the controller answers with a `Welcome`
and then acknowledges every `Report`. Commands for the agent are queued on its
`AgentConnection` and written on the same stream. A message that fails
validation ends that agent's stream with a clear status; other agents are not
disturbed.

`Connect` is a plain coroutine that reads with `context.read()` and writes with
`context.write()` (gRPC's reader-writer API), not an async generator with a reader
task beside it: at 10,000 streams every task, future and generator frame held per
stream is tens of MB, and every hand-over between them an event-loop wake-up per
report.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

import grpc
from grpc import aio

from gearshift.common.errors import GearshiftError, InvalidArgument
from gearshift.controller.api.interceptors import grpc_status
from gearshift.controller.api.security import check_peer_host
from gearshift.controller.api.validation import IPAddress, check_hello, check_report, peer_ip
from gearshift.controller.ingest.fleet import FleetState, HostEntry
from gearshift.controller.metrics import ControllerMetrics
from gearshift.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
OUTBOX_LIMIT = 1024


class AgentConnection:
    """The controller's side of one agent's stream, and its one writer.

    Messages for the agent (acks, commands) go through the outbox and are written one
    at a time, in order, by whoever finds no write under way: the stream's handler
    writes the ack of the report it just handled itself, and a message queued from
    elsewhere (a command, a close) while the handler waits for the next report starts
    a short task that writes it. An idle stream so holds no task, future or generator
    of its own: a fleet holds one per agent, and a writer task per stream weighed
    several KB and an extra event-loop wake-up per report.

    Once closed, the writer writes what is queued and then ends the stream with the
    controller's status, if it gave one (`context.abort`: the handler's pending read
    then raises the same `AbortError` and the stream ends there).
    """

    __slots__ = ("_aborted", "_context", "_flusher", "_idle", "_writing", "closed",
                 "end_message", "end_status", "endpoints_ok", "host_id", "outbox", "peer",
                 "peer_addr", "token")

    def __init__(self, host_id: str, context: aio.ServicerContext, *, peer: str = "",
                 peer_addr: IPAddress | None = None) -> None:
        self.host_id = host_id
        # A list, not a deque: it rarely holds more than one message, and an empty deque
        # is 0.6 KB (one 64-slot block), 6 MB over a fleet of 10,000.
        self.outbox: list[agent_pb2.ControllerMessage] = []
        self._context = context
        self._writing = False  # a write is under way (by the handler or `_flusher`)
        self._flusher: asyncio.Task[None] | None = None  # held: the loop keeps weak refs
        self._idle: asyncio.Future[None] | None = None  # made only while `end` waits
        self._aborted = False
        self.closed = False
        # Given in the Welcome; a second stream for this host must present it.
        self.token = secrets.token_urlsafe(24)
        self.peer = peer
        self.peer_addr = peer_addr  # parsed once: endpoints must be on it
        self.endpoints_ok: list[str] = []  # already checked on this stream (check_report)
        # Why the controller ended the stream (None: the agent ended it, or a refusal below).
        self.end_status: grpc.StatusCode | None = None
        self.end_message = ""

    def _queue(self, msg: agent_pb2.ControllerMessage) -> bool:
        if self.closed:
            return False
        if len(self.outbox) >= OUTBOX_LIMIT:
            log.warning("outbox of %s is full; dropping a message", self.host_id)
            return False
        self.outbox.append(msg)
        return True

    def send(self, msg: agent_pb2.ControllerMessage) -> bool:
        """Queue a message from outside the stream's handler (written by a short task)."""
        if not self._queue(msg):
            return False
        self._start_flusher()
        return True

    async def write(self, msg: agent_pb2.ControllerMessage) -> None:
        """Queue a message from the stream's handler and write it now, unless a write is
        under way (which then writes it)."""
        if self._queue(msg) and not self._writing:
            self._writing = True
            await self._drain()

    def close(self, status: grpc.StatusCode | None = None, message: str = "") -> None:
        """End the stream (from outside its handler); a controller-side reason ends it
        with that status, after what is queued."""
        if status is not None and self.end_status is None:
            self.end_status, self.end_message = status, message
        if not self.closed:
            self.closed = True
            self._start_flusher()

    async def end(self, status: grpc.StatusCode | None = None, message: str = "") -> None:
        """End the stream from its handler: wait for a write under way, write what is
        queued, then abort with the controller's status if any (raises `AbortError`)."""
        if status is not None and self.end_status is None:
            self.end_status, self.end_message = status, message
        self.closed = True
        while self._writing:
            self._idle = asyncio.get_running_loop().create_future()
            try:
                await self._idle
            finally:
                self._idle = None
        self._writing = True
        await self._drain()

    def stop(self) -> None:
        """The stream is over (its handler returned): nothing more is written."""
        self.closed = True
        self.outbox.clear()
        if self._flusher is not None and not self._aborted:
            self._flusher.cancel()  # a write that can only fail now (an abort completes)

    def _start_flusher(self) -> None:
        if not self._writing:
            self._writing = True  # here, not in the task: a second send starts no second task
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            await self._drain()
        except aio.AbortError:
            pass  # the stream ended with the controller's status; its handler's read sees it
        except Exception as exc:  # the stream broke; its handler's next read ends it
            log.debug("writing to %s failed: %r", self.host_id, exc)
        finally:
            self._flusher = None

    async def _drain(self) -> None:
        """Write the outbox (`_writing` is set by the caller), then end if closed."""
        try:
            while self.outbox:
                await self._context.write(self.outbox.pop(0))
            if self.closed and self.end_status is not None and not self._aborted:
                self._aborted = True
                await self._context.abort(self.end_status, self.end_message)
        finally:
            self._writing = False
            idle = self._idle
            if idle is not None and not idle.done():
                idle.set_result(None)


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

    def begin_term(self, epoch: int, fleet: FleetState) -> None:
        """A new election term: its fencing epoch, and the fleet state it keeps."""
        self.epoch = epoch
        self.fleet = fleet

    async def Connect(
        self,
        request_iterator: AsyncIterator[agent_pb2.AgentMessage],
        context: aio.ServicerContext,
    ) -> None:
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
        conn = AgentConnection(host_id, context, peer=context.peer(),
                               peer_addr=peer_ip(context.peer()))
        self.connections[host_id] = conn
        entry = self.fleet.hello(first.hello, self.report_interval_s)
        self.metrics.agents_connected.inc()
        log.info("agent %s connected (%d GPUs, %s)", host_id, len(first.hello.gpus),
                 ", ".join(f"{e.engine} {e.version}" for e in first.hello.engines) or "no engines")
        del first  # the fleet keeps the hello as bytes; its parsed message is not held
        if self._on_hello is not None:
            self._on_hello(entry)
        try:
            await conn.write(agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(
                report_interval_s=self.report_interval_s, controller_epoch=self.epoch,
                controller_id=self.controller_id, session_token=conn.token)))
            # One coroutine reads, handles and acknowledges (see `AgentConnection`). An
            # `AbortError` out of `read` or `write` is the stream ended by the controller
            # (revoked, replaced, leadership lost) and goes on to gRPC, which expects it.
            while (msg := await context.read()) is not aio.EOF:
                try:
                    ack = self._handle(host_id, entry, msg, conn)
                except GearshiftError as exc:
                    log.warning("agent %s: %s; closing its stream", host_id, exc.message)
                    await conn.end(grpc_status(exc), exc.message)
                    return
                except Exception as exc:  # a bug: still end with a status and a message
                    log.exception("agent %s: handling its message failed", host_id)
                    await conn.end(grpc.StatusCode.INTERNAL,
                                   f"the controller failed on this agent's message: "
                                   f"{type(exc).__name__}")
                    return
                del msg  # not kept while the next one is awaited (see above)
                if ack is not None:
                    await conn.write(ack)
                    del ack  # nor the ack (a tracked object: see gc_policy)
            await conn.end()  # the agent ended its side: what is queued, then OK
        finally:
            conn.stop()
            if self.connections.get(host_id) is conn:
                del self.connections[host_id]
                self.fleet.disconnected(host_id, entry)
            self.metrics.agents_connected.dec()
            log.info("agent %s stream closed", host_id)

    def _handle(self, host_id: str, entry: HostEntry, msg: agent_pb2.AgentMessage,
                conn: AgentConnection) -> agent_pb2.ControllerMessage | None:
        """Apply one message of an open stream; returns the ack to write, if any."""
        if conn.closed:
            # Ended by the controller (revoked, replaced, leadership lost) while this
            # message was on its way: the host may have been forgotten, and nothing it
            # says now may put its deployments back in the routing table.
            return None
        kind = msg.WhichOneof("body")
        if kind == "report":
            return self._handle_report(host_id, entry, msg.report, conn)
        if kind == "command_result":
            if self._on_result is not None:
                self._on_result(host_id, msg.command_result)
            return None
        if kind == "hello":
            self.metrics.rejected.labels("second_hello").inc()
            raise InvalidArgument("a second hello on the same stream; reconnect instead")
        self.metrics.rejected.labels("empty").inc()
        raise InvalidArgument("empty agent message (no body set)")

    def _handle_report(self, host_id: str, entry: HostEntry, report: agent_pb2.Report,
                       conn: AgentConnection) -> agent_pb2.ControllerMessage:
        t0 = time.perf_counter()
        try:
            check_report(report, host_id, conn.peer_addr, conn.endpoints_ok)
            self.fleet.check_models(report)
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
        self.metrics.report_seconds.observe(time.perf_counter() - t0)
        return ack

    def send_command(self, host_id: str, command: agent_pb2.Command) -> bool:
        conn = self.connections.get(host_id)
        if conn is None:
            return False
        return conn.send(agent_pb2.ControllerMessage(command=command))
