"""The gateways' reports (`ReportGateway`), kept bounded whoever calls.

A gateway reports every 5 s what its clients saw of each deployment it routed to. Any
holder of a gateway certificate can call it, with any gateway id and any list, so what
is kept is bounded: the ids (`MAX_GATEWAYS`, a silent one dropped after
`GATEWAY_STALE_S`), the id itself (`MAX_GATEWAY_ID_CHARS` printable characters), and of
each report only the deployments in the routing table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from gearshift.common.errors import InvalidArgument, ResourceExhausted
from gearshift.v1 import control_pb2

# Gateways' reports (`GatewayReports`): the gateways whose latest report is kept, how long
# a gateway that stopped reporting (they report every 5 s) is kept, the length of an id.
MAX_GATEWAYS = 256
GATEWAY_STALE_S = 300.0
MAX_GATEWAY_ID_CHARS = 128


def check_gateway_report(report: control_pb2.GatewayReport, max_deployments: int) -> None:
    """Refuse a gateway's report whose id is not 1 to MAX_GATEWAY_ID_CHARS printable
    characters, or that names more than `max_deployments` (what the fleet could run)."""
    gateway_id = report.gateway_id
    if not (0 < len(gateway_id) <= MAX_GATEWAY_ID_CHARS and gateway_id.isprintable()):
        shown = gateway_id if len(gateway_id) <= MAX_GATEWAY_ID_CHARS else gateway_id[:32] + "..."
        raise InvalidArgument(
            f"GatewayReport.gateway_id: expected 1 to {MAX_GATEWAY_ID_CHARS} printable "
            f"characters, found {shown!r} ({len(gateway_id)} characters)")
    found = len(report.deployments)
    if found > max_deployments:
        raise InvalidArgument(
            f"GatewayReport.deployments: at most {max_deployments} (as many as the fleet's "
            f"hosts could run), found {found}")


class GatewayReports:
    """The latest report of each gateway (`ReportGateway`), bounded whoever calls.

    At most `max_gateways` gateways are kept; one silent for `stale_after_s` is dropped
    (at each report, and by the controller's housekeeping), and a new gateway beyond the
    cap is refused (RESOURCE_EXHAUSTED) while no kept one is stale. Of a report only the
    deployments in the routing table are kept, once each: a gateway counts only those it
    routed to, so a gateway holds at most the fleet's routes, serialized (a parsed message
    would hold the arena of the whole request; see `Deployments`).
    """

    def __init__(self, *, max_gateways: int = MAX_GATEWAYS,
                 stale_after_s: float = GATEWAY_STALE_S) -> None:
        self.max_gateways = max_gateways
        self.stale_after_s = stale_after_s
        # gateway id -> (when it last reported, what was kept of that report), oldest
        # report first: pruning stops at the first gateway that is not stale.
        self._latest: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def record(self, report: control_pb2.GatewayReport, routed: Container[str],
               now: float) -> None:
        """Keep `report` (checked by `check_gateway_report`) as its gateway's latest."""
        gateway_id = report.gateway_id
        self.prune(now)
        if gateway_id not in self._latest and len(self._latest) >= self.max_gateways:
            raise ResourceExhausted(
                f"GatewayReport.gateway_id: {gateway_id!r} refused: this controller keeps "
                f"the reports of at most {self.max_gateways} gateways (MAX_GATEWAYS), and "
                f"none has been silent for over {self.stale_after_s:g} s (GATEWAY_STALE_S)")
        kept = control_pb2.GatewayReport(gateway_id=gateway_id)
        seen: set[str] = set()
        for d in report.deployments:
            dep_id = d.deployment_id
            if dep_id in routed and dep_id not in seen:
                seen.add(dep_id)
                kept.deployments.add().CopyFrom(d)
        self._latest[gateway_id] = (now, kept.SerializeToString())
        self._latest.move_to_end(gateway_id)

    def prune(self, now: float) -> list[str]:
        """Drop the gateways silent for over `stale_after_s`; returns their ids."""
        gone: list[str] = []
        while self._latest:
            gateway_id, (at, _kept) = next(iter(self._latest.items()))
            if now - at <= self.stale_after_s:
                break
            del self._latest[gateway_id]
            gone.append(gateway_id)
        return gone

    def latest(self, gateway_id: str) -> control_pb2.GatewayReport | None:
        """What was kept of the gateway's latest report (a fresh copy), if it is kept."""
        held = self._latest.get(gateway_id)
        return None if held is None else control_pb2.GatewayReport.FromString(held[1])

    def __contains__(self, gateway_id: object) -> bool:
        return gateway_id in self._latest

    def __len__(self) -> int:
        return len(self._latest)
