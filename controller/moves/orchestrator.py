"""The migration orchestrator (docs/migrations.md): a durable, level-triggered state machine per move.

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

This module holds the public API (create, abort, tick, route override) and
composes the parts: the ledger (`controller.moves.ledger`: saves, and
transitions checked against the table of `controller.moves.machine`), the
agent commands (`controller.moves.commands`) and the step function of each
phase (`controller.moves.steps`).
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Callable
from typing import Any

from gearshift.common.engines import ENGINE_NAMES
from gearshift.common.errors import FailedPrecondition, InvalidArgument, NotFound
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.moves.commands import (
    FAILED_COMMAND_PHASES,
    READY,
    AgentCommands,
    OrchestratorSettings,
    SendCommand,
    phase_name,
)
from gearshift.controller.moves.ledger import MigrationLedger, OnTransition
from gearshift.controller.moves.machine import MigrationKind, MigrationPhase
from gearshift.controller.moves.placement import Paused, source_spec
from gearshift.controller.moves.steps import PhaseSteps
from gearshift.controller.moves.store import MigrationRepository, MigrationRow, MigrationStepRow
from gearshift.v1 import agent_pb2

log = logging.getLogger(__name__)

P = MigrationPhase
KINDS = tuple(k.value for k in MigrationKind)


class MigrationOrchestrator:
    """Runs every migration of the controller; see the module docstring."""

    def __init__(self, repo: MigrationRepository, fleet: FleetState, send_command: SendCommand,
                 *, epoch: int, clock: Callable[[], float] = time.time,
                 settings: OrchestratorSettings | None = None,
                 on_transition: OnTransition | None = None,
                 on_created: Callable[[MigrationRow], None] | None = None) -> None:
        self._repo = repo
        self._fleet = fleet
        self._clock = clock
        self.settings = settings or OrchestratorSettings()
        self._ledger = MigrationLedger(repo, clock, on_transition)
        self._on_created = on_created  # observes each new move after it is stored (metrics)
        self._commands = AgentCommands(repo, fleet, send_command, epoch=epoch, clock=clock,
                                       settings=self.settings)
        self._steps = PhaseSteps(repo, fleet, self._ledger, self._commands, self.settings)
        self._active: dict[str, MigrationRow] = {}
        self._route_key: dict[str, tuple[str, int]] = {}
        self._reload_active()

    def _reload_active(self) -> None:
        self._active = {r.model: r for r in self._repo.rows(active_only=True)}
        key = {m: (r.phase.value, r.canary_step) for m, r in self._active.items()}
        if key != self._route_key:
            self._route_key = key
            self._fleet.refresh_routes()

    # -- public API ---------------------------------------------------------------------

    def create(self, model: str, from_engine: str, to_engine: str, *,
               decision_id: str | None = None,
               kind: MigrationKind | str = MigrationKind.ENGINE_SWITCH,
               target_revision: str | None = None, trial_share: float | None = None) -> MigrationRow:
        """Start moving `model`; refuses a second active move of the same model."""
        if kind not in KINDS:
            raise InvalidArgument(f"migration kind {kind!r} is not one of {', '.join(KINDS)}")
        kind = MigrationKind(kind)
        for what, engine in (("from_engine", from_engine), ("to_engine", to_engine)):
            if engine not in ENGINE_NAMES:
                raise InvalidArgument(f"migration {what} {engine!r} is not one of "
                                      f"{', '.join(ENGINE_NAMES)}")
        if kind is not MigrationKind.REVISION_ROLLOUT and from_engine == to_engine:
            raise InvalidArgument(f"migration of {model!r}: from_engine and to_engine are both "
                                  f"{from_engine!r}; an engine switch needs two engines")
        if kind is MigrationKind.REVISION_ROLLOUT and not target_revision:
            raise InvalidArgument(f"migration of {model!r}: a revision_rollout needs a "
                                  "target_revision")
        active = self._repo.rows(active_only=True, model=model)
        if active:
            raise FailedPrecondition(f"model {model!r} already has an active migration "
                                     f"{active[0].id} ({active[0].phase.value})")
        sources = [(h, d) for h, d, _ts in self._fleet.deployments_of(model)
                   if d.engine == from_engine and d.phase == READY
                   and (kind is not MigrationKind.REVISION_ROLLOUT or d.revision != target_revision)]
        if not sources:
            raise InvalidArgument(f"model {model!r} has no ready deployment on {from_engine}"
                                  + (f" with a revision other than {target_revision!r}"
                                     if kind is MigrationKind.REVISION_ROLLOUT else ""))
        sources.sort(key=lambda hd: hd[1].deployment_id)
        now = self._ledger.now()
        row = MigrationRow(
            decision_id=decision_id, model=model, kind=kind, from_engine=from_engine,
            to_engine=to_engine, target_revision=target_revision,
            canary_steps=[trial_share or self.settings.canary_steps[0]]
            if kind is MigrationKind.TRIAL
            else list(self.settings.canary_steps),
            source_deployment_ids=[d.deployment_id for _h, d in sources],
            source_specs=[source_spec(h, d, self.settings.drain_grace_s) for h, d in sources],
            phase_entered_at=now, created_at=now, updated_at=now, finished_at=None)
        target = target_revision if kind is MigrationKind.REVISION_ROLLOUT else to_engine
        self._repo.add(row, f"created: {model} {from_engine} -> {target} over {len(sources)} "
                            "source replica(s)" + (f" for decision {decision_id}"
                                                   if decision_id else ""))
        self._reload_active()
        if self._on_created is not None:
            try:
                self._on_created(row)
            except Exception:  # an observer must not break the move
                log.exception("migration %s: on_created observer failed", row.id)
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
                self._ledger.save(row, note=why)
            else:
                self._ledger.go(row, P.ROLLING_BACK, why)
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
        phase = phase_name(result.phase)
        row = self._repo.update_command(result.command_id, phase, result.message,
                                        self._ledger.now())
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
                self._steps.step(row)
            except Paused as paused:
                if row.status_message != paused.message:
                    row.status_message = paused.message
                    self._ledger.save(row)
            except Exception as exc:  # recorded; the next tick retries from stored state
                log.exception("migration %s: step failed", row.id)
                fresh = self._repo.get(row.id)
                if fresh is not None:
                    fresh.status_message = f"step failed, will retry: {exc}"
                    self._ledger.save(fresh)
        self._reload_active()

    def route_override(self, model: str, endpoints: builtins.list[Any]) -> builtins.list[Any]:
        """Weights and `leaving` flags for a model under migration (install as
        `FleetState.route_with`). Endpoints that are not targets count as the source side."""
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

    def active(self) -> builtins.list[MigrationRow]:
        """The active moves as the last tick (or create/abort) read them: no store read."""
        return builtins.list(self._active.values())

    def stuck(self, row: MigrationRow) -> bool:
        """True when `row` stayed in its phase past the phase's deadline (see
        `OrchestratorSettings.stuck_after_s`): reported, never acted on."""
        return row.phase.active and (self._clock() - row.phase_entered_at.timestamp()
                                     > self.settings.phase_deadline_s(row.phase))

    def install(self) -> None:
        """Route the fleet through `route_override` (`FleetState.route_with`)."""
        self._fleet.route_with(self.route_override)

    def list(self, active_only: bool = False) -> builtins.list[MigrationRow]:
        """Newest first."""
        return self._repo.rows(active_only=active_only)


__all__ = ["KINDS", "MigrationOrchestrator", "OrchestratorSettings"]
