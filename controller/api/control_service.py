"""`ControlService`: the fleet as the CLI and the gateway see it.

It is the one servicer of the gRPC service, composed of collaborators it is given or
builds at construction: it answers the fleet-reading calls itself and hands the acting
calls (policies, decisions, pause, migrations, revisions) to `actions`
(`control_actions.ActionRpcs`) and the enrolment administration to `enrolment`
(`controller.enrolment.service.EnrolmentRpcs`), one delegating method per call.

Gateways' reports are checked and kept bounded (`gateway_reports.GatewayReports`): any holder of
a read token can call `ReportGateway`, so neither the number of gateway ids nor the
size of a report may grow the controller's memory.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
from grpc import aio

from gearshift.common.errors import GearshiftError
from gearshift.common.identity import LEADER_METADATA_KEY
from gearshift.controller.api.control_actions import ActionRpcs, PublishRevision
from gearshift.controller.api.paging import one_page, page_size, table_parts
from gearshift.controller.api.validation import MAX_DEPLOYMENTS_PER_REPORT
from gearshift.controller.enrolment.service import EnrolmentRpcs
from gearshift.controller.ha.leadership import Leadership
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.ingest.gateway_reports import MAX_GATEWAY_ID_CHARS, check_gateway_report
from gearshift.v1 import agent_pb2, control_pb2, control_pb2_grpc, enrol_pb2

if TYPE_CHECKING:
    from gearshift.controller.decisions.policy_loop import PolicyLoop
    from gearshift.controller.decisions.store import DecisionStore
    from gearshift.controller.enrolment.service import Revocations
    from gearshift.controller.enrolment.store import EnrolmentStore
    from gearshift.controller.moves.orchestrator import MigrationOrchestrator

log = logging.getLogger(__name__)


class ControlService(control_pb2_grpc.ControlServiceServicer):
    """The ControlService servicer (see the module docstring)."""

    def __init__(self, fleet: FleetState, *, controller_id: str, epoch: int, store_kind: str,
                 paused: Callable[[], bool] = lambda: False, routes_warmup_s: float = 0.0,
                 decisions: DecisionStore | None = None,
                 policy_loop: PolicyLoop | None = None,
                 orchestrator: MigrationOrchestrator | None = None,
                 set_paused: Callable[[bool], None] = lambda _paused: None,
                 publish_revision: PublishRevision | None = None,
                 enrolment_store: EnrolmentStore | None = None,
                 revocations: Revocations | None = None,
                 on_host_revoked: Callable[[str, str], None] | None = None,
                 leadership: Callable[[], Leadership | None] = lambda: None) -> None:
        self.fleet = fleet
        self.routes_warmup_s = routes_warmup_s
        self.expected_hosts: frozenset[str] = frozenset()  # hosts seen recently before this term
        self.controller_id = controller_id
        self.epoch = epoch
        self.store_kind = store_kind
        self._paused = paused
        self._leadership = leadership  # None: a controller that always leads
        self.lead_started = fleet.started  # when this controller's current term began
        self._route_streams: set[asyncio.Event] = set()
        self.actions = ActionRpcs(decisions, policy_loop, orchestrator, set_paused, publish_revision)
        self.enrolment = EnrolmentRpcs(enrolment_store, revocations, on_host_revoked)

    @property
    def leadership(self) -> Leadership | None:
        return self._leadership()

    def begin_term(self, *, epoch: int, fleet: FleetState, decisions: DecisionStore,
                   policy_loop: PolicyLoop,
                   orchestrator: MigrationOrchestrator, started: float,
                   expected_hosts: frozenset[str]) -> None:
        """A new term (or, before the first election, the parts that serve reads): its
        epoch, fleet state, policy loop and orchestrator; gateways get routes once the
        hosts seen recently before it (`expected_hosts`) have reported again."""
        self.epoch, self.fleet, self.lead_started = epoch, fleet, started
        self.actions.begin_term(decisions, policy_loop, orchestrator)
        self.expected_hosts = expected_hosts

    async def FleetStatus(self, request: control_pb2.FleetStatusRequest,
                          context: aio.ServicerContext) -> control_pb2.FleetStatusResponse:
        now = self.fleet.now()
        resp = control_pb2.FleetStatusResponse(
            controller_id=self.controller_id, epoch=self.epoch, store=self.store_kind,
            reports_total=self.fleet.reports_total, paused=self._paused())
        resp.started.FromSeconds(int(self.fleet.started))
        for entry in self.fleet.hosts.values():
            resp.hosts += 1
            state = entry.state(now)
            if state == control_pb2.HOST_STATE_CONNECTED:
                resp.hosts_connected += 1
            elif state == control_pb2.HOST_STATE_UNREACHABLE:
                resp.hosts_unreachable += 1
            resp.gpus += len(entry.gpus)
        models = set()
        for _host, dep, _ts in self.fleet.deployments():
            resp.deployments += 1
            models.add(dep.model)
            if dep.phase == agent_pb2.DEPLOYMENT_PHASE_READY:
                resp.deployments_ready += 1
                resp.request_rate += dep.request_rate
        resp.models = len(models)
        return resp

    async def ListHosts(self, request: control_pb2.ListHostsRequest,
                        context: aio.ServicerContext) -> control_pb2.ListHostsResponse:
        now = self.fleet.now()
        resp = control_pb2.ListHostsResponse()
        ids, resp.next_page_token = one_page(
            (((h,), h) for h in self.fleet.hosts),
            page_size(request.page_size, "ListHostsRequest"), request.page_token,
            "ListHostsRequest", size_of=lambda h: len(self.fleet.hosts[h].hello_bytes) + 512)
        for host_id in ids:
            e = self.fleet.hosts[host_id]
            hello = e.hello  # parsed from the kept bytes at each read: once per host
            h = resp.hosts.add(
                host_id=host_id, agent_version=hello.agent_version, state=e.state(now),
                deployments=len(e.deployments), emulated_gpus=hello.emulated_gpus,
                reports=e.reports)
            h.labels.update(hello.labels)
            h.gpus.extend(e.gpus)
            h.engines.extend(hello.engines)
            h.last_report.FromNanoseconds(int(e.last_report_ts * 1e9))
        return resp

    async def ListDeployments(self, request: control_pb2.ListDeploymentsRequest,
                              context: aio.ServicerContext) -> control_pb2.ListDeploymentsResponse:
        resp = control_pb2.ListDeploymentsResponse()
        rows, resp.next_page_token = one_page(
            (((dep.model, host_id, dep.deployment_id), (host_id, dep, ts))
             for host_id, dep, ts in self.fleet.deployments()
             if (not request.model or dep.model == request.model)
             and (not request.host_id or host_id == request.host_id)),
            page_size(request.page_size, "ListDeploymentsRequest"), request.page_token,
            "ListDeploymentsRequest", size_of=lambda row: row[1].ByteSize() + 64)
        for host_id, dep, ts in rows:
            d = resp.deployments.add(host_id=host_id, report=dep)
            d.updated.FromNanoseconds(int(ts * 1e9))
        return resp

    async def ListModels(self, request: control_pb2.ListModelsRequest,
                         context: aio.ServicerContext) -> control_pb2.ListModelsResponse:
        models, token = one_page(
            (((m.model,), m) for m in self.fleet.models()),
            page_size(request.page_size, "ListModelsRequest"), request.page_token,
            "ListModelsRequest")
        return control_pb2.ListModelsResponse(models=models, next_page_token=token)

    async def WatchRoutes(self, request: control_pb2.WatchRoutesRequest,
                          context: aio.ServicerContext) -> AsyncIterator[control_pb2.RoutingTable]:
        # A controller that has just started knows no deployment yet: sending its empty
        # table would make gateways forget routes that still work. Wait until the hosts
        # it knew before have reported again, or the warm-up ends (fail static).
        ended = asyncio.Event()  # set when this controller stops leading
        self._route_streams.add(ended)
        try:
            while self.fleet.now() < self.lead_started + self.routes_warmup_s \
                    and not ended.is_set() and not all(
                        h in self.fleet.hosts and self.fleet.hosts[h].reports > 0
                        for h in self.expected_hosts):
                await asyncio.sleep(0.2)
            fleet = self.fleet
            q = fleet.watch_routes()
            log.info("gateway %s watches routes", _shown_gateway(request.gateway_id))
            try:
                while not ended.is_set():
                    getter = asyncio.ensure_future(q.get())
                    stopper = asyncio.ensure_future(ended.wait())
                    done, pending = await asyncio.wait({getter, stopper},
                                                       return_when=asyncio.FIRST_COMPLETED)
                    for f in pending:
                        f.cancel()
                    if getter in done:
                        for part in table_parts(getter.result()):  # a large fleet's in parts
                            yield part
            except asyncio.CancelledError:
                return
            finally:
                fleet.unwatch_routes(q)
        finally:
            self._route_streams.discard(ended)
        if self.leadership is not None:
            details, leader = self.leadership.refusal()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, details,
                                ((LEADER_METADATA_KEY, leader),))

    def end_route_streams(self) -> None:
        """End every WatchRoutes stream (this controller stopped leading): gateways
        follow the refusal to the new leader and keep their tables meanwhile."""
        for ended in list(self._route_streams):
            ended.set()

    async def ControllerStatus(self, request: control_pb2.ControllerStatusRequest,
                               context: aio.ServicerContext,
                               ) -> control_pb2.ControllerStatusResponse:
        resp = control_pb2.ControllerStatusResponse(
            controller_id=self.controller_id, store=self.store_kind, epoch=self.epoch)
        ld = self.leadership
        if ld is None:
            resp.leader, resp.leader_id = True, self.controller_id
            return resp
        resp.address, resp.ha, resp.lease_ttl_s = ld.address, ld.ha, ld.ttl_s
        resp.leader = ld.leading
        try:
            state = await asyncio.to_thread(ld.elector.current)
        except GearshiftError as err:
            resp.error = err.message
            state = ld.lease()
        if state is None:
            return resp
        if state.live:
            resp.leader_id, resp.leader_address = state.holder or "", state.address or ""
        resp.epoch = state.epoch
        for field, value in (("lease_age_s", state.lease_age_s),
                             ("lease_expires_in_s", state.expires_in_s),
                             ("leader_for_s", state.leader_for_s)):
            if value is not None and math.isfinite(value):
                setattr(resp, field, value)
        return resp

    async def ReportGateway(self, request: control_pb2.GatewayReport,
                            context: aio.ServicerContext) -> control_pb2.GatewayReportAck:
        fleet = self.fleet
        # A gateway routes only to deployments its hosts reported, each at most
        # MAX_DEPLOYMENTS_PER_REPORT of them.
        check_gateway_report(request, MAX_DEPLOYMENTS_PER_REPORT * max(1, len(fleet.hosts)))
        fleet.gateway_stats.record(request, fleet.routed_deployment_ids(), fleet.now())
        return control_pb2.GatewayReportAck()

    # -- acting calls: `actions` ------------------------------------------------------

    async def ValidatePolicy(self, request: control_pb2.ValidatePolicyRequest,
                             context: aio.ServicerContext) -> control_pb2.ValidatePolicyResponse:
        return await self.actions.ValidatePolicy(request, context)

    async def ApplyPolicy(self, request: control_pb2.ApplyPolicyRequest,
                          context: aio.ServicerContext) -> control_pb2.ApplyPolicyResponse:
        return await self.actions.ApplyPolicy(request, context)

    async def GetPolicy(self, request: control_pb2.GetPolicyRequest,
                        context: aio.ServicerContext) -> control_pb2.PolicyVersion:
        return await self.actions.GetPolicy(request, context)

    async def PolicyHistory(self, request: control_pb2.PolicyHistoryRequest,
                            context: aio.ServicerContext) -> control_pb2.PolicyHistoryResponse:
        return await self.actions.PolicyHistory(request, context)

    async def ListDecisions(self, request: control_pb2.ListDecisionsRequest,
                            context: aio.ServicerContext) -> control_pb2.ListDecisionsResponse:
        return await self.actions.ListDecisions(request, context)

    async def GetDecision(self, request: control_pb2.GetDecisionRequest,
                          context: aio.ServicerContext) -> control_pb2.Decision:
        return await self.actions.GetDecision(request, context)

    async def ApproveDecision(self, request: control_pb2.ReviewDecisionRequest,
                              context: aio.ServicerContext) -> control_pb2.Decision:
        return await self.actions.ApproveDecision(request, context)

    async def RejectDecision(self, request: control_pb2.ReviewDecisionRequest,
                             context: aio.ServicerContext) -> control_pb2.Decision:
        return await self.actions.RejectDecision(request, context)

    async def EvaluateNow(self, request: control_pb2.EvaluateNowRequest,
                          context: aio.ServicerContext) -> control_pb2.EvaluateNowResponse:
        return await self.actions.EvaluateNow(request, context)

    async def SetPaused(self, request: control_pb2.SetPausedRequest,
                        context: aio.ServicerContext) -> control_pb2.SetPausedResponse:
        return await self.actions.SetPaused(request, context)

    async def ListMigrations(self, request: control_pb2.ListMigrationsRequest,
                             context: aio.ServicerContext) -> control_pb2.ListMigrationsResponse:
        return await self.actions.ListMigrations(request, context)

    async def GetMigration(self, request: control_pb2.GetMigrationRequest,
                           context: aio.ServicerContext) -> control_pb2.Migration:
        return await self.actions.GetMigration(request, context)

    async def AbortMigration(self, request: control_pb2.AbortMigrationRequest,
                             context: aio.ServicerContext) -> control_pb2.Migration:
        return await self.actions.AbortMigration(request, context)

    async def GetCapacity(self, request: control_pb2.GetCapacityRequest,
                          context: aio.ServicerContext) -> control_pb2.GetCapacityResponse:
        return await self.actions.GetCapacity(request, context)

    async def GetRateHistory(self, request: control_pb2.GetRateHistoryRequest,
                             context: aio.ServicerContext) -> control_pb2.GetRateHistoryResponse:
        return await self.actions.GetRateHistory(request, context)

    async def PublishRevision(self, request: control_pb2.PublishRevisionRequest,
                              context: aio.ServicerContext) -> control_pb2.PublishRevisionResponse:
        return await self.actions.PublishRevision(request, context)

    # -- enrolment administration: `enrolment` ----------------------------------------

    async def CreateBootstrapToken(self, request: enrol_pb2.CreateBootstrapTokenRequest,
                                   context: aio.ServicerContext,
                                   ) -> enrol_pb2.CreateBootstrapTokenResponse:
        return await self.enrolment.CreateBootstrapToken(request, context)

    async def ListBootstrapTokens(self, request: enrol_pb2.ListBootstrapTokensRequest,
                                  context: aio.ServicerContext,
                                  ) -> enrol_pb2.ListBootstrapTokensResponse:
        return await self.enrolment.ListBootstrapTokens(request, context)

    async def RevokeBootstrapToken(self, request: enrol_pb2.RevokeBootstrapTokenRequest,
                                   context: aio.ServicerContext) -> enrol_pb2.BootstrapToken:
        return await self.enrolment.RevokeBootstrapToken(request, context)

    async def ListEnrolments(self, request: enrol_pb2.ListEnrolmentsRequest,
                             context: aio.ServicerContext) -> enrol_pb2.ListEnrolmentsResponse:
        return await self.enrolment.ListEnrolments(request, context)

    async def ApproveHost(self, request: enrol_pb2.HostActionRequest,
                          context: aio.ServicerContext) -> enrol_pb2.HostEnrolment:
        return await self.enrolment.ApproveHost(request, context)

    async def RevokeHost(self, request: enrol_pb2.HostActionRequest,
                         context: aio.ServicerContext) -> enrol_pb2.HostEnrolment:
        return await self.enrolment.RevokeHost(request, context)

    async def ResetHost(self, request: enrol_pb2.HostActionRequest,
                        context: aio.ServicerContext) -> enrol_pb2.HostEnrolment:
        return await self.enrolment.ResetHost(request, context)


def _shown_gateway(gateway_id: str) -> str:
    """A gateway's id as logged: any caller chooses it, so never long or with control
    characters."""
    if not gateway_id:
        return "(anonymous)"
    if len(gateway_id) <= MAX_GATEWAY_ID_CHARS and gateway_id.isprintable():
        return gateway_id
    return repr(gateway_id[:MAX_GATEWAY_ID_CHARS])
