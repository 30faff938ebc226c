"""Engines outlive their agent: under gateway load, the agent is SIGKILLed and started
again, then SIGTERMed and started again. The engine keeps serving throughout (no
failed request), it is adopted rather than started a second time, and the controller
sees the deployment, with the same endpoint, in every routing table it publishes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import psutil

from gearshift.devfleet.local_fleet import LocalFleet
from gearshift.v1 import control_pb2, control_pb2_grpc
from integration.helpers import FAST_ENGINE_ENV, gateway_load, gearshift, gearshift_json, wait_for

DEP = {"deployment_id": "m-vllm", "model": "m", "engine": "vllm", "source": "org/m",
       "revision": "r1", "gpu_indices": [0]}


class RouteWatch:
    """Reads the controller's routing tables from a thread; notes every table in which
    the deployment is missing or has another endpoint."""

    def __init__(self, addr: str, deployment_id: str) -> None:
        self.deployment_id = deployment_id
        self.tables = 0
        self.endpoints: set[str] = set()
        self.missing: list[int] = []  # versions of tables without the deployment
        self._channel = grpc.insecure_channel(addr)
        self._call = control_pb2_grpc.ControlServiceStub(self._channel).WatchRoutes(
            control_pb2.WatchRoutesRequest(gateway_id="restart-test"))
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            for table in self._call:
                self.tables += 1
                found = [e.endpoint for m in table.models for e in m.endpoints
                         if e.deployment_id == self.deployment_id]
                if found:
                    self.endpoints.update(found)
                else:
                    self.missing.append(table.version)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise

    def __enter__(self) -> RouteWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._call.cancel()
        self._thread.join(5)
        self._channel.close()


def _deployment(fleet: LocalFleet) -> dict | None:
    for d in gearshift_json(fleet, "fleet", "deployments"):
        if d["report"]["deployment_id"] == DEP["deployment_id"]:
            return d
    return None


def _engine_processes(workdir: Path) -> list[psutil.Process]:
    """Emulated engines whose cwd is the deployment's directory under `workdir`."""
    root = str((workdir / DEP["deployment_id"]).resolve())
    out = []
    for p in psutil.process_iter(["pid", "cwd", "cmdline"]):
        try:
            if (p.info["cwd"] or "") == root and "gearshift.agents.emulator" in " ".join(
                    p.info["cmdline"] or ()):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _launches(workdir: Path) -> int:
    """Engine launches the supervisors logged (one line per process started)."""
    log = workdir / DEP["deployment_id"] / f"{DEP['deployment_id']}.engine.log"
    return log.read_text(errors="replace").count("=== gearshift ")


def test_engines_survive_agent_kill_and_term_under_load(fleet: LocalFleet) -> None:
    fleet.start_controller()
    fleet.start_agent("host-a", [DEP], FAST_ENGINE_ENV)
    ready = wait_for(lambda: (d := _deployment(fleet)) and
                     d["report"]["phase"] == "DEPLOYMENT_PHASE_READY" and d, 60, "engine ready")
    endpoint = ready["report"]["endpoint"]
    fleet.start_gateway()
    host_dir = fleet.workdir / "host-a"
    engine = _engine_processes(host_dir)
    assert len(engine) == 1, engine
    engine_pid = engine[0].pid

    def readopted() -> bool:
        since_restart = fleet.procs["host-a"].log().split("=== restart ===")[-1]
        return ("adopted engine m-vllm" in since_restart
                and "connected to controller" in since_restart)

    with RouteWatch(fleet.controller_addr, DEP["deployment_id"]) as routes, \
            gateway_load(fleet.gateway_url, "m") as load:
        wait_for(lambda: load.sent >= 20, 30, "load flowing")
        for how in ("kill", "terminate"):
            proc = fleet.procs.pop("host-a")
            if how == "kill":
                proc.kill()
            else:
                proc.popen.terminate()
                assert proc.popen.wait(15) == 0, proc.log()[-2000:]
                assert "keep serving" in proc.log()
            sent_while_away = load.sent
            wait_for(lambda s=sent_while_away: load.sent >= s + 10, 30,
                     "requests served with no agent")
            assert [p.pid for p in _engine_processes(host_dir)] == [engine_pid]
            with proc.log_path.open("a") as f:
                f.write("=== restart ===\n")
            fleet.start_agent("host-a", [DEP], FAST_ENGINE_ENV)
            wait_for(readopted, 60, f"agent restarted after {how} adopts the engine")
            wait_for(lambda: (d := _deployment(fleet)) and d["report"]["phase"] ==
                     "DEPLOYMENT_PHASE_READY" and d, 30, "deployment reported ready")
            sent_after = load.sent
            wait_for(lambda s=sent_after: load.sent >= s + 10, 30, "requests after the restart")
    print(json.dumps({"requests_sent": load.sent, "requests_failed": load.failed,
                      "route_tables_seen": routes.tables}))
    assert load.failed == 0, load.errors[:5]
    assert load.sent > 50
    # The same engine process served throughout: started once, adopted twice.
    assert [p.pid for p in _engine_processes(host_dir)] == [engine_pid]
    assert _launches(host_dir) == 1
    assert routes.tables >= 1 and routes.missing == [], routes.missing
    assert routes.endpoints == {endpoint}
    deps = gearshift_json(fleet, "fleet", "deployments")
    assert [d["report"]["endpoint"] for d in deps] == [endpoint]
    hosts = gearshift(fleet, "fleet", "hosts").stdout
    assert "host-a" in hosts


def test_drain_command_stops_engines_of_a_stopped_agent(fleet: LocalFleet) -> None:
    fleet.start_controller()
    agent = fleet.start_agent("host-a", [DEP], FAST_ENGINE_ENV)
    wait_for(lambda: (d := _deployment(fleet)) and
             d["report"]["phase"] == "DEPLOYMENT_PHASE_READY", 60, "engine ready")
    host_dir = fleet.workdir / "host-a"
    config = fleet.workdir / "host-a.yaml"

    refused = gearshift(fleet, "agent", "drain", "--config", str(config), check=False)
    assert refused.returncode != 0
    assert "in use by another agent" in refused.stderr
    assert len(_engine_processes(host_dir)) == 1

    fleet.procs.pop("host-a")
    agent.popen.terminate()
    agent.popen.wait(15)
    [engine] = _engine_processes(host_dir)
    out = gearshift(fleet, "agent", "drain", "--config", str(config), "--grace", "10").stdout
    assert f"m-vllm: pid {engine.pid} stopped" in out, out
    # Its new parent (init, or a subreaper) reaps it: a zombie has stopped too.
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE
    assert list((host_dir / "state").glob("*.engine.json")) == []
