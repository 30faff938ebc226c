"""Forecast quality: the sustained-level forecast against a same-time-last-week baseline.

For every trace (docs/cost-model.md: JSON Lines, gzipped or not) and every model in it, at
forecast origins every `--every-h` hours from day 7 on (while a whole horizon of
realised data follows), `forecast_rate` sees only the samples before the origin
and forecasts the rate's `q`-quantile (q = 0.1, the sustained level) for every
step of the next `--horizon-h` hours. Each step's forecast is scored with the
pinball loss at q against the realised rate of that step. The baseline predicts
each step with the realised rate of the same step one week earlier.

As the decision paths do (the blind backtest, the controller's forecasts), each
forecast of a model hands its fitted trees to the next origin's, which predicts
with them until a refit is due (`policies.forecast_model`); `--fresh` fits at every
origin instead. Each model's `fits` counts the fits.

Scores are means over all (origin, step) pairs of a model; a trace's score is the
mean over its models of the model's score divided by the model's mean rate (so a
large model does not drown the others); `improvement` = 1 - model / baseline.
Target: improvement >= 0.20 on every public trace.

Prints one JSON object. Usage: python bench/forecast.py [TRACES_DIR_OR_FILES...]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import numpy as np

from gearshift.policies.forecast import SECONDS_PER_WEEK, forecast_rate, pinball_loss
from gearshift.policies.forecast_model import SeasonalModel

DEFAULT_TRACES = Path("/work/shared/traces")
QUANTILE = 0.1
TARGET_IMPROVEMENT = 0.20


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def read_trace(path: Path) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(header, model -> (ts, rps)) from a trace file; revision lines are skipped."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    series: dict[str, tuple[list[float], list[float]]] = {}
    with opener(path, "rt", encoding="utf-8") as handle:
        stream: IO[str] = handle
        header = json.loads(stream.readline())
        if header.get("kind") != "header":
            raise SystemExit(f"{path}: first line is not a header")
        for number, line in enumerate(stream, start=2):
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("kind") != "traffic":
                continue
            try:
                ts, rps = _epoch(row["ts"]), float(row["rps"])
            except (KeyError, ValueError) as exc:
                raise SystemExit(f"{path}:{number}: bad traffic line: {exc}") from None
            times, rates = series.setdefault(row["model"], ([], []))
            times.append(ts)
            rates.append(rps)
    return header, {m: (np.array(t), np.array(r)) for m, (t, r) in series.items()}


def score_model(ts: np.ndarray, rps: np.ndarray, step_s: float, horizon_s: float,
                every_s: float, fresh: bool = False) -> dict[str, Any]:
    """Pinball losses of the model and of the last-week baseline over all origins."""
    order = np.argsort(ts)
    ts, rps = ts[order], rps[order]
    steps = round(horizon_s / step_s)
    week = round(SECONDS_PER_WEEK / step_s)
    start = ts[0]
    model_losses: list[float] = []
    base_losses: list[float] = []
    methods: dict[str, int] = {}
    fit_s = 0.0
    kept: SeasonalModel | None = None
    fits = 0
    origin = start + SECONDS_PER_WEEK
    while origin + horizon_s <= ts[-1] + step_s:
        first = int(np.searchsorted(ts, origin))
        window = slice(first, first + steps)
        actual = rps[window]
        earlier = slice(first - week, first - week + steps)
        if actual.size == steps and first - week >= 0:
            began = time.perf_counter()
            fc = forecast_rate(ts, rps, origin, horizon_s, step_s=step_s, quantile=QUANTILE,
                               defer_peak=True, kept=None if fresh else kept)
            fit_s += time.perf_counter() - began
            kept = fc.model
            fits += int(kept is not None and kept.fitted_at == origin)
            methods[fc.method] = methods.get(fc.method, 0) + 1
            if fc.path_low:
                # path_ts are bin starts; a sample belongs to the bin it falls in.
                index = np.clip(((ts[window] - origin) // (fc.path_ts[1] - fc.path_ts[0]
                                                           if len(fc.path_ts) > 1 else step_s))
                                .astype(int), 0, len(fc.path_low) - 1)
                predicted = np.asarray(fc.path_low)[index]
            else:
                predicted = np.full(steps, np.nan)
            model_losses.append(pinball_loss(actual, predicted, QUANTILE))
            base_losses.append(pinball_loss(actual, rps[earlier], QUANTILE))
        origin += every_s
    model = float(np.mean(model_losses)) if model_losses else float("nan")
    base = float(np.mean(base_losses)) if base_losses else float("nan")
    return {"origins": len(model_losses), "pinball_model": round(model, 4),
            "pinball_baseline": round(base, 4), "improvement": round(1 - model / base, 4),
            "mean_rps": round(float(np.mean(rps)), 3), "methods": methods,
            "fits": fits, "fit_s_per_origin": round(fit_s / max(1, len(model_losses)), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path, default=[DEFAULT_TRACES])
    parser.add_argument("--horizon-h", type=float, default=24.0)
    parser.add_argument("--every-h", type=float, default=6.0)
    parser.add_argument("--fresh", action="store_true",
                        help="fit the trees afresh at every origin (default: keep them between "
                             "origins and refit when due, as the decision paths do)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="worker processes (one model at a time each)")
    args = parser.parse_args(argv)
    files: list[Path] = []
    for entry in args.traces:
        files.extend(sorted(entry.glob("*.jsonl*")) if entry.is_dir() else [entry])
    result: dict[str, Any] = {"quantile": QUANTILE, "horizon_h": args.horizon_h,
                              "every_h": args.every_h, "fresh": args.fresh,
                              "target_improvement": TARGET_IMPROVEMENT,
                              "traces": {}}
    began = time.perf_counter()
    loaded = [read_trace(path) for path in files]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [{m: pool.submit(score_model, ts, rps, float(header["step_s"]),
                                   args.horizon_h * 3600, args.every_h * 3600, args.fresh)
                    for m, (ts, rps) in series.items()} for header, series in loaded]
        scores = [{m: f.result() for m, f in per_trace.items()} for per_trace in futures]
    for (path, (header, series)), per_model in zip(zip(files, loaded, strict=True), scores,
                                                    strict=True):
        scored = [s for s in per_model.values() if s["origins"]]
        model = float(np.mean([s["pinball_model"] / s["mean_rps"] for s in scored]))
        base = float(np.mean([s["pinball_baseline"] / s["mean_rps"] for s in scored]))
        result["traces"][header.get("name", path.name)] = {
            "models": len(series), "origins": sum(s["origins"] for s in scored),
            "pinball_model": round(model, 5), "pinball_baseline": round(base, 5),
            "improvement": round(1 - model / base, 4), "per_model": per_model}
    improvements = [t["improvement"] for t in result["traces"].values()]
    result["overall"] = {
        "traces": len(improvements),
        "mean_improvement": round(float(np.mean(improvements)), 4) if improvements else None,
        "min_improvement": min(improvements) if improvements else None,
        "meets_target": bool(improvements) and min(improvements) >= TARGET_IMPROVEMENT,
        "wall_s": round(time.perf_counter() - began, 1)}
    json.dump(result, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
