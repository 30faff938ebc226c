"""The controller process: gRPC services, the store, and periodic housekeeping.

`Controller` wires the in-memory fleet state, the durable store (through one
batching writer), the agent and control services, gRPC health and reflection
(assembled by `controller.api.grpc_server`), and the operators' HTTP listener
(`/metrics`, `/healthz`, `/readyz`; see `readiness`).
Its settings are a `ControllerConfig` (`controller.config`). `run_controller` is
the CLI's entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger
from grpc import aio

from gearshift.common.errors import InvalidArgument, NotFound
from gearshift.common.ops_http import OpsListener
from gearshift.controller.api.control_service import ControlService
from gearshift.controller.api.grpc_server import build_enrol_server, build_server
from gearshift.controller.config import ControllerConfig
from gearshift.controller.enrolment.service import REVOCATION_REFRESH_S, EnrolService, Revocations
from gearshift.controller.enrolment.store import EnrolmentStore
from gearshift.controller.gc_policy import GcPolicy
from gearshift.controller.ha.leader import LeaderElector
from gearshift.controller.ha.leadership import Leadership
from gearshift.controller.ingest.agent_service import AgentService
from gearshift.controller.ingest.fleet import FleetState, HostEntry
from gearshift.controller.ingest.rollup import RollupAggregator
from gearshift.controller.limits import raise_open_files_limit
from gearshift.controller.loop_lag import LoopLagProbe
from gearshift.controller.metrics import ControllerMetrics
from gearshift.controller.moves.commands import deployment_phase_name
from gearshift.controller.moves.store import MigrationRow
from gearshift.controller.store.persistence import Persistence
from gearshift.controller.term import RECENT_HOST_S, LeaderTerm, open_term
from gearshift.policies.loader import Policy
from gearshift.v1 import agent_pb2, control_pb2

if TYPE_CHECKING:
    from gearshift.controller.enrolment.certificate_authority import SigningCa

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL_S = 5.0
# How long a new controller waits, at most, for the hosts it knew to report again
# before it serves routing tables to gateways; hosts seen within RECENT_HOST_S count
# (`controller.term`).
ROUTES_WARMUP_INTERVALS = 3
ROUTES_WARMUP_MIN_S = 30.0
HOST_PRUNE_INTERVAL_S = 60.0
DEFAULT_POLICY_INTERVAL_S = 60.0  # with no policy, or one that cannot be scheduled


def _policy_trigger(policy: Policy) -> IntervalTrigger:
    """The policy's evaluation schedule; InvalidArgument when it cannot be built."""
    try:
        return IntervalTrigger(seconds=max(1.0, policy.doc.spec.interval))
    except (OverflowError, ValueError) as exc:
        raise InvalidArgument(f"{policy.source}: spec.interval: cannot be scheduled "
                              f"({policy.doc.spec.interval:g}s: {exc})") from None


class Controller:
    """One controller process. It serves reads at once; it acts (agents' streams,
    policy evaluation, migrations, routes) only while it leads: always on SQLite,
    while it holds the lease on PostgreSQL (see `leader.py` and `ha.py`)."""

    def __init__(self, config: ControllerConfig, *, metrics: ControllerMetrics | None = None) -> None:
        config.validate()
        self.config = config
        self.metrics = metrics or ControllerMetrics()
        fleet = FleetState()
        self.persistence = Persistence.open(config.db_url, config.data_dir, self.metrics.registry)
        self.enrolments = EnrolmentStore(self.persistence.store.engine)
        self.revocations = Revocations(self.enrolments)
        self.revocations.refresh()  # revoked hosts are refused from the first hello
        self.enrol = EnrolService(self.enrolments, self._signing_ca(), config.enrolled_cert_ttl_s,
                                  self.revocations, self.metrics.enrolments)
        self.leadership: Leadership | None = None
        # Epoch 0 until the election gives one (see _on_elected).
        self.agents = AgentService(
            fleet, self.metrics, report_interval_s=config.report_interval_s,
            epoch=0, controller_id=config.controller_id,
            require_peer_host=config.tls_ca is not None,
            refuse_host=self.revocations.refusal,
            on_hello=self._on_hello, on_report=self._on_report,
            on_command_result=self._on_command_result)
        self.control = ControlService(
            fleet, controller_id=config.controller_id, epoch=0,
            store_kind=self.persistence.dialect, paused=self.persistence.paused,
            routes_warmup_s=max(ROUTES_WARMUP_MIN_S,
                                ROUTES_WARMUP_INTERVALS * config.report_interval_s),
            set_paused=self.persistence.set_paused, publish_revision=self.publish_revision,
            enrolment_store=self.enrolments, revocations=self.revocations,
            on_host_revoked=self._close_revoked, leadership=lambda: self.leadership)
        # Minutes open when the lead changes keep their reports: one aggregator, handed
        # to each term's rate series.
        self.rollups = RollupAggregator()
        # The parts a leader acts with, also serving reads before the first election.
        self.term = self._open_term(0, fleet)
        self._begin_term(started=fleet.started)
        self._elector_task: asyncio.Task[None] | None = None
        self._leader_tasks: list[asyncio.Task[None]] = []
        self._led = False  # led at least once: owns what it learned
        self._pruned_at = 0.0  # when gone hosts were last forgotten
        self.scheduler: AsyncIOScheduler | None = None
        self.server: aio.Server | None = None
        self.port = 0
        self.enrol_server: aio.Server | None = None
        self.enrol_port: int | None = None
        self.metrics_port: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ops: OpsListener | None = None
        self._serving = False  # start() has finished: gRPC served, first election settled
        self.metrics.is_leader.set_function(
            lambda: 1.0 if self.leadership is not None and self.leadership.leading else 0.0)
        self.metrics.leader_epoch.set_function(lambda: float(self.epoch))

    def _signing_ca(self) -> SigningCa | None:
        if self.config.ca_key is None or self.config.tls_ca is None:
            return None
        from gearshift.controller.enrolment.certificate_authority import SigningCa
        return SigningCa.load(self.config.tls_ca, self.config.ca_key)

    def _close_revoked(self, host_id: str, why: str = "") -> None:
        """End the open stream of a revoked host, if it is connected here, and forget the
        host: its deployments leave the routing table at once (gateways must send it
        no more prompts), not when it would be pruned for silence."""
        conn = self.agents.connections.get(host_id)
        if conn is not None and not conn.closed:
            log.warning("closing the stream of revoked host %s", host_id)
            conn.close(grpc.StatusCode.PERMISSION_DENIED,
                       self.revocations.refusal(host_id) or f"host {host_id!r} is revoked")
        if self.fleet.remove_host(host_id):
            log.warning("revoked host %s forgotten; its deployments are no longer routed",
                        host_id)

    async def _watch_revocations(self) -> None:
        """Revocations made on any controller reach this one within REVOCATION_REFRESH_S."""
        while True:
            await asyncio.sleep(REVOCATION_REFRESH_S)
            try:
                new = await asyncio.to_thread(self.revocations.refresh)
                if new:
                    log.warning("hosts revoked in the store: %s", ", ".join(sorted(new)))
                self.metrics.revoked_hosts.set(len(self.revocations.hosts))
                for host_id in [h for h in self.revocations.hosts
                                if h in self.agents.connections or h in self.fleet.hosts]:
                    self._close_revoked(host_id)
            except Exception:  # the store is away: the next round retries
                log.exception("reading revocations failed")

    @property
    def fleet(self) -> FleetState:
        return self.term.fleet

    @property
    def epoch(self) -> int:
        """The fencing epoch of the current term (0 before the first election)."""
        return self.term.epoch

    def _open_term(self, epoch: int, fleet: FleetState) -> LeaderTerm:
        """The term's parts, read afresh from the store (at start and at every new term,
        since another controller may have led meanwhile)."""
        return open_term(epoch=epoch, config=self.config, store=self.persistence.store,
                         fleet=fleet, rollups=self.rollups, rollup_sink=self.persistence.writer,
                         metrics=self.metrics, paused=self.persistence.paused,
                         send_command=self.agents.send_command, prepare=_policy_trigger,
                         on_policy_change=lambda _p: self._schedule_policy(), clock=time.time)

    def _begin_term(self, started: float) -> None:
        """Hand the current term to the services that act with it."""
        term = self.term
        self.agents.begin_term(term.epoch, term.fleet)
        self.control.begin_term(epoch=term.epoch, fleet=term.fleet,
                                decisions=term.decisions, policy_loop=term.policy_loop,
                                orchestrator=term.orchestrator,
                                started=started, expected_hosts=term.expected_hosts)

    # -- leadership ---------------------------------------------------------------

    @property
    def leading(self) -> bool:
        return self.leadership is None or self.leadership.leading

    async def _on_elected(self, epoch: int) -> None:
        assert self.leadership is not None
        # A new term: what another controller did meanwhile is in the store.
        fleet = FleetState() if self._led else self.fleet
        self.persistence.reload_settings()
        self.term.end()  # the previous term's worker thread
        self.term = await asyncio.to_thread(self._open_term, epoch, fleet)
        # Hosts revoked while another controller led are refused from this term's first
        # hello (the periodic read may be up to REVOCATION_REFRESH_S old).
        await asyncio.to_thread(self.revocations.refresh)
        self._begin_term(started=time.time())
        self._led = True
        self._leader_tasks = [asyncio.create_task(self._orchestrate())]
        self.leadership.lead(epoch)  # opens the gate: agents and gateways are served
        self._schedule_policy()
        log.warning("controller %s leads with epoch %d", self.config.controller_id, epoch)

    async def _on_lost(self) -> None:
        if self.leadership is not None:
            self.leadership.follow()  # closes the gate first
        if self.scheduler is not None and self.scheduler.get_job("policy") is not None:
            self.scheduler.remove_job("policy")
        for t in self._leader_tasks:
            t.cancel()
        self._leader_tasks = []
        for conn in list(self.agents.connections.values()):
            # agents follow the refusal of their next hello to the new leader
            conn.close(grpc.StatusCode.UNAVAILABLE,
                       f"controller {self.config.controller_id} no longer leads")
        self.control.end_route_streams()
        log.warning("controller %s no longer leads (epoch %d)", self.config.controller_id,
                    self.epoch)

    def _on_hello(self, entry: HostEntry) -> None:
        self.persistence.host_seen(entry)

    def _on_report(self, host_id: str, entry: HostEntry, report: agent_pb2.Report, ts: float) -> None:
        self.term.series.report(host_id, entry, report, ts)  # into its minute's rollups
        self.persistence.report(host_id, report, ts)  # new revisions too (churn)

    def _on_command_result(self, host_id: str, result: agent_pb2.CommandResult) -> None:
        self.term.orchestrator.on_command_result(host_id, result)

    def publish_revision(self, model: str, revision: str, source: str) -> tuple[MigrationRow | None, str]:
        """Record a new revision and roll it out on the engine that serves the model."""
        added = self.term.decisions.add_revision(model, revision, source=source or "cli")
        ready = [d for _h, d, _ts in self.fleet.deployments_of(model)
                 if d.phase == agent_pb2.DEPLOYMENT_PHASE_READY]
        if not ready:
            raise NotFound(f"model {model!r} has no ready deployment to roll revision {revision} onto")
        if all(d.revision == revision for d in ready):
            return None, f"{model} already serves revision {revision}"
        engine = ready[0].engine
        row = self.term.orchestrator.create(model, engine, engine, kind="revision_rollout",
                                       target_revision=revision)
        note = "" if added else " (revision was already known)"
        return row, f"rolling out {model} revision {revision} on {engine}: migration {row.id}{note}"

    def _schedule_policy(self) -> None:
        if self.scheduler is None or not self.leading:
            return
        active = self.term.policies.active()
        trigger = IntervalTrigger(seconds=DEFAULT_POLICY_INTERVAL_S)
        if active is not None:
            try:
                trigger = _policy_trigger(active[1])
            except InvalidArgument as exc:  # never lose the lead over a stored version
                log.error("%s; evaluating every %.0fs until another policy is applied",
                          exc.message, DEFAULT_POLICY_INTERVAL_S)
        self.scheduler.add_job(self._evaluate, trigger, id="policy",
                               replace_existing=True, max_instances=1, coalesce=True)
        log.info("policy evaluation every %.0fs", trigger.interval.total_seconds())

    async def _evaluate(self) -> None:
        # A coroutine job: APScheduler runs it on the event loop, where the orchestrator
        # ticks and the gRPC handlers run, so evaluation never races a tick from a thread.
        if not self.leading:
            return
        try:
            self.term.policy_loop.evaluate()
        except Exception:  # the next interval retries
            log.exception("policy evaluation failed")

    async def _orchestrate(self) -> None:
        interval_s = min(1.0, self.config.report_interval_s)
        while True:
            await asyncio.sleep(interval_s)
            if not self.leading:  # a paused leader resuming: never act on a lapsed term
                continue
            try:
                term = self.term
                term.series.sample(time.time())
                term.orchestrator.tick()
                term.review.reconcile()  # decision status from the migration rows
            except Exception:  # level-triggered: the next tick retries
                log.exception("orchestrator tick failed")

    async def start(self) -> None:
        grpc_server = build_server(self.config, self.agents, self.control,
                                   lambda: self.leadership, enrol=self.enrol)
        self.port = grpc_server.port
        self._start_elector()
        await grpc_server.server.start()
        await grpc_server.serving()
        self.server = grpc_server.server
        if self.config.enrol_listen:
            self.enrol_server, self.enrol_port = build_enrol_server(self.config, self.enrol)
            await self.enrol_server.start()
            log.info("enrolment listener on %s (server TLS; bootstrap tokens)",
                     self.config.enrol_listen.rpartition(":")[0] + f":{self.enrol_port}")
        ops_at = self.config.ops_address()
        if ops_at is not None:
            self._ops = OpsListener(self.metrics.registry, self.readiness)
            self.metrics_port = await self._ops.start(*ops_at)
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        self._tasks.append(asyncio.create_task(self._watch_revocations()))
        self.scheduler = AsyncIOScheduler()
        self.scheduler.start()
        await self._first_election()
        self._serving = True
        host = self.config.listen.rpartition(":")[0]
        log.info("controller %s (%s) listening on %s:%d (store: %s)",
                 self.config.controller_id, f"leader, epoch {self.epoch}" if self.leading
                 else "follower", host, self.port, self.persistence.dialect)

    def readiness(self) -> tuple[bool, str]:
        """Ready = serving its gRPC API in a known role: the leader, or a follower
        that knows a live leader (it serves reads and names the leader to writers), and
        its store accepts writes."""
        if not self._serving:
            return False, "starting"
        refused = self.persistence.writer.failing
        if refused is not None:  # no write succeeds: a probe should take it out of service
            return False, f"the store refuses writes: {refused}"
        if self.leading:
            return True, f"leader, epoch {self.epoch}"
        lease = self.leadership.lease() if self.leadership is not None else None
        if lease is not None and lease.live and lease.holder \
                and lease.holder != self.config.controller_id:
            return True, f"follower of {lease.holder}"
        return False, "no leader elected yet"

    @property
    def address(self) -> str:
        """HOST:PORT where clients reach this controller."""
        if self.config.advertise:
            return self.config.advertise
        host = self.config.listen.rpartition(":")[0]
        if host in ("0.0.0.0", "[::]", "::", ""):
            host = socket.getfqdn()
        return f"{host}:{self.port}"

    def _start_elector(self) -> None:
        cfg = self.config
        url = cfg.db_url or self.persistence.store.url
        ttl = cfg.lease_ttl_s
        elector = LeaderElector.for_url(url, cfg.controller_id, self.address,
                                        store=self.persistence.store, ttl_s=ttl,
                                        renew_every_s=ttl / 5)
        self.leadership = Leadership(elector, ha=isinstance(elector, LeaderElector), ttl_s=ttl)
        self._elector_task = asyncio.create_task(elector.run(self._on_elected, self._on_lost))

    async def _first_election(self) -> None:
        """Wait until the first lease attempt has settled, so that a lone controller
        serves as leader from its first answer (bounded: a follower stays one)."""
        assert self.leadership is not None
        deadline = time.monotonic() + self.config.lease_ttl_s
        while time.monotonic() < deadline and not self.leadership.leading:
            state = self.leadership.lease()
            if self.leadership.ha and state is not None and state.live \
                    and state.holder != self.config.controller_id:
                break  # another controller leads: this one follows
            await asyncio.sleep(0.02)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            try:
                # Completed minutes to the store, the learner (its snapshot is stored
                # below, off the event loop) and the SLA gauges.
                await self.term.series.tick(time.time())
                self._update_gauges()
                self.fleet.gateway_stats.prune(time.time())
                if not self.leading:
                    continue
                self.persistence.save_hosts(self.fleet)
                if time.time() - self._pruned_at >= HOST_PRUNE_INTERVAL_S:
                    self._pruned_at = time.time()
                    pruned = self.persistence.prune_fleet(self.fleet, self._pruned_at)
                    pruned += await asyncio.to_thread(self.persistence.prune_stored,
                                                      set(self.fleet.hosts), self._pruned_at)
                    if pruned:
                        log.info("forgot %d hosts that are gone: %s", len(pruned),
                                 ", ".join(pruned[:10]))
                learned = self.term.learner.snapshot()
                if learned:
                    await asyncio.to_thread(self.persistence.store.set_settings, learned)
            except Exception:  # keep the loop alive; the next tick retries
                log.exception("housekeeping failed")

    def _update_gauges(self) -> None:
        """The fleet's and the migrations' gauges: the leader's view; a follower (whose
        fleet is a lapsed term's, if any) exports zeros, so alerts summed over every
        controller count each host and move once."""
        leading = self.leading
        names = {control_pb2.HOST_STATE_CONNECTED: "connected",
                 control_pb2.HOST_STATE_JOINING: "joining",
                 control_pb2.HOST_STATE_UNREACHABLE: "unreachable",
                 control_pb2.HOST_STATE_DISCONNECTED: "disconnected"}
        # kept by the fleet: no walk over it
        by_state = self.fleet.host_state_counts() if leading else {}
        for value, state in names.items():
            self.metrics.hosts.labels(state).set(by_state.get(value, 0))
        self.metrics.deployments.clear()
        for (engine, phase_value), n in (self.fleet.deployment_counts().items() if leading
                                         else ()):
            phase = deployment_phase_name(phase_value)
            self.metrics.deployments.labels(engine, phase).inc(n)  # unknown phases add up
        self.metrics.route_version.set(self.fleet.route_version)
        now = time.time()
        for (engine, model), n in self.fleet.restarts.take().items():
            self.metrics.engine_restarts.labels(engine, model).inc(n)
        self.metrics.set_crash_looping(
            self.fleet.restarts.crash_looping(now).items() if leading else ())
        orchestrator = self.term.orchestrator
        active = orchestrator.active() if leading else []
        in_flight: dict[tuple[str, str], int] = {}
        stuck: dict[str, int] = {}
        for row in active:
            key = (row.kind.value, row.phase.value)
            in_flight[key] = in_flight.get(key, 0) + 1
            if orchestrator.stuck(row):
                stuck[row.phase.value] = stuck.get(row.phase.value, 0) + 1
        oldest_s = max((now - row.created_at.timestamp() for row in active), default=0.0)
        self.metrics.set_migrations(in_flight, stuck, oldest_s)

    async def stop(self, grace_s: float = 2.0) -> None:
        led_to_the_end = self.leading and self._led
        if self.leadership is not None and self._elector_task is not None:
            self.leadership.elector.stop()  # on_lost, then the lease is released
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._elector_task, grace_s + 5.0)
        if self.scheduler is not None:
            self.scheduler.shutdown(wait=False)
        self.term.end()
        for t in self._tasks + self._leader_tasks:
            t.cancel()
        for conn in list(self.agents.connections.values()):
            conn.close(grpc.StatusCode.UNAVAILABLE,
                       f"controller {self.config.controller_id} is shutting down")
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.enrol_server is not None:
            await self.enrol_server.stop(grace_s)
        if self._ops is not None:
            await self._ops.stop()
        self.term.series.close()  # the open minutes, to the store and the learner
        if led_to_the_end:  # a follower's learner is stale: it must not overwrite the leader's
            self.persistence.store.set_settings(self.term.learner.snapshot())
        if self.leadership is not None:
            self.leadership.elector.close()
        self.persistence.close(self.fleet)


async def run_controller(config: ControllerConfig, *, ready_file: Path | None = None) -> None:
    raise_open_files_limit()  # one connection per agent host: thousands of descriptors
    controller = Controller(config)
    await controller.start()
    # The process's collector settings (not the Controller's: tests run several in one
    # process): no allocation-driven full collections stalling acks; see gc_policy.
    gc_policy = GcPolicy(controller.metrics.registry)
    gc_policy.install()
    gc_task = asyncio.create_task(gc_policy.run())
    lag_task = asyncio.create_task(LoopLagProbe(controller.metrics.registry).run())
    if ready_file is not None:
        ready_file.write_text(f"{controller.port} {controller.metrics_port or 0} "
                              f"{controller.enrol_port or 0}\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"gearshift controller listening on {config.listen.rpartition(':')[0]}:{controller.port}"
          + (f", metrics on :{controller.metrics_port}" if controller.metrics_port else ""),
          flush=True)
    await stop.wait()
    log.info("shutting down")
    gc_task.cancel()
    lag_task.cancel()
    gc_policy.uninstall()
    await controller.stop()


__all__ = ["HOUSEKEEPING_INTERVAL_S", "RECENT_HOST_S", "ROUTES_WARMUP_INTERVALS",
           "ROUTES_WARMUP_MIN_S", "Controller", "ControllerConfig", "run_controller"]
