"""Blind backtest quality: the default policy learning capacity from simulated latency
(`gearshift policy backtest --blind`) against the hindsight oracle of `expected.json`,
with the non-blind (header capacities) figures beside it.

Target: on every public trace the blind cost is within 3% of the oracle, with no
more flaps than the oracle. Blind runs also fit the policy's rate forecast (once a
day per model, as the traffic level of the savings estimate): most of
`blind_runtime_s`. Prints one JSON object.
Usage: python bench/blind.py [TRACES_DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces_dir", nargs="?", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(evaluate(args.traces_dir, seed=args.seed)))


if __name__ == "__main__":
    main()
