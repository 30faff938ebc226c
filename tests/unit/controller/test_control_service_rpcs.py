"""ControlService is one servicer composed of collaborators: every RPC of the service is a
method of its own (answered there or handed to `actions` / `enrolment`), none left to the
generated base's UNIMPLEMENTED."""

from __future__ import annotations

from gearshift.controller.api.control_actions import ActionRpcs
from gearshift.controller.api.control_service import ControlService
from gearshift.controller.enrolment.service import EnrolmentRpcs
from gearshift.v1 import control_pb2, control_pb2_grpc


def test_every_rpc_is_served_by_control_service_itself() -> None:
    names = [m.name for m in control_pb2.DESCRIPTOR.services_by_name["ControlService"].methods]
    assert len(names) > 20
    missing = [n for n in names if n not in vars(ControlService)]
    assert not missing, f"left to {control_pb2_grpc.ControlServiceServicer.__name__}: {missing}"


def test_each_delegated_rpc_has_one_owner() -> None:
    own = {n for n in vars(ControlService) if n[:1].isupper()}
    actions = {n for n in vars(ActionRpcs) if n[:1].isupper()}
    enrolment = {n for n in vars(EnrolmentRpcs) if n[:1].isupper()}
    assert not actions & enrolment
    assert actions | enrolment <= own
