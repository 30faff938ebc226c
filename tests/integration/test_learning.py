"""What the controller learns, as a person reads it from the CLI: capacity per engine
at the SLA (table, JSON, PNG) and the request-rate forecast."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gearshift.controller.server import Controller, ControllerConfig
from gearshift.controller.store.tables import RollupRow

POLICY = """\
apiVersion: gearshift.dev/v1
kind: EnginePolicy
metadata: {name: learn}
spec:
  mode: dry-run
  rules: [{name: cost, kind: expected-savings}]
  models:
    m: {slaTtftP99Ms: 1000, engines: {tensorrt-llm: {capacityRps: 12}}}
"""


@pytest.fixture
async def controller(tmp_path: Path) -> AsyncIterator[Controller]:
    ctl = Controller(ControllerConfig(listen="127.0.0.1:0", data_dir=tmp_path / "d",
                                      report_interval_s=1.0, history_resolution_s=300))
    await ctl.start()
    ctl.term.policies.apply(POLICY, "learn.yaml", "test", "")
    try:
        yield ctl
    finally:
        await ctl.stop(0.1)


async def _cli(ctl: Controller, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gearshift.cli.main", "--controller", f"127.0.0.1:{ctl.port}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


def _minutes(capacity: float) -> list[RollupRow]:
    """One replica on vLLM at loads from 10% to 130% of capacity; p99 TTFT crosses 1 s at it."""
    rows = []
    for i in range(60):
        load = capacity * (0.1 + 1.2 * i / 59)
        ttft = 0.1 + 0.9 * (load / capacity) ** 4
        rows.append(RollupRow(model="m", engine="vllm", engine_version="0.11.0",
                              gpu_model="NVIDIA H100", minute=datetime.fromtimestamp(60 * i, UTC),
                              reports=6, replicas=1, request_rate_mean=load, request_rate_max=load,
                              ttft_p99_s=ttft, itl_p99_s=0.02))
    return rows


async def test_capacity_is_learned_persisted_and_shown(controller: Controller, tmp_path: Path) -> None:
    assert controller.term.learner.observe(_minutes(10.0)) == 60
    controller.term.learner.save()
    png = tmp_path / "cap.png"
    code, out, err = await _cli(controller, "models", "capacity", "m", "-o", "json", "--plot", str(png))
    assert code == 0, err
    data = json.loads(out)
    (vllm,) = data["estimates"]
    assert vllm["key"]["engine"] == "vllm" and vllm["status"] == "ok"
    assert math.isclose(vllm["capacity_rps"], 10.0, rel_tol=0.1)
    assert vllm["low"] <= vllm["capacity_rps"] <= vllm["high"]
    assert data["priors"]["engines"]["tensorrt-llm"]["capacityRps"] == 12
    assert png.stat().st_size > 1000
    code, table, _ = await _cli(controller, "models", "capacity", "m")
    assert "vllm" in table and "ok" in table

    # Persisted: a second learner over the same store knows the same.
    from gearshift.controller.decisions.learning import CapacityLearner

    again = CapacityLearner(controller.persistence.store)
    again.load()
    assert [len(m) for m in again.for_model("m")] == [60]


async def test_forecast_from_the_rate_history(controller: Controller, tmp_path: Path) -> None:
    step = 300.0
    for k in range(12 * 24 * 4):  # four days of a daily cycle
        ts = 1_700_000_000 + k * step
        controller.term.history.sample(ts, {"m": 50 + 30 * math.sin(2 * math.pi * (ts % 86400) / 86400)})
    png = tmp_path / "fc.png"
    code, out, err = await _cli(controller, "models", "forecast", "m", "-o", "json", "--plot", str(png))
    assert code == 0, err
    fc = json.loads(out)
    assert fc["status"] == "ok" and fc["method"] == "seasonal-gbm"
    assert 15 <= fc["sustained_rps"] <= 50 and 60 <= fc["peak_rps"] <= 95
    # The forecast's fields, with its per-bin paths over the 24 h horizon at 5-minute bins.
    assert list(fc) == ["model", "samples", "status", "method", "sustained_rps", "peak_rps",
                        "horizon_s", "quantile", "reason", "points", "path_ts", "path_low",
                        "path_high"]
    assert [len(fc[k]) for k in ("path_ts", "path_low", "path_high")] == [288] * 3
    assert fc["path_ts"][0] == 1_700_000_000 + 12 * 24 * 4 * step
    assert png.stat().st_size > 1000
    code, _, err = await _cli(controller, "models", "forecast", "nope")
    assert code == 3 and "no request-rate history" in err
