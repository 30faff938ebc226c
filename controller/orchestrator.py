"""The migration orchestrator (DESIGN §8): a durable, level-triggered state machine per move.

Each `tick()` re-reads the stored migrations and the in-memory fleet and takes at
most the next step of each active move; every transition is persisted (with a
step-log entry) before the next tick may take another, so a controller that
restarts anywhere resumes from the stored phase. The orchestrator does no I/O
of its own besides its repository: commands go out through the injected
`send_command(host_id, Command) -> bool`, with deterministic ids
(``<migration id>:<action>:<subject>``) and the controller's fencing epoch, so
a command re-sent after a reconnect or a restart is a no-op at the agent.

Capacity (see `placement`): each source replica gets one target replica. A
target surges onto a host with enough free GPUs (inventory minus the GPUs of
the host's deployments and of other moves' planned targets). When none is
free it *replaces* a source replica on the source's own GPUs: the source is
drained and stopped first, then the target starts there. At most
``sources - min_available`` replicas are replaced before the canary ("early");
the rest ("late") are replaced one by one while draining, after promotion, so
at least `min_available` source replicas serve until the target has proven
itself. With no early target possible the move waits in `pending`.

Fail static: a host that is unknown or unreachable pauses the move (the reason
is in `status_message`); nothing is drained or rolled back because of it.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gearshift.agents.runtimes.spec import ENGINES
from gearshift.controller.canary import Sla, analyze
from gearshift.controller.errors import FailedPrecondition, InvalidArgument, NotFound
from gearshift.controller.fleet import FleetState
from gearshift.controller.migration_store import (
    FINAL_COMMAND_PHASES,
    MigrationCommandRow,
    MigrationPhase,
    MigrationRepository,
    MigrationRow,
    MigrationStepRow,
)
from gearshift.controller.placement import Paused, fleet_view, place_targets, source_spec
from gearshift.v1 import agent_pb2, control_pb2

log = logging.getLogger(__name__)

P = MigrationPhase
# engine_switch: move a model; revision_rollout: new weights on the same engine;
# trial: run the other engine on a bounded share of traffic to measure it, then
# restore the source whatever the result (the measurement is what it is for).
KINDS = ("engine_switch", "revision_rollout", "trial")
TRIAL_COMPLETE = "trial complete"
FAILED_COMMAND_PHASES = frozenset({"failed", "rejected"})
READY = agent_pb2.DEPLOYMENT_PHASE_READY
BROKEN_PHASES = {agent_pb2.DEPLOYMENT_PHASE_UNHEALTHY: "unhealthy",
                 agent_pb2.DEPLOYMENT_PHASE_RESTARTING: "restarting after a crash",
                 agent_pb2.DEPLOYMENT_PHASE_FAILED: "failed",
                 agent_pb2.DEPLOYMENT_PHASE_STOPPED: "stopped",
                 agent_pb2.DEPLOYMENT_PHASE_DRAINING: "draining"}

SendCommand = Callable[[str, agent_pb2.Command], bool]
OnTransition = Callable[[MigrationRow, MigrationPhase, MigrationPhase, str], None]


def _no_sla(_model: str) -> Sla:
    return Sla()


@dataclass(frozen=True)
class OrchestratorSettings:
    """How cautious a move is. Intervals count agent report intervals."""

    canary_steps: tuple[float, ...] = (0.1, 0.25, 0.5)  # target traffic share per step
    analysis_intervals: int = 3  # good intervals needed per canary step
    warm_intervals: int = 2  # intervals a ready target is watched before any traffic
    max_failed_checks: int = 2  # failed analyses (over the whole canary) before rolling back
    tolerance: float = 0.2  # candidate latency may exceed the baseline by this fraction
    sla_for: Callable[[str], Sla] = field(default=_no_sla)  # model -> its SLA
    command_timeout_s: float = 600.0  # starting targets / restoring sources must finish within
    build_timeout_s: float = 3600.0  # TensorRT engine builds must finish within
    drain_grace_s: float = 30.0  # in-flight requests get this long when a replica leaves
    command_resend_s: float = 30.0  # an unanswered command is re-sent (same id) after this
    min_available: int = 1  # source replicas kept serving until the target is promoted
    gpus_per_replica: int | None = None  # None: as many as the source replica uses
    trtllm_backend: str = "pytorch"  # "tensorrt" adds an engine build (phase building)

    def __post_init__(self) -> None:
        steps = self.canary_steps
        if not steps or any(not 0.0 < s < 1.0 for s in steps) or list(steps) != sorted(
                set(steps)):
            raise InvalidArgument(f"orchestrator: canary_steps {list(steps)} must be increasing "
                                  "traffic shares strictly between 0 and 1")
        for name in ("analysis_intervals", "warm_intervals", "max_failed_checks"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"orchestrator: {name} must be >= 1, "
                                      f"got {getattr(self, name)}")
        if self.min_available < 0 or (self.gpus_per_replica or 0) < 0:
            raise InvalidArgument("orchestrator: min_available and gpus_per_replica must be >= 0")
        if self.trtllm_backend not in ("pytorch", "tensorrt"):
            raise InvalidArgument(f"orchestrator: trtllm_backend {self.trtllm_backend!r} is not "
                                  "one of pytorch, tensorrt")


def _phase_name(value: int) -> str:
    return agent_pb2.CommandPhase.Name(value).removeprefix("COMMAND_PHASE_").lower()  # type: ignore[arg-type]


class MigrationOrchestrator:
    """Runs every migration of the controller; see the module docstring."""

    def __init__(self, repo: MigrationRepository, fleet: FleetState, send_command: SendCommand,
                 *, epoch: int, clock: Callable[[], float] = time.time,
                 settings: OrchestratorSettings | None = None,
                 on_transition: OnTransition | None = None) -> None:
        self._repo = repo
        self._fleet = fleet
        self._send_command = send_command
        self._epoch = epoch
        self._clock = clock
        self.settings = settings or OrchestratorSettings()
        self._on_transition = on_transition
        self._active: dict[str, MigrationRow] = {}
        self._route_key: dict[str, tuple[str, int]] = {}
        self._reload_active()

    # -- public API ---------------------------------------------------------------------

    def create(self, model: str, from_engine: str, to_engine: str, *,
               decision_id: str | None = None, kind: str = "engine_switch",
               target_revision: str | None = None, trial_share: float | None = None) -> MigrationRow:
        """Start moving `model`; refuses a second active move of the same model."""
        if kind not in KINDS:
            raise InvalidArgument(f"migration kind {kind!r} is not one of {', '.join(KINDS)}")
        for what, engine in (("from_engine", from_engine), ("to_engine", to_engine)):
            if engine not in ENGINES:
                raise InvalidArgument(f"migration {what} {engine!r} is not one of "
                                      f"{', '.join(ENGINES)}")
        if kind in ("engine_switch", "trial") and from_engine == to_engine:
            raise InvalidArgument(f"migration of {model!r}: from_engine and to_engine are both "
                                  f"{from_engine!r}; an engine switch needs two engines")
        if kind == "revision_rollout" and not target_revision:
            raise InvalidArgument(f"migration of {model!r}: a revision_rollout needs a "
                                  "target_revision")
        active = self._repo.rows(active_only=True, model=model)
        if active:
            raise FailedPrecondition(f"model {model!r} already has an active migration "
                                     f"{active[0].id} ({active[0].phase.value})")
        sources = [(h, d) for h, d, _ts in self._fleet.deployments_of(model)
                   if d.engine == from_engine and d.phase == READY
                   and (kind == "engine_switch" or d.revision != target_revision)]
        if not sources:
            raise InvalidArgument(f"model {model!r} has no ready deployment on {from_engine}"
                                  + (f" with a revision other than {target_revision!r}"
                                     if kind == "revision_rollout" else ""))
        sources.sort(key=lambda hd: hd[1].deployment_id)
        now = self._now()
        row = MigrationRow(
            decision_id=decision_id, model=model, kind=kind, from_engine=from_engine,
            to_engine=to_engine, target_revision=target_revision,
            canary_steps=[trial_share or self.settings.canary_steps[0]] if kind == "trial"
            else list(self.settings.canary_steps),
            source_deployment_ids=[d.deployment_id for _h, d in sources],
            source_specs=[source_spec(h, d, self.settings.drain_grace_s) for h, d in sources],
            phase_entered_at=now, created_at=now, updated_at=now, finished_at=None)
        target = target_revision if kind == "revision_rollout" else to_engine
        self._repo.add(row, f"created: {model} {from_engine} -> {target} over {len(sources)} "
                            "source replica(s)" + (f" for decision {decision_id}"
                                                   if decision_id else ""))
        self._reload_active()
        return row

    def abort(self, migration_id: str, reason: str) -> MigrationRow:
        """A person aborts a move: it rolls back first, then ends as `aborted`."""
        row = self.get(migration_id)
        if not row.phase.active:
            raise FailedPrecondition(f"migration {migration_id} is already {row.phase.value}")
        if not row.abort_requested:
            row.abort_requested = True
            why = f"aborted: {reason or 'no reason given'}"
            row.reason = f"{row.reason}; {why}" if row.reason else why
            if row.phase is P.ROLLING_BACK:
                self._save(row, note=why)
            else:
                self._go(row, P.ROLLING_BACK, why)
        self._reload_active()
        return row

    def get(self, migration_id: str) -> MigrationRow:
        row = self._repo.get(migration_id)
        if row is None:
            raise NotFound(f"migration {migration_id!r} not found")
        return row

    def steps(self, migration_id: str) -> builtins.list[MigrationStepRow]:
        """The step log, oldest first (what `gearshift migrations show` prints)."""
        self.get(migration_id)
        return self._repo.steps(migration_id)

    def on_command_result(self, host_id: str, result: agent_pb2.CommandResult) -> bool:
        """Record an agent's answer; False when the command was not a migration's."""
        phase = _phase_name(result.phase)
        row = self._repo.update_command(result.command_id, phase, result.message, self._now())
        if row is None:
            return False
        if phase in FAILED_COMMAND_PHASES:
            log.warning("migration command %s on %s %s: %s", result.command_id, host_id, phase,
                        result.message)
        return True

    def tick(self) -> None:
        """Take at most the next step of every active migration (level-triggered)."""
        for row in self._repo.rows(active_only=True):
            try:
                self._step(row)
            except Paused as paused:
                if row.status_message != paused.message:
                    row.status_message = paused.message
                    self._save(row)
            except Exception as exc:  # recorded; the next tick retries from stored state
                log.exception("migration %s: step failed", row.id)
                fresh = self._repo.get(row.id)
                if fresh is not None:
                    fresh.status_message = f"step failed, will retry: {exc}"
                    self._save(fresh)
        self._reload_active()

    def route_override(self, model: str, endpoints: builtins.list[Any]) -> builtins.list[Any]:
        """Weights and `leaving` flags for a model under migration (install as
        `fleet.route_override`). Endpoints that are not targets count as the source side."""
        row = self._active.get(model)
        if row is None:
            return endpoints
        targets = set(row.target_deployment_ids)
        if row.phase is P.ROLLING_BACK:
            for e in endpoints:
                if e.deployment_id in targets:
                    e.leaving, e.weight = True, 0.0
            return endpoints
        retiring = set(row.source_deployment_ids) if row.phase is P.DRAINING else {
            t["replaces"] for t in row.target_specs if t["replaces"] and not t["late"]}
        share = {P.CANARY: row.canary_steps[min(row.canary_step, len(row.canary_steps) - 1)],
                 P.PROMOTING: 1.0, P.DRAINING: 1.0}.get(row.phase, 0.0)
        for e in endpoints:
            if e.deployment_id in retiring:
                e.leaving = True
        cands = [e for e in endpoints if e.deployment_id in targets and not e.leaving]
        others = [e for e in endpoints if e.deployment_id not in targets and not e.leaving]
        if not cands:
            share = 0.0
        elif not others:
            share = 1.0
        for e in cands:
            e.weight = share / len(cands)
        for e in others:
            e.weight = (1.0 - share) / len(others)
        return endpoints

    def install(self) -> None:
        """Install `route_override` on the fleet and recompute the routing table now."""
        self._fleet.route_override = self.route_override
        self._fleet.refresh_routes()

    def list(self, active_only: bool = False) -> builtins.list[MigrationRow]:
        """Newest first."""
        return self._repo.rows(active_only=active_only)

    # -- bookkeeping --------------------------------------------------------------------

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self._clock(), UTC)

    def _reload_active(self) -> None:
        self._active = {r.model: r for r in self._repo.rows(active_only=True)}
        key = {m: (r.phase.value, r.canary_step) for m, r in self._active.items()}
        if key != self._route_key:
            self._route_key = key
            self._fleet.refresh_routes()

    def _save(self, row: MigrationRow, note: str | None = None,
              figures: dict[str, Any] | None = None) -> None:
        row.updated_at = self._now()
        step = None if note is None else MigrationStepRow(
            migration_id=row.id, at=row.updated_at, from_phase=row.phase.value,
            to_phase=row.phase.value, message=note, figures=figures or {})
        self._repo.save(row, step=step)

    def _go(self, row: MigrationRow, to: MigrationPhase, message: str,
            figures: dict[str, Any] | None = None) -> None:
        """Persist a transition and its step-log entry (one transaction)."""
        before = row.phase
        now = self._now()
        row.phase, row.phase_entered_at, row.updated_at = to, now, now
        row.healthy_intervals = 0
        row.status_message = ""
        if to is P.ROLLING_BACK and not row.reason:
            row.reason = message
        if not to.active:
            row.finished_at = now
        self._repo.save(row, step=MigrationStepRow(
            migration_id=row.id, at=now, from_phase=before.value, to_phase=to.value,
            message=message, figures=figures or {}))
        log.info("migration %s (%s): %s -> %s: %s", row.id, row.model, before.value, to.value,
                 message)
        if self._on_transition is not None:
            try:
                self._on_transition(row, before, to, message)
            except Exception:  # a hook must not break the state machine
                log.exception("migration %s: on_transition hook failed", row.id)

    def _elapsed_s(self, row: MigrationRow) -> float:
        return self._clock() - row.phase_entered_at.timestamp()

    # -- fleet and commands -------------------------------------------------------------

    def _host(self, host_id: str) -> Any:
        """The host's fleet entry; pauses the move when it is unknown or unreachable."""
        entry = self._fleet.hosts.get(host_id)
        if entry is None or self._fleet.host_state(host_id) != control_pb2.HOST_STATE_CONNECTED:
            raise Paused(f"paused: host {host_id} is unreachable or not reporting")
        return entry

    def _dep(self, host_id: str, dep_id: str) -> agent_pb2.DeploymentReport | None:
        dep: agent_pb2.DeploymentReport | None = self._host(host_id).deployments.get(dep_id)
        return dep

    def _send(self, row: MigrationRow, cmds: dict[str, MigrationCommandRow], action: str,
              subject: str, host_id: str, command: agent_pb2.Command) -> MigrationCommandRow:
        """Send once (re-send the same id while unanswered); returns the recorded command."""
        cid = f"{row.id}:{action}:{subject}"
        known = cmds.get(cid)
        if known is not None and (known.phase != "sent" or self._clock()
                                  - known.sent_at.timestamp() < self.settings.command_resend_s):
            return known
        self._host(host_id)
        command.command_id, command.epoch = cid, self._epoch
        if not self._send_command(host_id, command):
            raise Paused(f"paused: host {host_id} is not connected; {action} {subject} not sent")
        now = self._now()
        sent = MigrationCommandRow(command_id=cid, migration_id=row.id, host_id=host_id,
                                   kind=action, sent_at=now, updated_at=now)
        self._repo.record_command(sent)
        cmds[cid] = known or sent
        return cmds[cid]

    def _retire(self, row: MigrationRow, cmds: dict[str, MigrationCommandRow], dep_id: str,
                host_id: str, start_id: str | None = None) -> bool:
        """Drain then stop a deployment; True once the host no longer reports it (and, when
        this move sent `start_id` for it, once a stop made sure it cannot come up later)."""
        dep = self._dep(host_id, dep_id)
        stop = cmds.get(f"{row.id}:stop:{dep_id}")
        if dep is None:
            if start_id not in cmds or (stop is not None and stop.phase in FINAL_COMMAND_PHASES):
                return True
            # A start may still be in flight at the agent: stop it so it cannot come up later.
            self._send(row, cmds, "stop", dep_id, host_id, agent_pb2.Command(
                stop=agent_pb2.StopDeployment(deployment_id=dep_id, grace_s=0.0)))
            return False
        grace = self.settings.drain_grace_s
        drain = cmds.get(f"{row.id}:drain:{dep_id}")
        drained = dep.phase in (agent_pb2.DEPLOYMENT_PHASE_STOPPED, agent_pb2.DEPLOYMENT_PHASE_FAILED)
        if not drained and (drain is None or drain.phase not in FINAL_COMMAND_PHASES) and (
                drain is None or self._clock() - drain.sent_at.timestamp()
                < grace + self.settings.command_timeout_s):
            self._send(row, cmds, "drain", dep_id, host_id, agent_pb2.Command(
                drain=agent_pb2.DrainDeployment(deployment_id=dep_id, grace_s=grace)))
            return False
        self._send(row, cmds, "stop", dep_id, host_id, agent_pb2.Command(
            stop=agent_pb2.StopDeployment(deployment_id=dep_id, grace_s=grace)))
        return False

    def _start(self, row: MigrationRow, cmds: dict[str, MigrationCommandRow], action: str,
               subject: str, host_id: str, spec: dict[str, Any]) -> agent_pb2.DeploymentReport | None:
        """Start a deployment (once); returns its report when READY. A failed start raises."""
        cid = f"{row.id}:{action}:{subject}"
        known = cmds.get(cid)
        if known is not None and known.phase in FAILED_COMMAND_PHASES:
            raise _Failed(f"{action} of {spec['deployment_id']} on {host_id} {known.phase}: "
                          f"{known.message}")
        dep = self._dep(host_id, spec["deployment_id"])
        if dep is not None and dep.phase == READY:
            return dep
        if dep is not None and dep.phase == agent_pb2.DEPLOYMENT_PHASE_FAILED:
            raise _Failed(f"{spec['deployment_id']} failed on {host_id}: {dep.message}")
        self._send(row, cmds, action, subject, host_id, agent_pb2.Command(
            start=agent_pb2.StartDeployment(spec=_spec_proto(spec))))
        return None

    # -- the state machine --------------------------------------------------------------

    def _step(self, row: MigrationRow) -> None:
        handler = {P.PENDING: self._pending, P.BUILDING: self._building,
                   P.STARTING: self._starting, P.WARMING: self._watch,
                   P.CANARY: self._watch, P.PROMOTING: self._watch,
                   P.DRAINING: self._draining, P.ROLLING_BACK: self._rolling_back}[row.phase]
        try:
            handler(row)
        except _Failed as failed:
            self._go(row, P.ROLLING_BACK, failed.message)

    def _pending(self, row: MigrationRow) -> None:
        targets = place_targets(row, fleet_view(self._fleet, row, self._repo.rows(active_only=True)),
                                self.settings)
        row.target_specs = targets
        row.target_deployment_ids = [t["spec"]["deployment_id"] for t in targets]
        summary = ", ".join(
            f"{t['spec']['deployment_id']} on {t['host_id']} "
            + (f"replacing {t['replaces']}" + (" (late)" if t["late"] else "")
               if t["replaces"] else "surge") for t in targets)
        build = row.to_engine == "tensorrt-llm" and self.settings.trtllm_backend == "tensorrt"
        self._go(row, P.BUILDING if build else P.STARTING, f"placed: {summary}")

    def _building(self, row: MigrationRow) -> None:
        cmds = self._repo.commands(row.id)
        by_host = {t["host_id"]: t["spec"] for t in reversed(row.target_specs)}
        done = True
        for host_id in sorted(by_host):
            known = self._send(row, cmds, "build", host_id, host_id, agent_pb2.Command(
                build=agent_pb2.BuildEngine(spec=_spec_proto(by_host[host_id]))))
            if known.phase in FAILED_COMMAND_PHASES:
                raise _Failed(f"engine build on {host_id} {known.phase}: {known.message}")
            done = done and known.phase == "succeeded"
        if done:
            self._go(row, P.STARTING, f"engine built on {', '.join(sorted(by_host))}")
        elif self._elapsed_s(row) > self.settings.build_timeout_s:
            raise _Failed(f"engine build did not finish within {self.settings.build_timeout_s:.0f} s")

    def _starting(self, row: MigrationRow) -> None:
        cmds = self._repo.commands(row.id)
        ready: dict[str, agent_pb2.DeploymentReport] = {}
        for t in row.target_specs:
            if t["late"]:
                continue
            host = t["host_id"]
            if t["replaces"] and not self._retire(row, cmds, t["replaces"], host):
                continue
            dep = self._start(row, cmds, "start", str(t["replica"]), host, t["spec"])
            if dep is not None:
                ready[dep.deployment_id] = dep
        early = [t for t in row.target_specs if not t["late"]]
        if len(ready) == len(early):
            row.target_restarts = {i: d.restarts for i, d in ready.items()}
            self._go(row, P.WARMING, f"{len(ready)} target replica(s) ready; warming "
                                     f"for {self.settings.warm_intervals} interval(s)")
        elif self._elapsed_s(row) > self.settings.command_timeout_s:
            raise _Failed(f"target replicas not ready within {self.settings.command_timeout_s:.0f} s"
                          f" ({len(ready)} of {len(early)} ready)")

    def _candidates(self, row: MigrationRow, include_late: bool = False
                    ) -> builtins.list[tuple[str, agent_pb2.DeploymentReport]]:
        """The running targets; a missing, crashed or unhealthy one fails the move."""
        out = []
        for t in row.target_specs:
            if t["late"] and not include_late:
                continue
            dep_id, host = t["spec"]["deployment_id"], t["host_id"]
            dep = self._dep(host, dep_id)
            if dep is None:
                raise _Failed(f"target {dep_id} disappeared from host {host}")
            if dep.phase in BROKEN_PHASES:
                raise _Failed(f"target {dep_id} on {host} is {BROKEN_PHASES[dep.phase]}"
                              + (f": {dep.message}" if dep.message else ""))
            before = row.target_restarts.get(dep_id, dep.restarts)
            if dep.restarts > before:
                raise _Failed(f"target {dep_id} on {host} crashed (restarts {before} -> "
                              f"{dep.restarts})")
            out.append((host, dep))
        return out

    def _fresh_interval(self, row: MigrationRow, deps: builtins.list[tuple[str, Any]]) -> bool:
        """True (and marked) once every candidate reported since the last counted interval."""
        stamps = [self._fleet.hosts[h].deployment_ts.get(d.deployment_id, 0.0) for h, d in deps]
        if not stamps or (row.observed_report_s is not None
                          and min(stamps) <= row.observed_report_s):
            return False
        row.observed_report_s = max(stamps)
        return True

    def _watch(self, row: MigrationRow) -> None:
        """Warming, canary and promoting: the candidate is watched interval by interval."""
        cands = self._candidates(row)
        if not self._fresh_interval(row, cands):
            return
        s = self.settings
        if row.phase is P.WARMING:
            row.healthy_intervals += 1
            if row.healthy_intervals < s.warm_intervals:
                self._save(row)
                return
            row.canary_step = 0
            row.error_marks = {d.deployment_id: d.errors_total for _h, d in cands}
            self._go(row, P.CANARY, self._step_note(row))
            return
        if row.phase is P.PROMOTING:
            self._go(row, P.DRAINING, "target served all traffic for one interval; draining "
                                      f"{len(row.source_deployment_ids)} source replica(s)")
            return
        self._analyze(row, cands)

    def _step_note(self, row: MigrationRow) -> str:
        share = row.canary_steps[row.canary_step]
        return f"canary step {row.canary_step + 1}/{len(row.canary_steps)}: target takes {share:.0%}"

    def _analyze(self, row: MigrationRow, cands: builtins.list[tuple[str, Any]]) -> None:
        s = self.settings
        sources = set(row.source_deployment_ids)
        baseline = [d for _h, d, _ts in self._fleet.deployments_of(row.model)
                    if d.deployment_id in sources and d.phase == READY]
        interval = max(self._fleet.hosts[h].interval_s for h, _d in cands)
        verdict = analyze([d for _h, d in cands], baseline, s.sla_for(row.model), s.tolerance,
                          errors_before=row.error_marks, interval_s=interval)
        row.error_marks = {d.deployment_id: d.errors_total for _h, d in cands}
        where = f"canary step {row.canary_step + 1}/{len(row.canary_steps)}"
        figures = {**verdict.figures, "step": row.canary_step + 1,
                   "share": row.canary_steps[row.canary_step]}
        row.last_figures = figures
        if verdict.outcome == "no_data":
            row.no_data_intervals += 1
            note = f"{where} paused: no data ({verdict.reasons[0]})"
            first = row.status_message != note
            row.status_message = note
            self._save(row, note if first else None, figures)
        elif verdict.outcome == "fail":
            row.failed_checks += 1
            msg = (f"{where}: failed check {row.failed_checks}/{s.max_failed_checks}: "
                   + "; ".join(verdict.reasons))
            if row.failed_checks >= s.max_failed_checks:
                self._go(row, P.ROLLING_BACK, msg, figures)
            else:
                self._save(row, msg, figures)
        else:
            row.healthy_intervals += 1
            row.status_message = ""
            if row.healthy_intervals < s.analysis_intervals:
                self._save(row)
            elif row.canary_step + 1 < len(row.canary_steps):
                row.canary_step += 1
                row.healthy_intervals = 0
                self._save(row, self._step_note(row), figures)
            elif row.kind == "trial":
                row.reason = (f"{TRIAL_COMPLETE}: {row.to_engine} served "
                              f"{row.canary_steps[-1]:.0%} of traffic within the SLA for "
                              f"{s.analysis_intervals} interval(s)")
                self._go(row, P.ROLLING_BACK, row.reason, figures)
            else:
                self._go(row, P.PROMOTING, f"{where} passed; target takes all traffic", figures)

    def _draining(self, row: MigrationRow) -> None:
        # After promotion the target is what serves: a crash now is ridden out (its agent
        # restarts it) rather than rolled back, since the source is already leaving.
        for t in row.target_specs:
            if t["late"]:
                continue
            dep = self._dep(t["host_id"], t["spec"]["deployment_id"])
            if dep is None:
                raise _Failed(f"target {t['spec']['deployment_id']} disappeared from host "
                              f"{t['host_id']}")
            if dep.phase != READY:
                row.target_restarts[dep.deployment_id] = dep.restarts
                note = (f"waiting: target {dep.deployment_id} is "
                        f"{BROKEN_PHASES.get(dep.phase, _phase_name(dep.phase))}; its agent "
                        "restarts it")
                first = row.status_message != note
                row.status_message = note
                self._save(row, note if first else None)
                return
        cmds = self._repo.commands(row.id)
        late = [t for t in row.target_specs if t["late"]]
        replaced_late = {t["replaces"] for t in late}
        done = True
        for src in row.source_specs:
            dep_id = src["spec"]["deployment_id"]
            if dep_id not in replaced_late and not self._retire(row, cmds, dep_id, src["host_id"]):
                done = False
        for t in late:  # one by one: retire its source, start it, wait until ready
            if not self._retire(row, cmds, t["replaces"], t["host_id"]):
                done = False
                break
            dep = self._start(row, cmds, "start", str(t["replica"]), t["host_id"], t["spec"])
            if dep is None:
                done = False
                break
            row.target_restarts.setdefault(dep.deployment_id, dep.restarts)
        if done:
            self._go(row, P.DONE, f"{row.model} serves on {row.to_engine} "
                                  f"({len(row.target_specs)} replica(s)); sources stopped")

    def _rolling_back(self, row: MigrationRow) -> None:
        cmds = self._repo.commands(row.id)
        retired = [self._retire(row, cmds, t["spec"]["deployment_id"], t["host_id"],
                                f"{row.id}:start:{t['replica']}") for t in row.target_specs]
        if not all(retired):
            return  # sources are restored only once the targets freed their GPUs
        done = True
        notes = []
        for src in row.source_specs:
            dep_id, host = src["spec"]["deployment_id"], src["host_id"]
            if not any(cid.endswith(f":{dep_id}") and c.kind in ("drain", "stop")
                       for cid, c in cmds.items()):
                continue  # never touched by this move
            dep = self._dep(host, dep_id)
            if dep is not None and dep.phase == READY:
                continue
            if dep is not None and dep.phase == agent_pb2.DEPLOYMENT_PHASE_DRAINING and (
                    f"{row.id}:restore:{dep_id}" not in cmds):
                done = False  # still leaving; restore once it has stopped
                continue
            try:
                if self._start(row, cmds, "restore", dep_id, host, src["spec"]) is None:
                    done = False
            except _Failed as failed:
                notes.append(f"source {dep_id} not restored: {failed.message}")
        if done:
            final = P.ABORTED if row.abort_requested else P.ROLLED_BACK
            if row.kind == "trial" and not row.abort_requested and row.reason.startswith(
                    TRIAL_COMPLETE):
                final = P.DONE  # a trial that measured what it came for is done
            if notes:
                row.reason = f"{row.reason}; {'; '.join(notes)}"
            self._go(row, final, f"traffic back on {row.from_engine}: {row.reason}")


class _Failed(Exception):
    """The move cannot go on; it rolls back with this message as the reason."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _spec_proto(spec: dict[str, Any]) -> agent_pb2.DeploymentSpec:
    return agent_pb2.DeploymentSpec(**spec)
