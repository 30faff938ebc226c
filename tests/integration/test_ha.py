"""HA controllers under faults, as real processes on a private PostgreSQL server.

Two controllers share one database (a server these tests start themselves with
initdb, on its own port); agents, the gateway and the CLI are given both
addresses and follow the leader. Faults: the leader killed mid-migration, an
agent partitioned (SIGSTOP), PostgreSQL restarted under load, and a stale leader
resuming after a pause. Every agent keeps a command journal, which shows whether
any command ran twice.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from gearshift.devfleet.ha_fleet import HaFleet
from gearshift.devfleet.local_pg import LocalPostgres
from integration.helpers import FAST_ENGINE_ENV, gateway_load, gearshift_json, steady_load, wait_for
from integration.moves import _apply, _engines, _migration_in, ended, start_moving_hosts

# A longer canary leaves time to inject the fault while it runs.
ARGS = ("--history-resolution", "0.5", "--canary-steps", "0.5", "--analysis-intervals", "12")
TAKEOVER_LIMIT_S = 15.0


@pytest.fixture(scope="module")
def pg_server() -> Iterator[LocalPostgres]:
    with LocalPostgres() as pg:
        yield pg


def fresh_database(pg: LocalPostgres) -> str:
    name = f"ha_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(host="127.0.0.1", port=pg.port, user="postgres", dbname="postgres",
                         autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return pg.url.rsplit("/", 1)[0] + "/" + name


def make_fleet(workdir: Path, db_url: str) -> HaFleet:
    return HaFleet(workdir, report_interval_s=0.5, db_url=db_url, controllers=2,
                   lease_ttl_s=3.0)


@pytest.fixture
def ha(tmp_path: Path, pg_server: LocalPostgres) -> Iterator[HaFleet]:
    fleet = make_fleet(tmp_path / "ha", fresh_database(pg_server))
    try:
        yield fleet
    finally:
        fleet.stop()


def journal(fleet: HaFleet, host: str) -> list[dict]:
    path = fleet.journal(host)
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_leader_killed_mid_migration_follower_takes_over_and_finishes_once(
        ha: HaFleet, tmp_path: Path) -> None:
    ha.start_all(ARGS)
    leader, epoch = ha.wait_leader()
    start_moving_hosts(ha)
    ha.start_gateway()
    with gateway_load(ha.gateway_url, "m") as load:
        _apply(ha, tmp_path, "to-trt", "auto", "tensorrt-llm")  # sent to the leader by the CLI
        mig = wait_for(lambda: _migration_in(ha, "canary"), 60, "the canary")
        leader, epoch = ha.wait_leader()
        ha.procs[leader].kill()  # SIGKILL: no chance to release the lease
        killed_at = time.monotonic()
        new, new_epoch = ha.wait_leader(30, not_name=leader, min_epoch=epoch + 1)
        takeover_s = time.monotonic() - killed_at
        end = wait_for(lambda: ended(ha, mig["id"]), 90, "the move to end under the new leader")
        assert end["phase"] == "done", [(s["to_phase"], s["message"]) for s in end["steps"]]
        wait_for(lambda: _engines(ha) == {"tensorrt-llm"}, 30, "m on tensorrt-llm only")
    assert takeover_s <= TAKEOVER_LIMIT_S, takeover_s
    assert new_epoch > epoch
    assert load.failed == 0, load.errors[:5]
    runs = ha.executions()
    assert runs and max(runs.values()) == 1, runs.most_common(3)  # nothing ran twice
    # None lost: the target was started and the source drained and stopped.
    actions = [(e["action"], e["epoch"]) for h in ("host-a", "host-b") for e in journal(ha, h)]
    assert {"start", "drain", "stop"} <= {a for a, _ in actions}, actions
    assert any(ep == new_epoch for _a, ep in actions), "the new leader finished the move"
    status = ha.cli("controller", "status", "-o", "json")
    assert status.returncode == 0, status.stderr
    rows = json.loads(status.stdout)["controllers"]
    assert [r["leader_id"] for r in rows if r.get("controller_id")] == [new]


def test_partitioned_agent_is_unreachable_nothing_is_drained_and_it_rejoins(
        ha: HaFleet, tmp_path: Path) -> None:
    ha.start_all(ARGS)
    start_moving_hosts(ha)
    ha.start_agent("host-c", [{"deployment_id": "n-vllm-0", "model": "n", "engine": "vllm",
                               "gpu_indices": [0]}], FAST_ENGINE_ENV)
    deps = wait_for(lambda: [d for d in gearshift_json(ha, "fleet", "deployments")
                             if d["report"]["model"] == "n"
                             and d["report"]["phase"] == "DEPLOYMENT_PHASE_READY"], 60, "n ready")
    endpoint = deps[0]["report"]["endpoint"]
    _apply(ha, tmp_path, "stay", "auto", "vllm")

    def state(host: str) -> str:
        hosts = {h["host_id"]: h for h in gearshift_json(ha, "fleet", "hosts")}
        return str(hosts[host]["state"])

    before = {h["host_id"]: int(h.get("reports", 0)) for h in gearshift_json(ha, "fleet", "hosts")}
    with steady_load([(endpoint, "n")], rps=10) as load:
        ha.pause("host-c")
        try:
            wait_for(lambda: state("host-c") == "HOST_STATE_UNREACHABLE", 30,
                     "host-c marked unreachable")
            time.sleep(3)  # several policy intervals with the host unreachable
            assert gearshift_json(ha, "migrations", "list") == []
        finally:
            ha.resume("host-c")
        wait_for(lambda: state("host-c") == "HOST_STATE_CONNECTED", 30, "host-c rejoined")
    assert load.failed == 0  # its engine served throughout
    assert journal(ha, "host-c") == []  # no command was sent to it: nothing drained
    hosts = {h["host_id"]: h for h in gearshift_json(ha, "fleet", "hosts")}
    assert int(hosts["host-c"].get("reports", 0)) > before.get("host-c", 0)
    ready = [d for d in gearshift_json(ha, "fleet", "deployments") if d["report"]["model"] == "n"]
    assert [d["report"]["phase"] for d in ready] == ["DEPLOYMENT_PHASE_READY"]


def test_postgres_restart_under_load_loses_no_decision(tmp_path: Path) -> None:
    with LocalPostgres() as pg:
        fleet = make_fleet(tmp_path / "ha", pg.url)
        try:
            fleet.start_all(ARGS)
            start_moving_hosts(fleet)
            fleet.start_gateway()
            with gateway_load(fleet.gateway_url, "m") as load:
                _apply(fleet, tmp_path, "to-trt", "approve", "tensorrt-llm")
                pending = wait_for(lambda: [d for d in gearshift_json(fleet, "decisions", "list")
                                            if d["status"] == "proposed"], 60, "a proposed decision")
                decision = pending[0]["id"]
                pg.stop("immediate")  # as if the database crashed
                time.sleep(2 * fleet.lease_ttl_s)  # leaders step down; agents keep serving
                down = fleet.cli("decisions", "list")
                assert down.returncode != 0 and "Traceback" not in down.stderr
                pg.start()
                fleet.wait_leader(30)
                listed = wait_for(lambda: {d["id"]: d for d in
                                           gearshift_json(fleet, "decisions", "list")}, 30,
                                  "decisions readable again")
                assert listed[decision]["status"] == "proposed"  # kept across the restart
                approve = fleet.cli("decisions", "approve", decision)
                assert approve.returncode == 0, approve.stderr
                mig = wait_for(lambda: next(iter(gearshift_json(fleet, "migrations", "list")),
                                            None), 30, "the approved move")
                end = wait_for(lambda: ended(fleet, mig["id"]), 120, "the move to end")
                assert end["phase"] == "done", [(s["to_phase"], s["message"])
                                                for s in end["steps"]]
            assert load.failed == 0, load.errors[:5]
            hosts = gearshift_json(fleet, "fleet", "hosts")
            assert {h["host_id"]: h["state"] for h in hosts} == {
                "host-a": "HOST_STATE_CONNECTED", "host-b": "HOST_STATE_CONNECTED"}
            assert max(fleet.executions().values()) == 1
        finally:
            fleet.stop()


def _gauge(port: int, name: str, **labels: str) -> float | None:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} " if labels else f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_stale_leader_resuming_after_a_pause_is_fenced(ha: HaFleet, tmp_path: Path) -> None:
    from gearshift.devfleet.local_fleet import free_port

    ops = {name: free_port() for name in ha.names}
    for name in ha.names:
        ha.start_controller((*ARGS, "--metrics-listen", f"127.0.0.1:{ops[name]}"), name)
    start_moving_hosts(ha)
    ha.start_gateway()
    with gateway_load(ha.gateway_url, "m") as load:
        _apply(ha, tmp_path, "to-trt", "auto", "tensorrt-llm")
        mig = wait_for(lambda: _migration_in(ha, "canary"), 60, "the canary")
        old, epoch = ha.wait_leader()
        ha.pause(old)  # SIGSTOP: it still believes it leads when it wakes
        try:
            new, new_epoch = ha.wait_leader(30, not_name=old, min_epoch=epoch + 1)
        finally:
            ha.resume(old)

        def stepped_down() -> bool:
            st = ha.status(old)
            return st is not None and not st.leader and st.leader_id == new

        wait_for(stepped_down, 15, "the stale leader to step down")
        # Its fleet is a lapsed term's: it exports no hosts (the new leader's are counted
        # once, and its own would turn unreachable), and says it follows.
        wait_for(lambda: _gauge(ops[new], "gearshift_controller_hosts", state="connected") == 2,
                 30, "the new leader to count both hosts")
        wait_for(lambda: [_gauge(ops[old], "gearshift_controller_hosts", state=s)
                          for s in ("connected", "disconnected", "unreachable")] == [0, 0, 0],
                 30, "the stale leader to export no hosts")
        assert _gauge(ops[old], "gearshift_controller_is_leader") == 0.0
        assert _gauge(ops[new], "gearshift_controller_is_leader") == 1.0
        assert _gauge(ops[new], "gearshift_controller_leader_epoch") == new_epoch
        end = wait_for(lambda: ended(ha, mig["id"]), 90, "the move to end")
        assert end["phase"] == "done", [(s["to_phase"], s["message"]) for s in end["steps"]]
    assert load.failed == 0, load.errors[:5]
    assert ha.leader() == (new, new_epoch)
    # Fenced: on every agent, no command of the old epoch ran after one of the new.
    for host in ("host-a", "host-b"):
        epochs = [e["epoch"] for e in journal(ha, host)]
        assert epochs == sorted(epochs), (host, epochs)
    assert max(ha.executions().values()) == 1
    log = ha.procs[old].log()
    assert "no longer leads" in log


def test_leader_and_follower_are_both_ready_and_say_their_role(ha: HaFleet) -> None:
    import urllib.request

    from gearshift.devfleet.local_fleet import free_port

    ops = {name: free_port() for name in ha.names}
    for name in ha.names:
        ha.start_controller(("--metrics-listen", f"127.0.0.1:{ops[name]}"), name)
    leader, _epoch = ha.wait_leader()
    [follower] = [n for n in ha.names if n != leader]

    def readyz(name: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{ops[name]}/readyz", timeout=5) as r:
            return r.read().decode()

    assert readyz(leader).startswith("ready: leader, epoch")
    assert wait_for(lambda: readyz(follower) == f"ready: follower of {leader}\n", 15,
                    "the follower to know the leader")
