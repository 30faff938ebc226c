"""Engine restarts as the agents report them, for the crash-loop signal (docs/observability.md).

Every `DeploymentReport` carries the number of times its agent restarted the
engine (carried over when an agent adopts a running engine). `RestartTracker`
compares each report with the previous one of the same deployment: an increase
is a restart the controller saw. It keeps per (engine, model) the restarts not
yet exported, and per deployment the times of its recent restarts, from which
`crash_looping` counts the deployments that restarted `CRASH_LOOP_RESTARTS`
times within `CRASH_LOOP_WINDOW_S`. A count that goes down (a new deployment
under an old id) is no restart. Nothing here acts on a crash loop: it is shown
to people (a gauge and an alert); the agent keeps restarting the engine, and a
migration whose target crashes rolls back by its own checks.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from gearshift.v1 import agent_pb2

CRASH_LOOP_RESTARTS = 3
CRASH_LOOP_WINDOW_S = 900.0


@dataclass
class _Recent:
    engine: str
    model: str
    times: deque[float] = field(default_factory=lambda: deque(maxlen=CRASH_LOOP_RESTARTS))


class RestartTracker:
    """Restarts seen in reports; O(the report's deployments) per report."""

    def __init__(self) -> None:
        self._unexported: Counter[tuple[str, str]] = Counter()
        self._recent: dict[tuple[str, str], _Recent] = {}  # (host, deployment id) -> restarts

    def observe(self, host_id: str, before: Mapping[str, agent_pb2.DeploymentReport],
                after: Mapping[str, agent_pb2.DeploymentReport], now: float) -> None:
        """Compare a host's new report (`after`) with its previous one (`before`)."""
        for dep_id, dep in after.items():
            prev = before.get(dep_id)
            if prev is None or dep.restarts <= prev.restarts:
                continue
            n = dep.restarts - prev.restarts
            self._unexported[(dep.engine, dep.model)] += n
            recent = self._recent.get((host_id, dep_id))
            if recent is None or (recent.engine, recent.model) != (dep.engine, dep.model):
                recent = self._recent[(host_id, dep_id)] = _Recent(dep.engine, dep.model)
            recent.times.extend([now] * min(n, CRASH_LOOP_RESTARTS))

    def take(self) -> dict[tuple[str, str], int]:
        """Restarts per (engine, model) seen since the last call (for a counter)."""
        out = dict(self._unexported)
        self._unexported.clear()
        return out

    def crash_looping(self, now: float) -> dict[tuple[str, str], int]:
        """(engine, model) -> deployments with CRASH_LOOP_RESTARTS restarts within the
        window ending `now`; restarts older than the window are forgotten."""
        out: Counter[tuple[str, str]] = Counter()
        for key, recent in list(self._recent.items()):
            if not recent.times or now - recent.times[-1] > CRASH_LOOP_WINDOW_S:
                del self._recent[key]
            elif len(recent.times) >= CRASH_LOOP_RESTARTS \
                    and now - recent.times[0] <= CRASH_LOOP_WINDOW_S:
                out[(recent.engine, recent.model)] += 1
        return dict(out)

    def forget_host(self, host_id: str) -> None:
        for key in [k for k in self._recent if k[0] == host_id]:
            del self._recent[key]


__all__ = ["CRASH_LOOP_RESTARTS", "CRASH_LOOP_WINDOW_S", "RestartTracker"]
