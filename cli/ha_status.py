"""`gearshift controller status`: who leads, under which epoch, and how fresh the lease is."""

from __future__ import annotations

from typing import Any

import click
import grpc

from gearshift.cli.client import RPC_TIMEOUT_S, CliError, controller_endpoints
from gearshift.cli.output import print_json, print_table, to_dict
from gearshift.common.credentials import TlsFiles, load_token, secure_channel
from gearshift.common.errors import GearshiftError, Unavailable
from gearshift.v1 import control_pb2, control_pb2_grpc

STATUS_TIMEOUT_S = min(RPC_TIMEOUT_S, 3.0)


def _ask(addr: str, tls: TlsFiles | None, token: str | None,
         ) -> control_pb2.ControllerStatusResponse | str:
    channel = (secure_channel(addr, tls, token, aio=False) if tls is not None or token
               else grpc.insecure_channel(addr))
    with channel:
        try:
            return control_pb2_grpc.ControlServiceStub(channel).ControllerStatus(
                control_pb2.ControllerStatusRequest(), timeout=STATUS_TIMEOUT_S)
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}"  # type: ignore[attr-defined]


def _secs(v: float) -> str:
    return f"{v:.1f}s"


def show_status(ctx: click.Context, output: str) -> None:
    endpoints = controller_endpoints(ctx)
    try:
        tls, token = TlsFiles.from_env(), load_token()
    except GearshiftError as err:
        raise CliError(err) from None
    answers = {addr: _ask(addr, tls, token) for addr in endpoints.addresses}
    leaders = {(a.leader_id, a.epoch, a.leader_address) for a in answers.values()
               if not isinstance(a, str) and a.leader_id}
    if output == "json":
        out: dict[str, Any] = {"controllers": [
            {"address": addr, "error": a} if isinstance(a, str) else {"address": addr, **to_dict(a)}
            for addr, a in answers.items()]}
        print_json(out)
    else:
        rows = []
        for addr, a in answers.items():
            if isinstance(a, str):
                rows.append((addr, "-", "unreachable", "-", "-", "-", "-", a))
                continue
            role = "leader" if a.leader else "follower"
            if not a.ha:
                role += " (single: SQLite)"
            rows.append((addr, a.controller_id, role, a.epoch,
                         f"{a.leader_id} at {a.leader_address}" if a.leader_id else "none",
                         _secs(a.lease_age_s) if a.ha and a.leader_id else "-",
                         _secs(a.lease_expires_in_s) if a.ha and a.leader_id else "-",
                         a.error or a.store))
        print_table("controllers", ["address", "id", "role", "epoch", "leader", "lease age",
                                    "expires in", "store / error"], rows)
    if not leaders:
        reachable = any(not isinstance(a, str) for a in answers.values())
        raise CliError(Unavailable("no controller leads right now" if reachable
                                   else "no controller could be reached"))
