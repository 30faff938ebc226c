"""Fleet telemetry end to end: controller and two agents as real processes, engines
emulated, everything over loopback; the CLI is run as a person would run it."""

from __future__ import annotations

import contextlib
import json
import urllib.request

import pytest

from gearshift.devfleet.local_fleet import LocalFleet
from integration.helpers import FAST_ENGINE_ENV, gearshift, gearshift_json, steady_load, wait_for

VLLM_DEP = {"deployment_id": "m1-vllm", "model": "m1", "engine": "vllm", "source": "org/m1",
            "revision": "r1", "gpu_indices": [0]}
TRT_DEP = {"deployment_id": "m2-trt", "model": "m2", "engine": "tensorrt-llm",
           "backend": "pytorch", "source": "org/m2", "revision": "r4", "gpu_indices": [0]}


def _complete(endpoint: str, model: str, n: int = 5) -> None:
    for _ in range(n):
        body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 4}).encode()
        req = urllib.request.Request(f"{endpoint}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
            json.loads(resp.read())


def _deployments(fleet: LocalFleet) -> dict[str, dict]:
    return {d["report"]["deployment_id"]: d for d in gearshift_json(fleet, "fleet", "deployments")}


def _all_ready(fleet: LocalFleet, ids: set[str]) -> dict[str, dict] | None:
    deps = _deployments(fleet)
    if ids <= set(deps) and all(deps[i]["report"]["phase"] == "DEPLOYMENT_PHASE_READY" for i in ids):
        return deps
    return None


def _start_two_hosts(fleet: LocalFleet) -> dict[str, dict]:
    fleet.start_controller()
    fleet.start_agent("host-a", [VLLM_DEP], FAST_ENGINE_ENV)
    fleet.start_agent("host-b", [TRT_DEP], FAST_ENGINE_ENV)
    return wait_for(lambda: _all_ready(fleet, {"m1-vllm", "m2-trt"}), 60, "both deployments ready")


def test_cli_shows_hosts_and_deployments_with_live_figures(fleet: LocalFleet) -> None:
    deps = _start_two_hosts(fleet)
    targets = [(deps[i]["report"]["endpoint"], deps[i]["report"]["served_model_name"])
               for i in ("m1-vllm", "m2-trt")]

    def live() -> dict[str, dict] | None:
        d = _deployments(fleet)
        ok = all(d[i]["report"]["metrics_present"] and d[i]["report"]["ttft"]["present"]
                 for i in ("m1-vllm", "m2-trt"))
        return d if ok else None

    with steady_load(targets) as load:
        deps = wait_for(live, 30, "latency figures from both engines' own metrics")
    assert load.failed == 0
    for dep_id in ("m1-vllm", "m2-trt"):
        r = deps[dep_id]["report"]
        assert r["ttft"]["p99_s"] > 0 and r["request_rate"] > 0
        assert r["engine_version"]
    assert deps["m1-vllm"]["host_id"] == "host-a" and deps["m2-trt"]["host_id"] == "host-b"

    hosts = {h["host_id"]: h for h in gearshift_json(fleet, "fleet", "hosts")}
    assert set(hosts) == {"host-a", "host-b"}
    assert all(h["state"] == "HOST_STATE_CONNECTED" for h in hosts.values())
    assert len(hosts["host-a"]["gpus"]) == 4 and hosts["host-a"]["emulated_gpus"]

    status = gearshift_json(fleet, "fleet", "status")
    assert status["hosts_connected"] == 2 and status["deployments_ready"] == 2
    assert status["store"] == "sqlite"

    table = gearshift(fleet, "fleet", "deployments").stdout
    assert "m1-vllm" in table and "m2-trt" in table and "ready" in table
    models = {m["model"]: m for m in gearshift_json(fleet, "fleet", "models")}
    assert models["m1"]["engines"] == ["vllm"] and models["m2"]["engines"] == ["tensorrt-llm"]

    def scrape() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{fleet.metrics_port}/metrics").read().decode()

    assert "gearshift_controller_reports_total" in scrape()
    # Host gauges are refreshed on a timer, not per report: wait for the next refresh.
    wait_for(lambda: 'gearshift_controller_hosts{state="connected"} 2.0' in scrape(), 30,
             "the connected-hosts gauge")


def test_killed_engine_is_restarted_and_shown(fleet: LocalFleet) -> None:
    deps = _start_two_hosts(fleet)
    endpoint = deps["m1-vllm"]["report"]["endpoint"]
    req = urllib.request.Request(f"{endpoint}/emulator/faults", data=b'{"crash": true}',
                                 headers={"Content-Type": "application/json"})
    with contextlib.suppress(OSError):  # the engine may die before it answers
        urllib.request.urlopen(req, timeout=5)

    def restarted() -> dict | None:
        r = _deployments(fleet)["m1-vllm"]["report"]
        return r if r["restarts"] >= 1 and r["phase"] == "DEPLOYMENT_PHASE_READY" else None

    r = wait_for(restarted, 40, "the crashed engine restarted and ready again")
    _complete(r["endpoint"], "m1", n=2)
    assert _deployments(fleet)["m2-trt"]["report"]["restarts"] == 0


def test_controller_away_engines_keep_serving_and_agents_reconnect(fleet: LocalFleet) -> None:
    deps = _start_two_hosts(fleet)
    before = gearshift_json(fleet, "fleet", "status")
    fleet.procs.pop("controller").terminate()

    # Fail static: with no controller the engines keep serving.
    for dep_id in ("m1-vllm", "m2-trt"):
        r = deps[dep_id]["report"]
        _complete(r["endpoint"], r["served_model_name"], n=3)
    assert gearshift(fleet, "fleet", "status", check=False).returncode == 5  # unavailable

    fleet.start_controller()  # same port, same data directory
    after = wait_for(lambda: (s := gearshift_json(fleet, "fleet", "status"))["hosts_connected"] == 2
                     and s["deployments_ready"] == 2 and s, 40, "agents reconnected")
    assert int(after["epoch"]) == int(before["epoch"]) + 1
    now = _deployments(fleet)
    for dep_id in ("m1-vllm", "m2-trt"):
        # Same engines, not restarted: they ran on while the controller was away.
        assert now[dep_id]["report"]["endpoint"] == deps[dep_id]["report"]["endpoint"]
        assert now[dep_id]["report"]["restarts"] == 0


def test_bad_agent_config_fails_at_start_naming_the_field(fleet: LocalFleet, tmp_path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("host_id: h1\nreport_interval_s: -3\nengines:\n  vllm:\n    executable: [vllm]\n"
                   "    colour: blue\n")
    proc = gearshift(fleet, "agent", "--config", str(cfg), check=False)
    assert proc.returncode != 0
    assert "report_interval_s" in proc.stderr and "-3" in proc.stderr
    assert "engines.vllm.colour: unknown key" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,needle", [
    (("controller", "--listen", "nohostport"), "--listen: expected HOST:PORT"),
    (("controller", "--listen", "127.0.0.1:0", "--report-interval", "0"), "--report-interval"),
])
def test_bad_controller_options_fail_clearly(fleet: LocalFleet, tmp_path, args, needle) -> None:
    proc = gearshift(fleet, *args, "--data-dir", str(tmp_path / "d"), check=False)
    assert proc.returncode != 0
    assert needle in proc.stderr and "Traceback" not in proc.stderr
