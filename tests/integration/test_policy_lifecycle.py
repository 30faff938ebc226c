"""Policies through the control API: validate, apply (atomic, versioned), restore,
history, pause/resume; and decisions reviewed by people. A real controller in this
process, a real gRPC client over loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from gearshift.controller.server import Controller, ControllerConfig
from gearshift.controller.store.tables import DecisionRow
from gearshift.policies.core import DecisionStatus
from gearshift.v1 import control_pb2, control_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
GOOD = (REPO / "policies" / "examples" / "default.yaml").read_text()
APPROVAL = (REPO / "policies" / "examples" / "approval-gated.yaml").read_text()
BAD = GOOD.replace("minDwell: 24h", "minDwel: 24h")


@pytest.fixture
async def ctl(tmp_path: Path) -> AsyncIterator[tuple[Controller, control_pb2_grpc.ControlServiceStub]]:
    controller = Controller(ControllerConfig(listen="127.0.0.1:0", data_dir=tmp_path / "d",
                                             report_interval_s=0.5))
    await controller.start()
    channel = aio.insecure_channel(f"127.0.0.1:{controller.port}")
    try:
        yield controller, control_pb2_grpc.ControlServiceStub(channel)
    finally:
        await channel.close()
        await controller.stop(0.1)


async def test_apply_is_atomic_versioned_and_restorable(ctl) -> None:
    _, stub = ctl
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetPolicy(control_pb2.GetPolicyRequest())
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    v1 = await stub.ApplyPolicy(control_pb2.ApplyPolicyRequest(yaml_text=GOOD, source="default.yaml",
                                                               applied_by="ann"))
    assert v1.changed and v1.policy.version == 1 and v1.policy.active and v1.policy.mode == "auto"
    again = await stub.ApplyPolicy(control_pb2.ApplyPolicyRequest(yaml_text=GOOD, source="x"))
    assert not again.changed and again.policy.version == 1

    # An invalid policy is refused with file, line and key, and replaces nothing.
    check = await stub.ValidatePolicy(control_pb2.ValidatePolicyRequest(yaml_text=BAD, source="bad.yaml"))
    assert not check.valid and any("bad.yaml:" in e and "minDwel" in e for e in check.errors)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ApplyPolicy(control_pb2.ApplyPolicyRequest(yaml_text=BAD, source="bad.yaml"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "minDwel" in err.value.details() and "did you mean" in err.value.details()
    assert (await stub.GetPolicy(control_pb2.GetPolicyRequest())).version == 1

    v2 = await stub.ApplyPolicy(control_pb2.ApplyPolicyRequest(yaml_text=APPROVAL, source="a.yaml"))
    assert v2.policy.version == 2
    history = await stub.PolicyHistory(control_pb2.PolicyHistoryRequest())
    assert [(v.version, v.active) for v in history.versions] == [(2, True), (1, False)]

    restored = await stub.ApplyPolicy(control_pb2.ApplyPolicyRequest(restore_version=1))
    assert restored.changed and restored.policy.version == 1
    assert (await stub.GetPolicy(control_pb2.GetPolicyRequest())).yaml_text == GOOD
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ApplyPolicy(control_pb2.ApplyPolicyRequest(restore_version=9))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_people_review_decisions_and_pause_stops_the_loop(ctl) -> None:
    controller, stub = ctl
    await stub.ApplyPolicy(control_pb2.ApplyPolicyRequest(yaml_text=APPROVAL, source="a.yaml"))
    decisions = controller.term.decisions
    for i, model in enumerate(("m1", "m2")):
        decisions.add_decision(DecisionRow(
            id=f"d-test{i}", model=model, from_engine="vllm", to_engine="tensorrt-llm",
            rule="cost", inputs={"rps_sustained": 120.0}, expected={"cost_usd_per_day": -42.0},
            alternatives=[{"option": "vllm", "why": "stay: costs more"}], policy_version=1,
            mode="approve", status=DecisionStatus.PROPOSED))

    listed = await stub.ListDecisions(control_pb2.ListDecisionsRequest(status="proposed"))
    assert {d.id for d in listed.decisions} == {"d-test0", "d-test1"}
    got = await stub.GetDecision(control_pb2.GetDecisionRequest(id="d-test0"))
    assert got.inputs.fields["rps_sustained"].number_value == 120.0
    assert got.alternatives.values[0].struct_value.fields["why"].string_value == "stay: costs more"

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RejectDecision(control_pb2.ReviewDecisionRequest(id="d-test1", reason=" "))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rejected = await stub.RejectDecision(control_pb2.ReviewDecisionRequest(
        id="d-test1", reason="not during the launch", by="bob"))
    assert rejected.status == "rejected" and "bob" in rejected.status_reason
    # Approved: the orchestrator is asked to act (no ready deployment here, so it waits).
    approved = await stub.ApproveDecision(control_pb2.ReviewDecisionRequest(id="d-test0", by="ann"))
    assert approved.status == "approved" and "not started yet" in approved.status_reason
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ApproveDecision(control_pb2.ReviewDecisionRequest(id="d-test1"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetDecision(control_pb2.GetDecisionRequest(id="d-nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListDecisions(control_pb2.ListDecisionsRequest(status="maybe"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "proposed" in err.value.details()

    paused = await stub.SetPaused(control_pb2.SetPausedRequest(paused=True, reason="freeze"))
    assert paused.paused
    assert (await stub.FleetStatus(control_pb2.FleetStatusRequest())).paused
    now = await stub.EvaluateNow(control_pb2.EvaluateNowRequest())
    assert now.message.startswith("paused") and not now.decisions
    await stub.SetPaused(control_pb2.SetPausedRequest(paused=False))
    assert not (await stub.FleetStatus(control_pb2.FleetStatusRequest())).paused


async def test_the_default_policy_warns_when_the_fleet_has_no_gpu_price(tmp_path: Path) -> None:
    """The default policy leaves pricePerGpuHour to the fleet: a controller without
    --gpu-price-per-hour (nor priced hosts) says that its cost rule can never move a model;
    with one, the warning is gone."""
    for price, warned in ((None, True), (3.5, False)):
        controller = Controller(ControllerConfig(listen="127.0.0.1:0", data_dir=tmp_path / str(price),
                                                 gpu_price_per_hour=price))
        await controller.start()
        channel = aio.insecure_channel(f"127.0.0.1:{controller.port}")
        try:
            stub = control_pb2_grpc.ControlServiceStub(channel)
            check = await stub.ValidatePolicy(control_pb2.ValidatePolicyRequest(
                yaml_text=GOOD, source="default.yaml"))
            assert check.valid
            unpriced = [w for w in check.warnings if "can never move a model" in w]
            assert bool(unpriced) is warned, check.warnings
            if warned:
                assert "--gpu-price-per-hour" in unpriced[0] and "rule cost" in unpriced[0]
            applied = await stub.ApplyPolicy(control_pb2.ApplyPolicyRequest(
                yaml_text=GOOD, source="default.yaml"))
            assert bool([w for w in applied.warnings if "never move" in w]) is warned
        finally:
            await channel.close()
            await controller.stop(0.1)
