"""Blind backtest quality: the default policy learning capacity from simulated latency
(`gearshift policy backtest --blind`) against the hindsight oracle of `expected.json`,
with the non-blind (header capacities) figures beside it.

Targets: on every public trace the blind cost is within 3% of the oracle, with no
more flaps than the oracle; and a fleet of 30 models x 28 days (the generated trace
of bench/backtest.py) backtests blind in at most FLEET_TARGET_S, measured on the
command itself (`gearshift policy backtest POLICY --trace T -o json [--blind]`, a
child process: wall and CPU seconds, CPU being the figure a busy host distorts
least), plain beside it. Blind runs also fit the policy's rate forecast (once a day
per model, as the traffic level of the savings estimate; the peak model only when a
decision cites it): most of their runtime.
Prints one JSON object.
Usage: python bench/blind.py [TRACES_DIR] [--seed N] [--fleet-only] [--fleet-days D]
       [--fleet-models M] [--keep-trace PATH]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gearshift.policies.backtest import run_backtest
from gearshift.policies.loader import load_policy_file
from gearshift.policies.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_POLICY = ROOT / "policies" / "examples" / "default.yaml"
DEFAULT_TRACES = ROOT / "tests" / "unit" / "policies" / "traces"
TARGET_EXCESS = 0.03
FLEET_TARGET_S = 10.0  # blind backtest of the generated fleet, CPU seconds of the command


def _figures(r: dict[str, Any], oracle: dict[str, Any]) -> dict[str, Any]:
    s = r["summary"]
    return {"cost_usd": s["cost_usd"],
            "excess_vs_oracle": round(s["cost_usd"] / oracle["cost_usd"] - 1, 5),
            "flaps": s["flaps"], "sla_violation_min": s["sla_violation_min"],
            "switches": sum(len(m["switches"]) for m in r["models"].values())}


def evaluate(traces_dir: Path, names: list[str] | None = None, *, seed: int = 0,
             policy_path: Path = DEFAULT_POLICY) -> dict[str, Any]:
    """Per trace: blind and non-blind figures against the oracle, and the verdict."""
    policy = load_policy_file(str(policy_path))
    expected = json.loads((traces_dir / "expected.json").read_text())
    per_trace: dict[str, Any] = {}
    for name in names or sorted(expected):
        trace = read_trace(traces_dir / f"{name}.jsonl.gz")
        oracle = expected[name]["oracle"]
        t0 = time.perf_counter()
        blind = run_backtest(policy, trace, blind=True, seed=seed)
        runtime = time.perf_counter() - t0
        b = _figures(blind, oracle)
        per_trace[name] = {
            "oracle_cost_usd": oracle["cost_usd"], "oracle_flaps": oracle["flaps"],
            "oracle_sla_violation_min": oracle["sla_violation_min"],
            "blind": b, "non_blind": _figures(run_backtest(policy, trace), oracle),
            "blind_runtime_s": round(runtime, 2),
            "meets_target": b["excess_vs_oracle"] <= TARGET_EXCESS and b["flaps"] <= oracle["flaps"],
        }
    return {"policy": policy.name, "seed": seed, "target_excess": TARGET_EXCESS,
            "traces": per_trace,
            "all_meet_target": all(t["meets_target"] for t in per_trace.values()),
            "worst_blind_excess": max((t["blind"]["excess_vs_oracle"] for t in per_trace.values()),
                                      default=None)}


def _synthetic_lines(days: int, models: int) -> list[str]:
    spec = importlib.util.spec_from_file_location("bench_backtest",
                                                  Path(__file__).with_name("backtest.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines: list[str] = module.synthetic_lines(days, models)
    return lines


def _timed_cli(args: list[str]) -> tuple[dict[str, Any], dict[str, float]]:
    """Run the CLI in a child process: (its JSON output, wall and CPU seconds)."""
    before = os.times()
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "gearshift.cli.main", *args], capture_output=True,
                         text=True, check=False)
    wall = time.perf_counter() - t0
    after = os.times()
    if out.returncode != 0:
        raise SystemExit(f"bench: {' '.join(args)} failed:\n{out.stderr}")
    cpu = (after.children_user - before.children_user) + (after.children_system
                                                          - before.children_system)
    return json.loads(out.stdout), {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def fleet(days: int, models: int, *, keep_trace: Path | None = None,
          policy_path: Path = DEFAULT_POLICY) -> dict[str, Any]:
    """The generated fleet backtested by the CLI, plain and blind: runtime and figures."""
    with tempfile.TemporaryDirectory(prefix="gearshift-blind-") as tmp:
        path = keep_trace or Path(tmp) / "fleet.jsonl.gz"
        with gzip.open(path, "wt") as f:
            f.write("\n".join(_synthetic_lines(days, models)) + "\n")
        base = ["policy", "backtest", str(policy_path), "--trace", str(path), "-o", "json"]
        plain, plain_t = _timed_cli(base)
        blind, blind_t = _timed_cli([*base, "--blind"])
    return {"days": days, "models": models, "target_s": FLEET_TARGET_S,
            "plain": {**plain_t, "summary": plain["summary"]},
            "blind": {**blind_t, "summary": blind["summary"],
                      "switches": sum(len(m["switches"]) for m in blind["models"].values())},
            "meets_target": blind_t["cpu_s"] <= FLEET_TARGET_S}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces_dir", nargs="?", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fleet-only", action="store_true", help="only the generated fleet's runtime")
    ap.add_argument("--fleet-days", type=int, default=28)
    ap.add_argument("--fleet-models", type=int, default=30)
    ap.add_argument("--keep-trace", type=Path, help="write the generated fleet trace here")
    args = ap.parse_args()
    if args.fleet_days < 1 or args.fleet_models < 1:
        ap.error("--fleet-days and --fleet-models must be positive")
    from machine import MachineWatch  # bench/machine.py; here, as tests import this file

    watch = MachineWatch()
    out = {} if args.fleet_only else evaluate(args.traces_dir, seed=args.seed)
    out["fleet"] = fleet(args.fleet_days, args.fleet_models, keep_trace=args.keep_trace)
    out["machine"] = watch.result()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
