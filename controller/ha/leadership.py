"""Leader and followers: what a controller may do in each role.

`Leadership` is one controller's view of the election (see `leader.py`): whether
it leads, under which fencing epoch, and who leads otherwise. `LeaderGate`
refuses, before any handler runs, the calls only a leader may serve when this
controller does not lead: agents' streams, the gateway's routes and reports, and
every call that changes something. The refusal is FAILED_PRECONDITION and names
the leader in the ``gearshift-leader`` trailing metadata (empty while nobody
leads), which clients follow (`endpoints.ControllerEndpoints`). The fleet's
live state (hosts, deployments, models) is in the leader's memory alone, so those
listings are the leader's too; reads of the shared store (policies, decisions,
migrations) and `ControllerStatus` are served by every controller.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc import aio

from gearshift.common.identity import LEADER_METADATA_KEY
from gearshift.controller.api.security import AGENT_SERVICE, CONTROL_SERVICE, denying_handler
from gearshift.controller.ha.leader import Elector, LeaseState

log = logging.getLogger(__name__)

# Calls only the leader serves: it alone holds the fleet's hot state, evaluates
# policies and drives migrations.
LEADER_ONLY: frozenset[str] = frozenset(
    [AGENT_SERVICE + "Connect"]
    + [CONTROL_SERVICE + m for m in (
        "FleetStatus", "ListHosts", "ListDeployments", "ListModels",
        "WatchRoutes", "ReportGateway", "GetCapacity", "GetRateHistory",
        "ApplyPolicy", "ApproveDecision", "RejectDecision", "EvaluateNow", "SetPaused",
        "AbortMigration", "PublishRevision",
        "RevokeHost")])  # the leader holds the streams it closes


@dataclass
class Leadership:
    """This controller's role, as the elector last settled it."""

    elector: Elector
    ha: bool  # PostgreSQL lease election; False: SQLite, one controller
    ttl_s: float
    epoch: int | None = None  # the epoch this controller leads under; None: it follows

    def lead(self, epoch: int) -> None:
        """Open the gate: leader-only calls are served under `epoch`."""
        self.epoch = epoch

    def follow(self) -> None:
        """Close the gate: leader-only calls are refused, naming the leader."""
        self.epoch = None

    @property
    def controller_id(self) -> str:
        return self.elector.controller_id

    @property
    def address(self) -> str:
        return self.elector.address

    @property
    def leading(self) -> bool:
        """True while this controller may act as leader (its local lease deadline
        has not passed; see `leader.py`)."""
        return self.epoch is not None and self.elector.leading_epoch == self.epoch \
            and self.elector.may_lead()

    def lease(self) -> LeaseState | None:
        """The lease as last read by the elector (no database round trip)."""
        return self.elector.last_state

    def refusal(self) -> tuple[str, str]:
        """(details, leader address) for a call this controller may not serve now."""
        state = self.lease()
        me = self.controller_id
        if state is not None and state.live and state.holder and state.holder != me:
            return (f"controller {me} is a follower; the leader is {state.holder} at "
                    f"{state.address or '?'} (epoch {state.epoch})", state.address or "")
        return (f"controller {me} does not lead and no controller holds the lease right "
                f"now; retry shortly", "")


class LeaderGate(aio.ServerInterceptor):
    """Refuse leader-only calls on a controller that does not lead (see the module doc)."""

    def __init__(self, leadership: Callable[[], Leadership | None],
                 leader_only: frozenset[str] = LEADER_ONLY) -> None:
        self.leadership = leadership  # None until the controller has started its elector
        self.leader_only = leader_only

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.leader_only:
            return handler
        leadership = self.leadership()
        if leadership is not None and leadership.leading:
            return handler
        details, leader = (leadership.refusal() if leadership is not None
                           else ("the controller is starting; retry shortly", ""))
        return denying_handler(handler, grpc.StatusCode.FAILED_PRECONDITION, details,
                               ((LEADER_METADATA_KEY, leader),))
