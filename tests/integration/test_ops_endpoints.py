"""/metrics, /healthz and /readyz of the controller and the agent on `--metrics-listen`,
read over HTTP as Prometheus or a probe would, through the agent losing its controller."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

from gearshift.devfleet.local_fleet import LocalFleet, free_port
from integration.helpers import FAST_ENGINE_ENV, wait_for

DEP = {"deployment_id": "m-vllm", "model": "m", "engine": "vllm", "source": "org/m",
       "revision": "r1", "gpu_indices": [0]}


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _value(metrics: str, name: str, **labels: str) -> float | None:
    for line in metrics.splitlines():
        if not line.startswith(name + ("{" if labels else " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_controller_and_agent_serve_probes_and_metrics(fleet: LocalFleet) -> None:
    fleet.start_controller(("--metrics-listen", "127.0.0.1:0"))
    controller = f"http://127.0.0.1:{fleet.metrics_port}"
    assert _get(f"{controller}/healthz") == (200, "ok\n")
    status, body = _get(f"{controller}/readyz")
    assert status == 200 and body.startswith("ready: leader, epoch")
    assert "gearshift_" in _get(f"{controller}/metrics")[1]

    port = free_port()
    fleet.start_agent("host-a", [DEP], FAST_ENGINE_ENV,
                      extra_args=("--metrics-listen", f"127.0.0.1:{port}"))
    agent = f"http://127.0.0.1:{port}"

    def engine_ready() -> str | None:
        text = _get(f"{agent}/metrics")[1]
        ok = _value(text, "gearshift_agent_engine_phase", deployment_id="m-vllm",
                    phase="ready") == 1.0 and _value(text, "gearshift_agent_reports_total") \
            and _value(text, "gearshift_agent_report_duration_seconds_count")
        return text if ok else None

    metrics = wait_for(engine_ready, 60, "the agent's metrics to show a ready engine")
    assert _value(metrics, "gearshift_agent_engine_phase", deployment_id="m-vllm",
                  phase="starting") == 0.0
    assert _value(metrics, "gearshift_agent_engine_restarts_total", deployment_id="m-vllm") == 0
    assert _value(metrics, "gearshift_agent_connected") == 1.0
    follows = re.search(r'gearshift_agent_controller_info\{address="([^"]+)",'
                        r'controller_id="([^"]+)"\} 1.0', metrics)
    assert follows is not None and follows.group(1) == fleet.controller_addr
    assert "gearshift_agent_metric_samples_skipped_total" in metrics  # scrape errors
    assert not re.search(r"token|BEGIN|PRIVATE", metrics, re.IGNORECASE)
    status, body = _get(f"{agent}/readyz")
    assert status == 200 and body.startswith("ready: connected to")

    # The controller goes away: the agent stays ready, fail static, its engine serving.
    fleet.procs.pop("controller").terminate()
    wait_for(lambda: _value(_get(f"{agent}/metrics")[1], "gearshift_agent_connected") == 0.0,
             30, "the agent to notice")
    status, body = _get(f"{agent}/readyz")
    assert (status, body) == (200, "ready: fail static: no controller stream; "
                                   "1 engine(s) ready\n")
    assert _get(f"{agent}/healthz")[0] == 200
