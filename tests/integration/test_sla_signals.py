"""The SLA signals end to end: an emulated vLLM's own metric names, read by the agent,
carried in its reports, shown by `gearshift fleet deployments -o wide`, rolled up per
minute and exported by the controller's /metrics."""

from __future__ import annotations

import re
import urllib.request

from gearshift.devfleet.local_fleet import LocalFleet
from integration.helpers import FAST_ENGINE_ENV, gearshift, gearshift_json, steady_load, wait_for

DEP = {"deployment_id": "s1-vllm", "model": "s1", "engine": "vllm", "source": "org/s1",
       "revision": "r1", "gpu_indices": [0]}


def _report(fleet: LocalFleet) -> dict | None:
    for d in gearshift_json(fleet, "fleet", "deployments"):
        if d["report"]["deployment_id"] == "s1-vllm":
            return d["report"]
    return None


def test_signals_reach_the_cli_and_the_controller_metrics(fleet: LocalFleet) -> None:
    fleet.start_controller()
    fleet.start_agent("host-a", [DEP], FAST_ENGINE_ENV)
    ready = wait_for(lambda: (r := _report(fleet)) and r["phase"] == "DEPLOYMENT_PHASE_READY"
                     and r, 60, "the deployment ready")
    target = [(ready["endpoint"], ready["served_model_name"])]

    def measured() -> dict | None:
        r = _report(fleet)
        return r if r and r["queue_time"]["present"] and "prefix_cache_hit_rate" in r else None

    def scrape() -> str:
        url = f"http://127.0.0.1:{fleet.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()

    def exported() -> str | None:
        text = scrape()
        return text if queue_p99.search(text) else None

    queue_p99 = re.compile(r'gearshift_controller_sla_queue_time_seconds\{engine="vllm",'
                           r'model="s1",quantile="0.99"\} [0-9.e+-]+')
    with steady_load(target) as load:
        r = wait_for(measured, 30, "queue time and prefix-cache figures in the report")
        # A minute's rollup is exported once the minute is complete (plus its lateness).
        metrics = wait_for(exported, 150, "the SLA gauges of a complete minute")
    assert load.failed == 0
    assert r["sleep_state"] == "ENGINE_SLEEP_STATE_AWAKE"
    assert 0.0 <= r["prefix_cache_hit_rate"] <= 1.0
    assert int(r["kv_blocks_total"]) > 0 and r["mean_generation_tokens"] > 0
    assert r["preemptions_per_s"] == 0.0
    assert 'gearshift_controller_sla_sleeping_replicas{engine="vllm",model="s1"} 0.0' in metrics
    assert 'gearshift_controller_sla_kv_blocks{engine="vllm",model="s1",state="total"}' in metrics

    wide = gearshift(fleet, "fleet", "deployments", "-o", "wide").stdout
    for column in ("queue p99", "prefix hit", "sleep", "kv blocks"):
        assert column in wide, (column, wide)
    assert "awake" in wide
    assert "queue p99" not in gearshift(fleet, "fleet", "deployments").stdout
