"""The ingest hot path against plain reference code, on many varied reports.

`RollupAggregator.add` and `check_report` are written for speed (each protobuf field
read once, the fold and the fast validity check inline); these tests recompute what
they must give straight from the rules in their module docs, field by field, so a
fast path that drifts from the rules fails here: the rollup rows must be equal up to the
last rounding of a float sum (the reference adds in another order), and a report must be accepted exactly when every rule holds.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import pytest

from gearshift.common.errors import InvalidArgument
from gearshift.controller.api.validation import (
    ENGINE_NAMES,
    MAX_KV_BLOCKS,
    MAX_LATENCY_S,
    MAX_REQUEST_RATE_PER_GPU,
    MAX_REQUESTS_IN_FLIGHT_PER_GPU,
    MAX_TOKENS_PER_REQUEST,
    MAX_TOKENS_PER_S_PER_GPU,
    SLEEP_STATES,
    check_report,
)
from gearshift.controller.ingest.rollup import MINUTE_S, P99_TAIL_FRACTION, RollupAggregator
from gearshift.v1 import agent_pb2

M = datetime(2026, 3, 2, 12, 0, tzinfo=UTC).timestamp()
QUANTILES = ("ttft", "itl", "e2e", "queue_time")
OPTIONAL = ("preemptions_per_s", "prefix_cache_hit_rate", "mean_prompt_tokens",
            "mean_generation_tokens", "kv_blocks_total", "kv_blocks_used")
ASLEEP = {agent_pb2.ENGINE_SLEEP_STATE_WEIGHTS_OFFLOADED, agent_pb2.ENGINE_SLEEP_STATE_DISCARD_ALL}


def _deployment(rng: random.Random, dep: int) -> agent_pb2.DeploymentReport:
    d = agent_pb2.DeploymentReport(
        deployment_id=f"d{dep}", model=f"m{dep % 3}", engine=("vllm", "sglang")[dep % 2],
        engine_version=rng.choice(["", "0.10.1", "0.11.0"]),
        metrics_present=rng.random() < 0.9, request_rate=rng.uniform(0, 40),
        running_requests=rng.randint(0, 30), waiting_requests=rng.randint(0, 5),
        generation_tokens_per_s=rng.uniform(0, 3000), kv_cache_usage=rng.random(),
        errors_total=rng.choice([0, 3, 7, 20]), sleep_state=rng.choice(sorted(SLEEP_STATES)))
    for name in QUANTILES:
        if rng.random() < 0.7:
            getattr(d, name).CopyFrom(agent_pb2.Quantiles(
                present=True, p50_s=rng.uniform(0, 1), p99_s=rng.uniform(0, 5),
                mean_s=rng.uniform(0, 1), count=rng.choice([0, 1, 50, 400])))
    for name in OPTIONAL[:4]:
        if rng.random() < 0.5:
            setattr(d, name, rng.uniform(0, 1))
    for name in OPTIONAL[4:]:
        if rng.random() < 0.5:
            setattr(d, name, rng.randint(0, 1000))
    return d


def _p99(values: list[tuple[float, int]]) -> float | None:
    if not values:
        return None
    ordered = sorted(values, key=lambda v: -v[0])  # stable: ties keep their report order
    need = sum(w for _, w in values) * P99_TAIL_FRACTION
    running = 0.0
    for value, w in ordered:
        running += w
        if running >= need:
            return value
    return ordered[-1][0]


def _reference_rows(reports: list[tuple[agent_pb2.DeploymentReport, float, str]]) -> list[dict[str, Any]]:
    """The module doc's rules, one report at a time, with no shortcut."""
    buckets: dict[tuple[str, str, int], dict[str, Any]] = {}
    last_errors: dict[str, int] = {}
    for d, ts, gpu_model in reports:
        if not d.metrics_present:
            continue
        key = (d.model, d.engine, int(ts // MINUTE_S) * MINUTE_S)
        b = buckets.setdefault(key, {"deps": {}, "reports": 0, "kv": 0.0, "rate_max": 0.0,
                                     "errors": 0, "version": "", "gpu": "",
                                     "lat": defaultdict(list), "means": defaultdict(list)})
        dep = b["deps"].setdefault(d.deployment_id, defaultdict(list))
        b["reports"] += 1
        dep["rate"].append(d.request_rate)
        dep["running"].append(d.running_requests)
        dep["waiting"].append(d.waiting_requests)
        dep["gen"].append(d.generation_tokens_per_s)
        total_now = 0.0
        for other in b["deps"].values():
            total_now += other["rate"][-1]
        b["rate_max"] = max(b["rate_max"], total_now)
        b["kv"] += d.kv_cache_usage
        for name in QUANTILES:
            qv = getattr(d, name)
            if qv.present:
                b["lat"][name].append((qv.p50_s, qv.p99_s, qv.count or 1))
        if d.HasField("preemptions_per_s"):
            dep["preempt"].append(d.preemptions_per_s)
        for name in ("prefix_cache_hit_rate", "mean_prompt_tokens", "mean_generation_tokens"):
            if d.HasField(name):
                b["means"][name].append(getattr(d, name))
        dep["asleep"] = [d.sleep_state in ASLEEP]
        for name in ("kv_blocks_total", "kv_blocks_used"):
            if d.HasField(name):
                dep[name] = [getattr(d, name)]
        if d.engine_version:
            b["version"] = d.engine_version
        if gpu_model:
            b["gpu"] = gpu_model
        prev = last_errors.get(d.deployment_id)
        if prev is not None:
            b["errors"] += d.errors_total - prev if d.errors_total >= prev else d.errors_total
        last_errors[d.deployment_id] = d.errors_total
    rows = []
    for (model, engine, minute), b in sorted(buckets.items(), key=lambda kv: kv[0][2]):
        deps = b["deps"].values()

        def mean_sum(field: str, deps: Any = deps) -> float:
            return sum(sum(x[field]) / len(x[field]) for x in deps)

        def p50(name: str, b: dict[str, Any] = b) -> float | None:
            lat = b["lat"][name]
            n = sum(w for _, _, w in lat)
            return sum(p * w for p, _, w in lat) / n if n else None

        def p99(name: str, b: dict[str, Any] = b) -> float | None:
            return _p99([(p, w) for _, p, w in b["lat"][name]])

        def mean(name: str, b: dict[str, Any] = b) -> float | None:
            values = b["means"][name]
            return sum(values) / len(values) if values else None

        def opt_sum(name: str, deps: Any = deps) -> Any:
            have = [x[name][0] for x in deps if x[name]]
            return sum(have) if have else None

        preempt = [sum(x["preempt"]) / len(x["preempt"]) for x in deps if x["preempt"]]
        rows.append({
            "model": model, "engine": engine, "minute": datetime.fromtimestamp(minute, UTC),
            "engine_version": b["version"], "gpu_model": b["gpu"], "reports": b["reports"],
            "replicas": len(b["deps"]), "request_rate_mean": mean_sum("rate"),
            "request_rate_max": b["rate_max"], "running_mean": mean_sum("running"),
            "waiting_mean": mean_sum("waiting"), "ttft_p50_s": p50("ttft"),
            "ttft_p99_s": p99("ttft"), "itl_p50_s": p50("itl"), "itl_p99_s": p99("itl"),
            "e2e_p99_s": p99("e2e"), "generation_tokens_per_s": mean_sum("gen"),
            "kv_cache_usage_mean": b["kv"] / b["reports"], "errors": b["errors"],
            "queue_p50_s": p50("queue_time"), "queue_p99_s": p99("queue_time"),
            "preemptions_per_s": sum(preempt) if preempt else None,
            "prefix_cache_hit_rate": mean("prefix_cache_hit_rate"),
            "mean_prompt_tokens": mean("mean_prompt_tokens"),
            "mean_generation_tokens": mean("mean_generation_tokens"),
            "sleeping_replicas": sum(1 for x in deps if x["asleep"][0]),
            "kv_blocks_total": opt_sum("kv_blocks_total"),
            "kv_blocks_used": opt_sum("kv_blocks_used"),
        })
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_rollup_rows_equal_the_reference_fold(seed: int) -> None:
    rng = random.Random(seed)
    reports = []
    ts = M
    for _ in range(400):
        ts += rng.uniform(0, 1.0)  # about three minutes
        reports.append((_deployment(rng, rng.randrange(8)), ts, rng.choice(["", "H100"])))
    agg = RollupAggregator()
    for d, at, gpu_model in reports:
        agg.add("h1", d, at, gpu_model)
    got = [row.model_dump() for row in agg.flush_all()]
    want = _reference_rows(reports)
    assert len(got) == len(want) >= 6
    for row, expected in zip(got, want, strict=True):
        for name, value in expected.items():
            if isinstance(value, float):
                # the aggregator keeps running sums; the reference adds in another order
                assert row[name] == pytest.approx(value, rel=1e-12), (name, row, expected)
            else:
                assert row[name] == value, (name, row, expected)


def _reference_valid(d: agent_pb2.DeploymentReport) -> bool:
    """validation's rules for one deployment (valid version texts and endpoint assumed)."""
    def ok(value: float, high: float) -> bool:
        return math.isfinite(value) and 0 <= value <= high

    gpus = max(1, len(d.gpu_indices), d.tensor_parallel_size)
    checks = [
        bool(d.deployment_id), bool(d.model), d.engine in ENGINE_NAMES,
        ok(d.request_rate, MAX_REQUEST_RATE_PER_GPU * gpus),
        ok(d.running_requests, MAX_REQUESTS_IN_FLIGHT_PER_GPU * gpus),
        ok(d.waiting_requests, MAX_REQUESTS_IN_FLIGHT_PER_GPU * gpus),
        ok(d.prompt_tokens_per_s, MAX_TOKENS_PER_S_PER_GPU * gpus),
        ok(d.generation_tokens_per_s, MAX_TOKENS_PER_S_PER_GPU * gpus),
        d.prompt_tokens_per_s + d.generation_tokens_per_s <= MAX_TOKENS_PER_S_PER_GPU * gpus,
        d.running_requests + d.waiting_requests <= MAX_REQUESTS_IN_FLIGHT_PER_GPU * gpus,
        ok(d.kv_cache_usage, 1.0),
        d.sleep_state in SLEEP_STATES, d.kv_blocks_total <= MAX_KV_BLOCKS,
        not (d.HasField("kv_blocks_used") and d.HasField("kv_blocks_total"))
        or d.kv_blocks_used <= d.kv_blocks_total,
    ]
    checks += [ok(getattr(getattr(d, q), f), MAX_LATENCY_S)
               for q in QUANTILES for f in ("p50_s", "p99_s", "mean_s")]
    bounds = {"preemptions_per_s": MAX_REQUEST_RATE_PER_GPU * gpus, "prefix_cache_hit_rate": 1.0,
              "mean_prompt_tokens": MAX_TOKENS_PER_REQUEST,
              "mean_generation_tokens": MAX_TOKENS_PER_REQUEST}
    checks += [ok(getattr(d, name), high) for name, high in bounds.items() if d.HasField(name)]
    return all(checks)


ODD = [0.0, -0.0, -1e-9, 1.0, 1.0000001, math.nan, math.inf, -math.inf, 2e7, 1e12]


def _varied(rng: random.Random) -> agent_pb2.DeploymentReport:
    """A deployment mostly valid, with a few figures from the edges and beyond."""
    d = _deployment(rng, rng.randrange(8))
    d.tensor_parallel_size = rng.choice([0, 1, 2, 8])
    d.prompt_tokens_per_s = rng.uniform(0, 3000)
    floats = ["request_rate", "running_requests", "waiting_requests", "prompt_tokens_per_s",
              "generation_tokens_per_s", "kv_cache_usage", *OPTIONAL[:4]]
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        where = rng.choice([*floats, "quantile", "kv_blocks", "identity", "sleep_state"])
        if where == "quantile":
            setattr(getattr(d, rng.choice(QUANTILES)), rng.choice(["p50_s", "p99_s", "mean_s"]),
                    rng.choice([*ODD, MAX_LATENCY_S, MAX_LATENCY_S * 1.01]))
        elif where == "kv_blocks":
            d.kv_blocks_total = rng.choice([0, 5, int(MAX_KV_BLOCKS), int(MAX_KV_BLOCKS) + 1])
            d.kv_blocks_used = rng.choice([0, 5, 6])
        elif where == "identity":
            setattr(d, rng.choice(["deployment_id", "model", "engine"]), rng.choice(["", "other"]))
        elif where == "sleep_state":
            d.sleep_state = rng.choice([0, 1, 2, 3, 99])
        else:
            setattr(d, where, rng.choice(ODD))
    return d


@pytest.mark.parametrize("seed", range(4))
def test_check_report_accepts_exactly_what_the_rules_allow(seed: int) -> None:
    rng = random.Random(seed)
    accepted = refused = 0
    for n in range(600):
        d = _varied(rng)
        r = agent_pb2.Report(seq=1, interval_s=10.0)
        r.deployments.append(d)
        try:
            check_report(r)
        except InvalidArgument as exc:
            assert not _reference_valid(d), (exc.message, d)
            assert exc.message.startswith("report.deployments[0]"), exc.message
            refused += 1
        else:
            assert _reference_valid(d), (n, d)
            accepted += 1
    assert accepted > 200 and refused > 50
