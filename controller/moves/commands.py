"""The migration orchestrator's settings and agent commands.

`AgentCommands` is one part the orchestrator (`controller.moves.orchestrator`) is built
from: over the fleet and the command channel it sends the agent commands of a
move with deterministic ids (``<migration id>:<action>:<subject>``), re-sending an
unanswered one under the same id, and records them in the repository. A host
that is unknown or unreachable raises `Paused`; a move that cannot go on raises
`Failed`, which rolls it back. `OrchestratorSettings` says how cautious a move is.
Persisting rows and transitions is `controller.moves.ledger.MigrationLedger`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gearshift.common.enum_labels import enum_label
from gearshift.common.errors import InvalidArgument
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.moves.canary import Sla
from gearshift.controller.moves.machine import MigrationPhase
from gearshift.controller.moves.placement import Paused
from gearshift.controller.moves.store import (
    FINAL_COMMAND_PHASES,
    MigrationCommandRow,
    MigrationRepository,
    MigrationRow,
)
from gearshift.v1 import agent_pb2, control_pb2

# Transitions and commands log under the orchestrator's name, which operators filter on.
log = logging.getLogger("gearshift.controller.moves.orchestrator")

FAILED_COMMAND_PHASES = frozenset({"failed", "rejected"})
READY = agent_pb2.DEPLOYMENT_PHASE_READY
BROKEN_PHASES = {agent_pb2.DEPLOYMENT_PHASE_UNHEALTHY: "unhealthy",
                 agent_pb2.DEPLOYMENT_PHASE_RESTARTING: "restarting after a crash",
                 agent_pb2.DEPLOYMENT_PHASE_FAILED: "failed",
                 agent_pb2.DEPLOYMENT_PHASE_STOPPED: "stopped",
                 agent_pb2.DEPLOYMENT_PHASE_DRAINING: "draining"}

SendCommand = Callable[[str, agent_pb2.Command], bool]


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
    pull_timeout_s: float = 1800.0  # target engines' images must be pulled within
    drain_grace_s: float = 30.0  # in-flight requests get this long when a replica leaves
    command_resend_s: float = 30.0  # an unanswered command is re-sent (same id) after this
    min_available: int = 1  # source replicas kept serving until the target is promoted
    gpus_per_replica: int | None = None  # None: as many as the source replica uses
    trtllm_backend: str = "pytorch"  # "tensorrt" adds an engine build (phase building)
    # A move that stays in one phase longer than this beyond the phase's own time limit
    # (building: build_timeout_s; the others: none) is reported stuck: a gauge and an
    # alert for people, never an action (a move waits for capacity, an unreachable host,
    # an agent's answer or canary data for as long as it takes).
    stuck_after_s: float = 1800.0

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
        if not self.stuck_after_s > 0:
            raise InvalidArgument(f"orchestrator: stuck_after_s must be > 0, got {self.stuck_after_s}")

    def phase_deadline_s(self, phase: MigrationPhase) -> float:
        """How long a move may stay in `phase` before it counts as stuck."""
        if phase is MigrationPhase.PULLING:
            return self.stuck_after_s + self.pull_timeout_s
        return self.stuck_after_s + (self.build_timeout_s if phase is MigrationPhase.BUILDING
                                     else 0.0)


def phase_name(value: int) -> str:
    """A command phase, e.g. "succeeded" ("unknown" for one a newer agent added)."""
    return enum_label(agent_pb2.CommandPhase, "COMMAND_PHASE_", value)


def deployment_phase_name(value: int) -> str:
    """A deployment phase, e.g. "starting" ("unknown" for one a newer agent added)."""
    return enum_label(agent_pb2.DeploymentPhase, "DEPLOYMENT_PHASE_", value)


class Failed(Exception):
    """The move cannot go on; it rolls back with this message as the reason."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def spec_proto(spec: dict[str, Any]) -> agent_pb2.DeploymentSpec:
    return agent_pb2.DeploymentSpec(**spec)


class AgentCommands:
    """Commands of a move to the agents over the fleet; see the module docstring."""

    def __init__(self, repo: MigrationRepository, fleet: FleetState, send_command: SendCommand,
                 *, epoch: int, clock: Callable[[], float],
                 settings: OrchestratorSettings) -> None:
        self._repo = repo
        self._fleet = fleet
        self._send_command = send_command
        self._epoch = epoch
        self._clock = clock
        self.settings = settings

    # -- fleet and commands -------------------------------------------------------------

    def host(self, host_id: str) -> Any:
        """The host's fleet entry; pauses the move when it is unknown or unreachable."""
        entry = self._fleet.hosts.get(host_id)
        if entry is None or self._fleet.host_state(host_id) != control_pb2.HOST_STATE_CONNECTED:
            raise Paused(f"paused: host {host_id} is unreachable or not reporting")
        return entry

    def engine_image(self, host_id: str, engine: str) -> str:
        """The image `engine` runs from on `host_id` ("" = a host program, or unknown)."""
        entry = self._fleet.hosts.get(host_id)
        if entry is None:
            return ""
        return next((e.image for e in entry.hello.engines if e.engine == engine), "")

    def dep(self, host_id: str, dep_id: str) -> agent_pb2.DeploymentReport | None:
        dep: agent_pb2.DeploymentReport | None = self.host(host_id).deployments.get(dep_id)
        return dep

    def send(self, row: MigrationRow, cmds: dict[str, MigrationCommandRow], action: str,
              subject: str, host_id: str, command: agent_pb2.Command) -> MigrationCommandRow:
        """Send once (re-send the same id while unanswered); returns the recorded command."""
        cid = f"{row.id}:{action}:{subject}"
        known = cmds.get(cid)
        if known is not None and (known.phase != "sent" or self._clock()
                                  - known.sent_at.timestamp() < self.settings.command_resend_s):
            return known
        self.host(host_id)
        command.command_id, command.epoch = cid, self._epoch
        if not self._send_command(host_id, command):
            raise Paused(f"paused: host {host_id} is not connected; {action} {subject} not sent")
        now = datetime.fromtimestamp(self._clock(), UTC)
        sent = MigrationCommandRow(command_id=cid, migration_id=row.id, host_id=host_id,
                                   kind=action, sent_at=now, updated_at=now)
        self._repo.record_command(sent)
        cmds[cid] = known or sent
        return cmds[cid]

    def retire(self, row: MigrationRow, cmds: dict[str, MigrationCommandRow], dep_id: str,
                host_id: str, start_id: str | None = None) -> bool:
        """Drain then stop a deployment; True once the host no longer reports it (and, when
        this move sent `start_id` for it, once a stop made sure it cannot come up later)."""
        dep = self.dep(host_id, dep_id)
        stop = cmds.get(f"{row.id}:stop:{dep_id}")
        if dep is None:
            if start_id not in cmds or (stop is not None and stop.phase in FINAL_COMMAND_PHASES):
                return True
            # A start may still be in flight at the agent: stop it so it cannot come up later.
            self.send(row, cmds, "stop", dep_id, host_id, agent_pb2.Command(
                stop=agent_pb2.StopDeployment(deployment_id=dep_id, grace_s=0.0)))
            return False
        grace = self.settings.drain_grace_s
        drain = cmds.get(f"{row.id}:drain:{dep_id}")
        drained = dep.phase in (agent_pb2.DEPLOYMENT_PHASE_STOPPED, agent_pb2.DEPLOYMENT_PHASE_FAILED)
        if not drained and (drain is None or drain.phase not in FINAL_COMMAND_PHASES) and (
                drain is None or self._clock() - drain.sent_at.timestamp()
                < grace + self.settings.command_timeout_s):
            self.send(row, cmds, "drain", dep_id, host_id, agent_pb2.Command(
                drain=agent_pb2.DrainDeployment(deployment_id=dep_id, grace_s=grace)))
            return False
        self.send(row, cmds, "stop", dep_id, host_id, agent_pb2.Command(
            stop=agent_pb2.StopDeployment(deployment_id=dep_id, grace_s=grace)))
        return False

    def start(self, row: MigrationRow, cmds: dict[str, MigrationCommandRow], action: str,
               subject: str, host_id: str, spec: dict[str, Any]) -> agent_pb2.DeploymentReport | None:
        """Start a deployment (once); returns its report when READY. A failed start raises."""
        cid = f"{row.id}:{action}:{subject}"
        known = cmds.get(cid)
        if known is not None and known.phase in FAILED_COMMAND_PHASES:
            raise Failed(f"{action} of {spec['deployment_id']} on {host_id} {known.phase}: "
                         f"{known.message}")
        dep = self.dep(host_id, spec["deployment_id"])
        if dep is not None and dep.phase == READY:
            return dep
        if dep is not None and dep.phase == agent_pb2.DEPLOYMENT_PHASE_FAILED:
            raise Failed(f"{spec['deployment_id']} failed on {host_id}: {dep.message}")
        self.send(row, cmds, action, subject, host_id, agent_pb2.Command(
            start=agent_pb2.StartDeployment(spec=spec_proto(spec))))
        return None

