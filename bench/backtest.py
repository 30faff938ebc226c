"""Backtest quality and speed: the default policy against the hindsight optimum on every
shipped trace, and the runtime of a synthetic 28-day x 30-model trace.

Prints one JSON object. Usage: python bench/backtest.py [TRACES_DIR]
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from gearshift.policies.backtest import run_backtest
from gearshift.policies.loader import load_policy_file
from gearshift.policies.trace import Trace, parse_trace

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "policies" / "examples"
DEFAULT_TRACES = ROOT / "tests" / "unit" / "policies" / "traces"
SYNTH_DAYS = 28
SYNTH_MODELS = 30
STEP_S = 300


def synthetic_trace(days: int = SYNTH_DAYS, models: int = SYNTH_MODELS, seed: int = 1) -> Trace:
    """Diurnal traffic with noise, bursts and revisions, for a mixed fleet."""
    return parse_trace(synthetic_lines(days, models, seed), source="synthetic")


def synthetic_lines(days: int = SYNTH_DAYS, models: int = SYNTH_MODELS, seed: int = 1) -> list[str]:
    """The JSON lines (the trace format of docs/cost-model.md) of `synthetic_trace`."""
    rng = random.Random(seed)
    sizes = [(8, 10.0, 1.16, 1800, 150.0), (2, 18.0, 1.2, 900, 100.0), (1, 40.0, 0.95, 120, 60.0)]
    profiles, shapes = {}, {}
    for i in range(models):
        gpus, cap, gain, build, overhead = sizes[i % 3]
        name = f"model-{i:02d}"
        profiles[name] = {
            "gpus_per_replica": gpus, "min_replicas": 1, "sla_ttft_p99_ms": 1000.0,
            "capacity_rps": {"vllm": cap, "tensorrt-llm": round(cap * gain * rng.uniform(0.95, 1.05), 2)},
            "cold_start_s": {"vllm": 60 + 50 * gpus // 2, "tensorrt-llm": 75 + 60 * gpus // 2},
            "build_s": {"vllm": 0, "tensorrt-llm": build},
            "build_overhead_usd": {"vllm": 0.0, "tensorrt-llm": overhead},
            "ttft_p99_ms": {"vllm": 900.0, "tensorrt-llm": 780.0}, "initial_engine": "vllm"}
        shapes[name] = (rng.uniform(2, 200), rng.uniform(0, 0.5), rng.uniform(0, 5))
    head = {"kind": "header", "version": 1, "name": "synthetic-fleet", "start": "2026-03-02T00:00:00Z",
            "step_s": STEP_S, "price_per_gpu_hour": 4.0, "headroom": 0.2, "overlap_s": 600,
            "models": profiles}
    lines = [json.dumps(head)]
    for k in range(days * 86400 // STEP_S):
        t = 1_772_409_600 + k * STEP_S
        ts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
        day_phase = math.sin(2 * math.pi * (k * STEP_S % 86400) / 86400)
        for name, (level, swing, revs_per_week) in shapes.items():
            if rng.random() < revs_per_week / (7 * 86400 / STEP_S):
                lines.append(json.dumps({"kind": "revision", "ts": ts, "model": name, "revision": f"r{k}"}))
            burst = rng.uniform(2, 5) if rng.random() < 0.002 else 1.0
            rps = max(0.0, level * (1 + swing * day_phase) * rng.uniform(0.9, 1.1) * burst)
            lines.append(json.dumps({"kind": "traffic", "ts": ts, "model": name, "rps": round(rps, 3)}))
    return lines


def main(traces_dir: Path) -> dict[str, Any]:
    default = load_policy_file(str(EXAMPLES / "default.yaml"))
    expected = json.loads((traces_dir / "expected.json").read_text())
    from gearshift.policies.trace import read_trace
    per_trace = {}
    for name in sorted(expected):
        r = run_backtest(default, read_trace(traces_dir / f"{name}.jsonl.gz"))
        oracle = expected[name]["oracle"]
        per_trace[name] = {
            "cost_usd": r["summary"]["cost_usd"], "oracle_cost_usd": oracle["cost_usd"],
            "excess_vs_oracle": round(r["summary"]["cost_usd"] / oracle["cost_usd"] - 1, 5),
            "flaps": r["summary"]["flaps"], "oracle_flaps": oracle["flaps"],
            "sla_violation_min": r["summary"]["sla_violation_min"],
        }
    trace = synthetic_trace()
    t0 = time.perf_counter()
    run_backtest(default, trace)
    runtime = time.perf_counter() - t0
    return {"traces": per_trace,
            "synthetic": {"days": SYNTH_DAYS, "models": SYNTH_MODELS, "runtime_s": round(runtime, 2),
                          "target_s": 10}}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_TRACES)))
