"""ControlService RPCs that act: policies, decisions, pause/resume, migrations, revisions.

The fleet-reading RPCs live in `control_service`; `ControlService` there holds an
`ActionRpcs` and hands these calls to it. Errors are raised as `GearshiftError`s and mapped to statuses
by the interceptor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from google.protobuf import json_format
from grpc import aio

from gearshift.common.errors import FailedPrecondition, InvalidArgument, NotFound
from gearshift.common.json_values import finite_json
from gearshift.controller.store.tables import DecisionRow, PolicyVersionRow
from gearshift.policies.core import DecisionStatus
from gearshift.policies.loader import MAX_POLICY_BYTES, PolicyError, policy_mode
from gearshift.v1 import control_pb2

if TYPE_CHECKING:
    from gearshift.controller.decisions.policy_loop import PolicyLoop
    from gearshift.controller.decisions.store import DecisionStore
    from gearshift.controller.moves.orchestrator import MigrationOrchestrator
    from gearshift.controller.moves.store import MigrationRow, MigrationStepRow

log = logging.getLogger(__name__)

MAX_LIST = 1000


def _ts(target: Any, value: datetime | None) -> None:
    if value is not None:
        target.FromDatetime(value)



def policy_msg(row: PolicyVersionRow, active_version: int | None, mode: str = "") -> control_pb2.PolicyVersion:
    msg = control_pb2.PolicyVersion(
        version=row.version or 0, name=row.name, digest=row.digest, yaml_text=row.yaml_text,
        applied_by=row.applied_by, comment=row.comment, active=row.version == active_version,
        mode=mode)
    _ts(msg.applied_at, row.applied_at)
    return msg


def decision_msg(row: DecisionRow) -> control_pb2.Decision:
    msg = control_pb2.Decision(
        id=row.id, model=row.model, from_engine=row.from_engine, to_engine=row.to_engine,
        rule=row.rule, policy_version=row.policy_version or 0, mode=row.mode,
        status=DecisionStatus(row.status).value, status_reason=row.status_reason or "")
    json_format.ParseDict(finite_json(row.inputs), msg.inputs)
    json_format.ParseDict(finite_json(row.expected), msg.expected)
    json_format.ParseDict(finite_json(row.alternatives), msg.alternatives)
    for c in row.conditions:
        json_format.ParseDict(finite_json(c), msg.conditions.add(), ignore_unknown_fields=True)
    msg.reason = row.reason
    if row.trial_share is not None:
        msg.trial_share = row.trial_share
    _ts(msg.created_at, row.created_at)
    _ts(msg.updated_at, row.updated_at)
    return msg


def migration_msg(row: MigrationRow, steps: list[MigrationStepRow] | None = None) -> control_pb2.Migration:
    msg = control_pb2.Migration(
        id=row.id, decision_id=row.decision_id or "", model=row.model,
        from_engine=row.from_engine, to_engine=row.to_engine, kind=row.kind.value,
        trial_outcome=row.trial_outcome.value if row.trial_outcome else "",
        phase=str(row.phase.value), canary_step=row.canary_step, canary_steps=row.canary_steps,
        reason=row.reason, status_message=row.status_message,
        source_deployments=row.source_deployment_ids, target_deployments=row.target_deployment_ids,
        target_revision=row.target_revision or "")
    _ts(msg.created_at, row.created_at)
    _ts(msg.updated_at, row.updated_at)
    _ts(msg.finished_at, row.finished_at)
    for s in steps or []:
        step = msg.steps.add(from_phase=s.from_phase, to_phase=s.to_phase, message=s.message)
        _ts(step.at, s.at)
        json_format.ParseDict(finite_json(s.figures), step.figures)
    return msg


PublishRevision = Callable[[str, str, str], "tuple[MigrationRow | None, str]"]


class ActionRpcs:
    """The acting calls of `ControlService`, which holds one: given its collaborators at
    construction, and a new term's policy loop and orchestrator by `begin_term`."""

    def __init__(self, decisions: DecisionStore | None, policy_loop: PolicyLoop | None,
                 orchestrator: MigrationOrchestrator | None, set_paused: Callable[[bool], None],
                 publish_revision: PublishRevision | None) -> None:
        self._decisions = decisions
        self._policy_loop = policy_loop
        self.orchestrator = orchestrator
        self.set_paused = set_paused
        self._publish_revision = publish_revision

    def begin_term(self, decisions: DecisionStore, policy_loop: PolicyLoop,
                   orchestrator: MigrationOrchestrator) -> None:
        """A new term's decision store, policy loop and orchestrator
        (`ControlService.begin_term`)."""
        self._decisions = decisions
        self._policy_loop, self.orchestrator = policy_loop, orchestrator

    @property
    def decisions(self) -> DecisionStore:
        """The stored decisions and policy versions (read by a controller that runs a
        policy loop, as before: one without refuses these reads the same way)."""
        if self._decisions is None or self._policy_loop is None:
            raise FailedPrecondition("this controller runs no policy loop")
        return self._decisions

    @property
    def policy_loop(self) -> PolicyLoop:
        if self._policy_loop is None:
            raise FailedPrecondition("this controller runs no policy loop")
        return self._policy_loop

    def publish_revision(self, model: str, revision: str, source: str
                         ) -> tuple[MigrationRow | None, str]:
        if self._publish_revision is None:
            raise FailedPrecondition("this controller publishes no revisions")
        return self._publish_revision(model, revision, source)
    # mode by digest of the YAML text: a stored version never changes
    _modes: ClassVar[dict[str, str]] = {}

    # -- policies ---------------------------------------------------------------------

    def _policy_text(self, text: str) -> str:
        if len(text.encode()) > MAX_POLICY_BYTES:
            raise InvalidArgument(f"policy text is {len(text.encode())} bytes; at most "
                                  f"{MAX_POLICY_BYTES} are accepted")
        return text

    async def ValidatePolicy(self, request: control_pb2.ValidatePolicyRequest,
                             context: aio.ServicerContext) -> control_pb2.ValidatePolicyResponse:
        try:
            policy = self.policy_loop.policies.validate(self._policy_text(request.yaml_text), request.source,
                                               request.strict)
        except PolicyError as err:
            return control_pb2.ValidatePolicyResponse(valid=False, errors=list(err.problems))
        return control_pb2.ValidatePolicyResponse(valid=True, name=policy.name, digest=policy.digest,
                                                  warnings=list(policy.warnings))

    def _active_version(self) -> int | None:
        active = self.policy_loop.policies.active()
        return active[0] if active else None

    async def ApplyPolicy(self, request: control_pb2.ApplyPolicyRequest,
                          context: aio.ServicerContext) -> control_pb2.ApplyPolicyResponse:
        if request.restore_version and request.yaml_text:
            raise InvalidArgument("give either a policy text or restore_version, not both")
        warnings: list[str] = []
        if request.restore_version:
            row, changed = self.policy_loop.policies.restore(request.restore_version)
        elif request.yaml_text:
            row, changed, policy = self.policy_loop.policies.apply(
                self._policy_text(request.yaml_text), request.source, request.applied_by,
                request.comment, strict=request.strict)
            warnings = list(policy.warnings)
        else:
            raise InvalidArgument("nothing to apply: the policy text is empty")
        return control_pb2.ApplyPolicyResponse(
            policy=policy_msg(row, self._active_version(), self._mode(row)), changed=changed,
            warnings=warnings)

    def _mode(self, row: PolicyVersionRow) -> str:
        """The mode a stored version sets (cached by digest: versions never change)."""
        mode = self._modes.get(row.digest)
        if mode is None:
            mode = self._modes[row.digest] = policy_mode(row.yaml_text)
        return mode

    async def GetPolicy(self, request: control_pb2.GetPolicyRequest,
                        context: aio.ServicerContext) -> control_pb2.PolicyVersion:
        version = request.version or self._active_version()
        if version is None:
            raise NotFound("no policy has been applied yet (gearshift policy apply FILE)")
        row = self.decisions.get_policy_version(version)
        if row is None:
            raise NotFound(f"policy version {version} does not exist")
        return policy_msg(row, self._active_version(), self._mode(row))

    async def PolicyHistory(self, request: control_pb2.PolicyHistoryRequest,
                            context: aio.ServicerContext) -> control_pb2.PolicyHistoryResponse:
        active = self._active_version()
        return control_pb2.PolicyHistoryResponse(versions=[
            policy_msg(r, active, self._mode(r))
            for r in self.decisions.list_policy_versions()])

    # -- decisions --------------------------------------------------------------------

    async def ListDecisions(self, request: control_pb2.ListDecisionsRequest,
                            context: aio.ServicerContext) -> control_pb2.ListDecisionsResponse:
        status = None
        if request.status:
            try:
                status = DecisionStatus(request.status)
            except ValueError:
                raise InvalidArgument(
                    f"status: expected one of {', '.join(s.value for s in DecisionStatus)}, "
                    f"found {request.status!r}") from None
        rows = self.decisions.list_decisions(
            model=request.model or None, status=status, limit=min(request.limit or 100, MAX_LIST))
        return control_pb2.ListDecisionsResponse(decisions=[decision_msg(r) for r in rows])

    async def GetDecision(self, request: control_pb2.GetDecisionRequest,
                          context: aio.ServicerContext) -> control_pb2.Decision:
        row = self.decisions.get_decision(request.id)
        if row is None:
            raise NotFound(f"no decision {request.id!r}")
        return decision_msg(row)

    async def ApproveDecision(self, request: control_pb2.ReviewDecisionRequest,
                              context: aio.ServicerContext) -> control_pb2.Decision:
        return decision_msg(self.policy_loop.review.approve(request.id, request.reason, request.by))

    async def RejectDecision(self, request: control_pb2.ReviewDecisionRequest,
                             context: aio.ServicerContext) -> control_pb2.Decision:
        if not request.reason.strip():
            raise InvalidArgument("reason: a rejection needs a reason")
        return decision_msg(self.policy_loop.review.reject(request.id, request.reason, request.by))

    async def EvaluateNow(self, request: control_pb2.EvaluateNowRequest,
                          context: aio.ServicerContext) -> control_pb2.EvaluateNowResponse:
        if self.policy_loop.policies.active() is None:
            return control_pb2.EvaluateNowResponse(message="no active policy")
        ev = self.policy_loop.evaluate_explained()
        msg = "paused: nothing evaluated" if self.policy_loop.paused() else f"{len(ev.rows)} new decision(s)"
        resp = control_pb2.EvaluateNowResponse(decisions=[decision_msg(r) for r in ev.rows], message=msg)
        for nd in ev.no_decision:  # each other model's reason (policies.holds)
            held = resp.no_decision.add(model=nd.model, reason=nd.reason.value, detail=nd.detail)
            if nd.until is not None:
                held.until.FromNanoseconds(int(nd.until * 1e9))
        return resp

    async def SetPaused(self, request: control_pb2.SetPausedRequest,
                        context: aio.ServicerContext) -> control_pb2.SetPausedResponse:
        self.set_paused(request.paused)
        log.info("automation %s%s", "paused" if request.paused else "resumed",
                 f": {request.reason}" if request.reason else "")
        return control_pb2.SetPausedResponse(paused=request.paused)

    # -- migrations -------------------------------------------------------------------

    def _orch(self) -> MigrationOrchestrator:
        if self.orchestrator is None:
            raise FailedPrecondition("this controller runs no migration orchestrator")
        return self.orchestrator

    async def ListMigrations(self, request: control_pb2.ListMigrationsRequest,
                             context: aio.ServicerContext) -> control_pb2.ListMigrationsResponse:
        rows = self._orch().list(active_only=request.active_only)
        if request.model:
            rows = [r for r in rows if r.model == request.model]
        return control_pb2.ListMigrationsResponse(migrations=[migration_msg(r) for r in rows])

    async def GetMigration(self, request: control_pb2.GetMigrationRequest,
                           context: aio.ServicerContext) -> control_pb2.Migration:
        orch = self._orch()
        return migration_msg(orch.get(request.id), orch.steps(request.id))

    async def AbortMigration(self, request: control_pb2.AbortMigrationRequest,
                             context: aio.ServicerContext) -> control_pb2.Migration:
        if not request.reason.strip():
            raise InvalidArgument("reason: aborting a migration needs a reason")
        orch = self._orch()
        row = orch.abort(request.id, request.reason)
        return migration_msg(row, orch.steps(row.id))

    async def GetCapacity(self, request: control_pb2.GetCapacityRequest,
                          context: aio.ServicerContext) -> control_pb2.GetCapacityResponse:
        learner = self.policy_loop.learner
        models = learner.for_model(request.model) if learner is not None else []
        priors = self.policy_loop.policies.priors(request.model)
        if not models and request.model not in {m.model for m in self.policy_loop.fleet.models()}:
            raise NotFound(f"no model {request.model!r} in the fleet or in what was learned")
        return control_pb2.GetCapacityResponse(
            models_json=[json.dumps(m.to_dict()) for m in models],
            sla_ttft_p99_s=(priors.sla_ttft_p99_ms or 0.0) / 1000,
            sla_itl_p99_s=(priors.sla_itl_p99_ms or 0.0) / 1000,
            priors_json=priors.model_dump_json(by_alias=True, exclude_defaults=True))

    async def GetRateHistory(self, request: control_pb2.GetRateHistoryRequest,
                             context: aio.ServicerContext) -> control_pb2.GetRateHistoryResponse:
        history = self.policy_loop.history
        if request.model not in history.models():
            raise NotFound(f"no request-rate history for model {request.model!r}")
        ts, rps = history.arrays(request.model)
        return control_pb2.GetRateHistoryResponse(ts=ts.tolist(), rps=rps.tolist(),
                                                  resolution_s=history.resolution_s)

    async def PublishRevision(self, request: control_pb2.PublishRevisionRequest,
                              context: aio.ServicerContext) -> control_pb2.PublishRevisionResponse:
        if not request.model or not request.revision:
            raise InvalidArgument("model and revision are both required")
        row, message = self.publish_revision(request.model, request.revision, request.source)
        resp = control_pb2.PublishRevisionResponse(message=message)
        if row is not None:
            resp.migration.CopyFrom(migration_msg(row))
        return resp
