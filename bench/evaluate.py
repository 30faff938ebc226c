"""Policy evaluation at fleet scale: one full tick of the default policy over N models,
through the controller's own code (`PolicyLoop.evaluate`: signals, forecast,
capacity, decide, storing decisions).

    python bench/evaluate.py --models 10000

The fleet is built the way a running controller holds it:
- a real store (SQLite in a temp dir, migrated) with the policy applied, two
  published revisions per model, each model's time on its engine (`model_tenure`, as
  earlier ticks stored it: the tick stores only what changes), and each model's
  capacity observations stored as the learner persists them (`capacity/<label>`
  settings, read back by `CapacityLearner.load`, as at start-up);
- agents' hellos and reports in `FleetState`: hosts of 8 GPUs with one ready
  deployment per model (vLLM and TensorRT-LLM alternately), with metrics and p99s;
- the fleet's GPU price (`--gpu-price-per-hour`, default 4 USD, as the controller's
  flag gives it; 0: none), so that the tick estimates the cost of every move as a
  live controller with a priced fleet does;
- the rate history of the controller keeps (`--history-days`, default 8: its retention) at
  `--resolution-s` (default 300 s), a daily cycle with noise per model, loaded into the
  controller's `RateHistory` in bulk (`RateHistory.extend`, as seeding does).

The set-up writes in bulk (one transaction per thousand capacity settings, one insert
for every revision), so a fleet of 10,000 models is built in about a minute.

The process runs under the controller's garbage-collector settings
(`controller.gc_policy`: start-up objects frozen, no automatic full collections), as
the controller does. Then one evaluation tick is timed (wall and CPU), with the resident memory added
by the whole fleet (`rss_mb`: over the process before the fleet was built, both
after a collection and malloc_trim, so that the set-up's freed garbage is not
counted).
Targets: tick_s <= 1 s and rss_mb <= 300 MB at 10,000 models. Measured (docs/performance.md,
"One policy tick", on two cores shared with other work, where a Python loop of 1e7
additions takes 0.54 to 0.87 s): tick_s 0.60 to 0.64 (the tick without garbage
collection, in pairs with the code before: 0.65 to 0.86), rss_mb 211 to 218 (the rate
history keeps float32 rates).
Prints one JSON
object: models, tick_s, tick_cpu_s, per_model_us, rss_mb, decisions, the price and
priors it ran with, what the forecast worker (as the controller runs it, on its own
thread after the tick) fitted in the WORKER_SAMPLE_S after the tick (forecast_fits,
forecast_fit_cpu_s a fit, forecast_cycle_h: the hours in which it refits every model
at its CPU share), setup_s, and the targets. scikit-learn (the forecast's code) is
imported before the first memory reading: code, not fleet.

The worker's cache of forecasts (`Forecaster`: each model's latest forecast with its
kept trees) fills only over its cycle, hours at this size, so `rss_mb` holds almost
none of it. `forecast_cache_mb` is its steady state at N models, measured apart:
`CACHE_SAMPLE` models' forecasts over the policy's horizon and quantile made as the
worker makes them (`Forecaster`, from the same history) and the memory they keep
traced (tracemalloc), times N / sample (`forecast_cache_kb_per_model`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import random
import sys
import tempfile
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
from machine import MachineWatch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_POLICY = ROOT / "policies" / "examples" / "default.yaml"
TARGET_TICK_S = 1.0
TARGET_RSS_MB = 300.0
GPUS_PER_HOST = 8
DEFAULT_GPU_PRICE_PER_HOUR = 4.0  # USD: the fleet's price, as `--gpu-price-per-hour` gives it
# Appended to the policy (`--priors`): what an operator adds to the default policy so that
# its cost rule can price moves (without them no model has a capacity and a cold start
# on both engines, and nothing is estimated): each engine's cold start and build (a
# move's switch cost), and either each engine's capacity (`capacity`) or an SLA to
# measure capacity at (`sla`: the learner's estimates from the stored observations, a
# bootstrap of the latency curve per model, cached until the model is observed again).
PRIORS = {
    "capacity": "vllm: {coldStart: 210s, capacityRps: 10}\n"
                "        tensorrt-llm: {coldStart: 240s, build: 30m, capacityRps: 11.6}",
    "sla": "vllm: {coldStart: 210s}\n"
           "        tensorrt-llm: {coldStart: 240s, build: 30m}",
}
SLA_LINE = "      slaTtftP99Ms: 1000\n"


def _policy_text(path: Path, priors: str) -> str:
    if priors == "none":
        return path.read_text()
    return (path.read_text() + '\n  models:\n    "*":\n' + (SLA_LINE if priors == "sla" else "")
            + "      engines:\n        " + PRIORS[priors] + "\n")


WORKER_SAMPLE_S = 5.0  # after the tick: how long the forecast worker is watched
CACHE_SAMPLE = 50  # models whose cached forecasts are measured (`forecast_cache_mb`)
CAPACITY_POINTS = 120  # stored capacity observations per model (load bins x newest)


def _deployment(i: int, rate: float, rng: random.Random) -> Any:
    from gearshift.v1 import agent_pb2

    d = agent_pb2.DeploymentReport(
        deployment_id=f"dep-{i}", engine="vllm" if i % 2 else "tensorrt-llm",
        engine_version="0.11.0", model=f"model-{i:05d}", revision="r2",
        phase=agent_pb2.DEPLOYMENT_PHASE_READY, endpoint=f"http://10.0.{i // 250}.{i % 250}:8000",
        request_rate=rate, running_requests=rng.randint(0, 64), waiting_requests=0,
        tensor_parallel_size=1, metrics_present=True)
    d.gpu_indices.append(i % GPUS_PER_HOST)
    for q, p99 in ((d.ttft, 0.4), (d.itl, 0.03), (d.e2e, 4.0)):
        q.present, q.p50_s, q.p99_s, q.mean_s, q.count = True, p99 / 3, p99, p99 / 2, 100
    return d


def _fleet(models: int, rates: list[float], now: float) -> Any:
    from gearshift.controller.ingest.fleet import FleetState
    from gearshift.v1 import agent_pb2

    fleet = FleetState(clock=lambda: now)
    rng = random.Random(5)
    for h in range(math.ceil(models / GPUS_PER_HOST)):
        hello = agent_pb2.Hello(host_id=f"host-{h:05d}", agent_version="bench",
                                protocol_version=agent_pb2.PROTOCOL_VERSION_1)
        for g in range(GPUS_PER_HOST):
            hello.gpus.add(index=g, model="NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30)
        fleet.hello(hello, 10.0)
        report = agent_pb2.Report(seq=1, interval_s=10.0)
        report.deployments.extend(_deployment(i, rates[i], rng) for i in
                                  range(h * GPUS_PER_HOST, min(models, (h + 1) * GPUS_PER_HOST)))
        fleet.report(hello.host_id, report)
    return fleet


def _history(models: int, levels: list[float], now: float, days: float,
             resolution_s: float) -> Any:
    import numpy as np

    from gearshift.controller.ingest.rate_history import RateHistory

    history = RateHistory(resolution_s)
    rng = np.random.default_rng(11)
    steps = int(days * 86400 / resolution_s)
    ts = now - resolution_s * np.arange(steps, 0, -1, dtype=np.float64)
    day = 1 + 0.4 * np.sin(2 * np.pi * (ts % 86400) / 86400)
    for i in range(models):  # loaded at once, as a restarted controller seeds it
        history.extend(f"model-{i:05d}", ts, levels[i] * day * rng.uniform(0.9, 1.1, steps))
    return history


def _capacity(store: Any, models: int, levels: list[float], now: float) -> None:
    """Each model's serving engine observed over a range of loads, stored as the learner
    persists it (a model never measured on its other engine: priors fill that one)."""
    from gearshift.controller.decisions.learning import SETTING_PREFIX
    from gearshift.policies.capacity import CapacityKey, CapacityModel, LoadObservation

    rng = random.Random(17)
    settings: dict[str, Any] = {}
    for i in range(models):
        engine, cap = ("vllm" if i % 2 else "tensorrt-llm"), levels[i] * 1.4
        key = CapacityKey(f"model-{i:05d}", engine, "0.11.0", "NVIDIA H100 80GB HBM3")
        model = CapacityModel(key)
        for k in range(CAPACITY_POINTS):  # one completed rollup minute each, as `observe` feeds
            load = cap * rng.uniform(0.3, 0.85)
            model.add(LoadObservation(
                ts=now - (CAPACITY_POINTS - k) * 60 + 60.0, rps_per_replica=load,
                ttft_p99_s=0.3 * (1 - load / (1.25 * cap)) ** -1.5 * rng.lognormvariate(0, 0.05),
                itl_p99_s=None))
        settings[f"{SETTING_PREFIX}{key.label()}"] = model.to_dict()
        if len(settings) >= 1_000:
            store.set_settings(settings)
            settings = {}
    store.set_settings(settings)


def _revisions(store: Any, models: int, now: float) -> None:
    from gearshift.controller.store.tables import RevisionRow

    table = RevisionRow.__table__  # type: ignore[attr-defined]
    values = [{"model": f"model-{i:05d}", "revision": f"r{r}", "source": "bench",
               "published_at": datetime.fromtimestamp(now - (10 - 4 * r) * 86400, UTC)}
              for i in range(models) for r in (1, 2)]
    with store.engine.begin() as conn:
        conn.execute(table.insert(), values)


def _tenures(decisions: Any, models: int, since_ts: float) -> None:
    """Each model on its engine since `since_ts`, stored as earlier ticks left it."""
    since = datetime.fromtimestamp(since_ts, UTC)
    decisions.set_tenures({f"model-{i:05d}": ("vllm" if i % 2 else "tensorrt-llm", since)
                           for i in range(models)})


def _live_rss(proc: psutil.Process) -> int:
    """Resident bytes once freed memory went back to the OS: the set-up's garbage (rows,
    documents) is freed but would otherwise stay in the allocator's arenas."""
    gc.collect()
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(proc.memory_info().rss)


def _loop_lag_ms(window_s: float, interval_s: float = 0.05) -> dict[str, float]:
    """p50, p99 and max of how late an asyncio timer of `interval_s` fired, over
    `window_s` (the controller's LoopLagProbe, read directly)."""
    import asyncio

    async def probe() -> list[float]:
        loop = asyncio.get_running_loop()
        lags: list[float] = []
        end = loop.time() + window_s
        while loop.time() < end:
            due = loop.time() + interval_s
            await asyncio.sleep(interval_s)
            lags.append(max(0.0, loop.time() - due))
        return lags

    lags = sorted(asyncio.run(probe()))
    pick = lambda q: lags[min(len(lags) - 1, int(q * len(lags)))] * 1000  # noqa: E731
    return {"p50": round(pick(0.5), 2), "p99": round(pick(0.99), 2),
            "max": round(lags[-1] * 1000, 2), "samples": len(lags)}


def _forecast_cache_bytes(history: Any, resolution_s: float, now: float, models: list[str],
                          horizon_s: float, quantile: float) -> float:
    """The memory a forecast cache keeps per model: `models` forecast as the worker
    forecasts them (after one, so that what the first fit loads is not counted)."""
    from gearshift.controller.decisions.learning import Forecaster

    def fill(names: list[str]) -> Forecaster:
        cache = Forecaster(history.arrays, resolution_s, clock=lambda: now)
        cache.refresh(names, now, horizon_s=horizon_s, quantile=quantile, budget_s=math.inf)
        return cache

    fill(models[:1])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = fill(models)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del cache
    return kept / len(models)


def run(models: int, days: float, resolution_s: float, policy_path: Path,
        gpu_price_per_hour: float | None, priors: str = "capacity") -> dict[str, Any]:
    from gearshift.controller.decisions.learning import (
        FORECAST_WORKER_CPU_SHARE,
        CapacityLearner,
        Forecaster,
    )
    from gearshift.controller.decisions.policy_loop import PolicyLoop
    from gearshift.controller.decisions.store import DecisionStore
    from gearshift.controller.gc_policy import GcPolicy
    from gearshift.controller.store.database import Store, default_sqlite_url
    from gearshift.policies import forecast, quantile_trees  # noqa: F401  (the fits: code)

    proc = psutil.Process()
    rss0 = _live_rss(proc)  # the code is imported: what follows is the fleet's
    # The controller's garbage-collector settings, installed at its start-up as here: no
    # allocation-driven full collections walking the whole fleet in the middle of a tick.
    gc_policy = GcPolicy()
    gc_policy.install()
    now = time.time()
    rng = random.Random(3)
    levels = [rng.lognormvariate(1.5, 1.0) for _ in range(models)]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gearshift-evaluate-") as tmp:
        store = Store.open(default_sqlite_url(Path(tmp)))
        decisions = DecisionStore(store.engine)
        try:
            _revisions(store, models, now)
            _capacity(store, models, levels, now)
            _tenures(decisions, models, now - days * 86400)
            history = _history(models, levels, now, days, resolution_s)
            fleet = _fleet(models, levels, now)
            learner = CapacityLearner(store)
            learner.load()
            # As the controller runs it: forecasts fitted on a worker thread, the tick
            # reading the latest (controller.decisions.learning.ForecastWorker).
            loop = PolicyLoop(store, decisions, fleet, history, paused=lambda: False,
                              clock=lambda: now,
                              learner=learner, gpu_price_per_hour=gpu_price_per_hour,
                              forecaster=Forecaster(history.arrays, resolution_s,
                                                    clock=lambda: now, background=True))
            loop.policies.apply(_policy_text(policy_path, priors), str(policy_path), "bench", "")
            fleet.started = now - days * 86400  # the models have been on their engines all along
            setup_s = time.perf_counter() - t0
            w0, c0 = time.perf_counter(), time.process_time()
            decisions = loop.evaluate(now)
            tick_s, tick_cpu_s = time.perf_counter() - w0, time.process_time() - c0
            rss_mb = (_live_rss(proc) - rss0) / 1e6
            # The worker fits what the tick handed off, on its own thread, while an event
            # loop here wakes a 50 ms timer as the controller's does (its lateness is how
            # long an ack waits: controller/loop_lag.py).
            lag_refitting = _loop_lag_ms(WORKER_SAMPLE_S)
            fits, fit_cpu_s = loop.forecaster.worker_stats()
            loop.forecaster.close()
            lag_idle = _loop_lag_ms(WORKER_SAMPLE_S)  # the same loop with no fits
            active = loop.policies.active()
            assert active is not None
            spec = active[1].doc.spec
            sample = [f"model-{i:05d}" for i in range(min(models, CACHE_SAMPLE))]
            cache_b = _forecast_cache_bytes(history, resolution_s, now, sample,
                                            spec.cost.horizon, spec.signals.sustained_quantile)
        finally:
            store.close()
            gc_policy.uninstall()
    return {"models": models, "tick_s": round(tick_s, 3), "tick_cpu_s": round(tick_cpu_s, 3),
            "per_model_us": round(tick_s / models * 1e6, 1), "rss_mb": round(rss_mb, 1),
            "decisions": len(decisions), "gpu_price_per_hour": gpu_price_per_hour,
            # How late the event loop ran a 50 ms timer while the worker refitted (and
            # with no refits, after): what an agent's ack waits.
            "loop_lag_refitting_ms": lag_refitting, "loop_lag_idle_ms": lag_idle,
            "forecast_fits": fits, "forecast_fit_cpu_s": round(fit_cpu_s / max(fits, 1), 3),
            # Every model refitted once in this many hours, at the worker's CPU share.
            "forecast_cycle_h": round(models * fit_cpu_s / max(fits, 1)
                                      / FORECAST_WORKER_CPU_SHARE / 3600, 1),
            "forecast_cache_mb": round(cache_b * models / 1e6, 1),
            "forecast_cache_kb_per_model": round(cache_b / 1e3, 1),
            "forecast_cache_sample": min(models, CACHE_SAMPLE),
            "priors": priors,
            "history_days": days, "resolution_s": resolution_s,
            "setup_s": round(setup_s, 1), "target_tick_s": TARGET_TICK_S,
            "target_rss_mb": TARGET_RSS_MB,
            "meets_target": tick_s <= TARGET_TICK_S and rss_mb <= TARGET_RSS_MB}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=int, default=10_000)
    p.add_argument("--history-days", type=float, default=8.0)
    p.add_argument("--resolution-s", type=float, default=300.0)
    p.add_argument("--policy", type=Path, default=DEFAULT_POLICY)
    p.add_argument("--gpu-price-per-hour", type=float, default=DEFAULT_GPU_PRICE_PER_HOUR,
                   help="the fleet's price (the controller's flag); 0: none, so no move is "
                   "priced")
    p.add_argument("--priors", choices=("capacity", "sla", "none"), default="capacity",
                   help="what is appended to the policy's spec.models (PRIORS); none: as is")
    args = p.parse_args()
    if args.models < 1 or args.history_days <= 0 or not 1 <= args.resolution_s <= 3600:
        p.error("--models and --history-days must be positive, --resolution-s in 1..3600")
    price = args.gpu_price_per_hour if args.gpu_price_per_hour > 0 else None
    watch = MachineWatch()
    out = run(args.models, args.history_days, args.resolution_s, args.policy, price, args.priors)
    out["machine"] = watch.result()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
