"""Leader failover under load: kill the leading controller again and again.

Several `gearshift controller` processes share one PostgreSQL database (a private
server started here with initdb, on its own port); agents with emulated engines,
a gateway and a client load run on loopback, all given every controller's
address. The load is `devfleet.load.LoadGenerator` as a closed loop, the
request pattern of the bench's earlier own client: 4 workers, each sending a
small plain completion and its next one 0.05 s after the answer. Each round
publishes a new revision of model `m` (a rollout: start the new replicas,
canary, drain and stop the old ones), waits until the rollout is under way,
SIGKILLs the leader, and measures:

- takeover: from the kill until another controller leads with a higher epoch
  AND every agent reports to it (what the fleet needs to be managed again);
- election: from the kill until another controller leads;

then restarts the killed controller (it rejoins as a follower) and waits for
the rollout to finish under the new leader. At the end:

- `duplicate_commands`: commands that ran more than once, counted over every
  agent's command journal (one line per command that ran);
- `lost_decisions`: decisions the leader had proposed before a kill (a policy
  in approve mode proposes one per round; each is rejected after its round, so
  the next round gets a new one) that no controller knows afterwards, or that
  lost their status across the failover;
- `rollouts_done` / `rollouts_not_done`, and the clients' requests and failures.

Prints one JSON object. Usage:
  python bench/failover.py [--failovers 10] [--controllers 3] [--lease-ttl 10] [--agents 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from gearshift.devfleet.ha_fleet import HaFleet
from gearshift.devfleet.load import LoadGenerator
from gearshift.devfleet.local_pg import LocalPostgres
from gearshift.devfleet.waiting import wait_for
from gearshift.v1 import control_pb2, control_pb2_grpc

FAST_ENGINES = {"vllm": {"GEARSHIFT_EMULATOR_LOAD_S": "0.3"},
                "tensorrt-llm": {"GEARSHIFT_EMULATOR_LOAD_S": "0.3"}}
POLICY = """\
apiVersion: gearshift.dev/v1
kind: EnginePolicy
metadata: {name: failover-bench}
spec:
  mode: approve
  interval: 1s
  signals: {window: 4s, longWindow: 8s, minHistory: 2s}
  rules:
    - name: prefer-tensorrt-llm
      kind: threshold
      prefer: tensorrt-llm
      when: [{signal: rps_sustained, gt: 0.5}]
  guardrails: {minDwell: 0s, cooldown: 0s}
"""
END_PHASES = ("done", "rolled_back", "aborted")


LOAD_WORKERS = 4
LOAD_PAUSE_S = 0.05  # each worker's pause after an answer
LOAD_PROMPT = "hi"
LOAD_MAX_TOKENS = 8
LOAD_TIMEOUT_S = 30.0


def cli_json(fleet: HaFleet, *args: str) -> Any:
    proc = fleet.cli(*args, "-o", "json")
    if proc.returncode != 0:
        raise RuntimeError(f"gearshift {' '.join(args)}: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def agents_on(fleet: HaFleet, name: str, hosts: set[str]) -> bool:
    """True when controller `name` leads and every host in `hosts` reports to it."""
    with grpc.insecure_channel(fleet.addr(name)) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        try:
            listed = stub.ListHosts(control_pb2.ListHostsRequest(), timeout=2.0)
        except grpc.RpcError:
            return False  # not (yet) the leader, or not answering
    seen = {h.host_id for h in listed.hosts
            if h.state == control_pb2.HOST_STATE_CONNECTED and h.reports > 0}
    return hosts <= seen


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="gearshift-failover-"))
    takeovers: list[float] = []
    elections: list[float] = []
    listed: set[str] = set()
    changed: set[str] = set()
    rollouts: list[str] = []
    with LocalPostgres() as pg:
        fleet = HaFleet(workdir, report_interval_s=args.report_interval, db_url=pg.url,
                        controllers=args.controllers, lease_ttl_s=args.lease_ttl)
        try:
            fleet.start_all(("--history-resolution", "1"))
            hosts = {f"host-{i + 1}" for i in range(args.agents)}
            fleet.start_agent("host-1", [{"deployment_id": "m-vllm-0", "model": "m",
                                          "engine": "vllm", "source": "org/m", "revision": "r0",
                                          "gpu_indices": [0]}], FAST_ENGINES)
            for i in range(1, args.agents):
                fleet.start_agent(f"host-{i + 1}", [], FAST_ENGINES)
            wait_for(lambda: any(d["report"]["phase"] == "DEPLOYMENT_PHASE_READY"
                             for d in cli_json(fleet, "fleet", "deployments")), 60, "m ready")
            fleet.start_gateway()
            policy = workdir / "policy.yaml"
            policy.write_text(POLICY)
            if fleet.cli("policy", "apply", str(policy)).returncode != 0:
                raise RuntimeError("policy apply failed")
            with LoadGenerator.closed_loop(fleet.gateway_url, ["m"], LOAD_WORKERS,
                                           pause_s=LOAD_PAUSE_S, stream_share=0.0,
                                           prompt=LOAD_PROMPT, max_tokens=LOAD_MAX_TOKENS,
                                           timeout_s=LOAD_TIMEOUT_S) as load:
                for k in range(1, args.failovers + 1):
                    out = cli_json(fleet, "models", "publish", "m", "--revision", f"r{k}")
                    mid = out.get("migration_id") or out.get("migration", {}).get("id")
                    if not mid:
                        raise RuntimeError(f"publish gave no migration: {out}")
                    rollouts.append(mid)
                    wait_for(lambda mid=mid: cli_json(fleet, "migrations", "show", mid)["phase"]
                         not in ("pending",), 30, "the rollout under way")
                    proposed = wait_for(lambda: [d["id"] for d in cli_json(fleet, "decisions", "list")
                                             if d["status"] == "proposed"
                                             and d["id"] not in listed], 60, "a new decision")
                    listed.update(proposed)
                    leader, epoch = fleet.wait_leader(30)
                    fleet.procs[leader].kill()
                    killed = time.monotonic()
                    new, _ = fleet.wait_leader(60, not_name=leader, min_epoch=epoch + 1)
                    elections.append(time.monotonic() - killed)
                    wait_for(lambda new=new: agents_on(fleet, new, hosts), 60, "agents on the leader",
                         interval_s=0.05)
                    takeovers.append(time.monotonic() - killed)
                    fleet.start_controller(("--history-resolution", "1"), leader)
                    wait_for(lambda mid=mid: cli_json(fleet, "migrations", "show", mid)["phase"]
                         in END_PHASES, 180, "the rollout to end")
                    for did in proposed:  # kept, still waiting: then make room for the next
                        if cli_json(fleet, "decisions", "explain", did).get("status") \
                                != "proposed":
                            changed.add(did)
                        fleet.cli("decisions", "reject", did, "--reason", "failover bench")
                    print(f"failover {k}: {leader} -> {new}, elected after {elections[-1]:.1f}s, "
                          f"takeover {takeovers[-1]:.1f}s", file=sys.stderr, flush=True)
            now = {d["id"] for d in cli_json(fleet, "decisions", "list", "--limit", "1000")}
            shown = [cli_json(fleet, "migrations", "show", m) for m in rollouts]
            phases = [m["phase"] for m in shown]
            for m in shown:
                if m["phase"] != "done":
                    print(f"rollout {m['id']} ended {m['phase']}: " + "; ".join(
                        f"{s['to_phase']}: {s['message']}" for s in m.get("steps", [])),
                        file=sys.stderr)
            runs = fleet.executions()
        finally:
            fleet.stop()
            if args.keep_logs:
                print(f"logs kept in {workdir}", file=sys.stderr)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    return {
        "failovers": len(takeovers),
        "controllers": args.controllers,
        "lease_ttl_s": args.lease_ttl,
        "takeover_p50_s": round(statistics.median(takeovers), 2) if takeovers else None,
        "takeover_max_s": round(max(takeovers), 2) if takeovers else None,
        "election_p50_s": round(statistics.median(elections), 2) if elections else None,
        "duplicate_commands": sum(n - 1 for n in runs.values() if n > 1),
        "commands_run": sum(runs.values()),
        "lost_decisions": len((listed - now) | changed),
        "decisions_checked": len(listed),
        "rollouts_done": sum(p == "done" for p in phases),
        "rollouts_not_done": sum(p != "done" for p in phases),
        "requests_sent": load.sent,
        "requests_failed": load.failed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--failovers", type=int, default=10)
    p.add_argument("--controllers", type=int, default=3)
    p.add_argument("--lease-ttl", type=float, default=10.0)
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--report-interval", type=float, default=1.0)
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    print(json.dumps(run(p.parse_args())))


if __name__ == "__main__":
    main()
