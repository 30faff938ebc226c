"""Shared builders for the policy tests: synthetic traces and policy texts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gearshift.policies.trace import Trace, parse_trace

TRACES_DIR = Path(__file__).parent / "traces"
TRACE_NAMES = ["bursty-8b", "fleet-mixed", "ramp-70b", "rnd-churn-70b", "steady-70b",
               "weekly-churn-70b"]
EXAMPLES_DIR = Path(__file__).parents[3] / "policies" / "examples"


def profile(**overrides: Any) -> dict[str, Any]:
    p: dict[str, Any] = {
        "gpus_per_replica": 8, "min_replicas": 1, "sla_ttft_p99_ms": 1000.0,
        "capacity_rps": {"vllm": 10.0, "tensorrt-llm": 11.6},
        "cold_start_s": {"vllm": 210, "tensorrt-llm": 240},
        "build_s": {"vllm": 0, "tensorrt-llm": 1800},
        "build_overhead_usd": {"vllm": 0.0, "tensorrt-llm": 150.0},
        "ttft_p99_ms": {"vllm": 900.0, "tensorrt-llm": 780.0},
        "initial_engine": "vllm",
    }
    p.update(overrides)
    return p


def trace_lines(rates: dict[str, list[float]], *, revisions: dict[str, list[int]] | None = None,
                profiles: dict[str, dict[str, Any]] | None = None, step_s: int = 300,
                releases: dict[str, list[tuple[int, dict[str, Any]]]] | None = None,
                **header: Any) -> list[str]:
    """JSON lines of a trace starting 2026-03-02T00:00:00Z with one record per model per step;
    `releases`: per model, (step, fields) of its ``engine_release`` records, at that step's
    start (fields: engine, version and the facts it changes)."""
    head: dict[str, Any] = {
        "kind": "header", "version": 1, "name": "synthetic", "start": "2026-03-02T00:00:00Z",
        "step_s": step_s, "price_per_gpu_hour": 4.0, "headroom": 0.2, "overlap_s": 600,
        "models": profiles or {m: profile() for m in rates},
    }
    head.update(header)
    lines = [json.dumps(head)]
    revisions = revisions or {}
    n = max(len(r) for r in rates.values())
    for k in range(n):
        ts = _ts(k * step_s)
        for m in sorted(rates):
            for at, fields in (releases or {}).get(m, []):
                if at == k:
                    lines.append(json.dumps({"kind": "engine_release", "ts": ts, "model": m,
                                             **fields}))
            if k in revisions.get(m, []):
                lines.append(json.dumps({"kind": "revision", "ts": ts, "model": m, "revision": f"r{k}"}))
            lines.append(json.dumps({"kind": "traffic", "ts": ts, "model": m, "rps": rates[m][k]}))
    return lines


def _ts(offset_s: int) -> str:
    from datetime import UTC, datetime, timedelta
    t = datetime(2026, 3, 2, tzinfo=UTC) + timedelta(seconds=offset_s)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
def make_trace() -> Callable[..., Trace]:
    def make(rates: dict[str, list[float]], **kw: Any) -> Trace:
        return parse_trace(trace_lines(rates, **kw), source="synthetic")
    return make


def policy_text(spec: str = "", *, name: str = "test", rules: str | None = None) -> str:
    rules = rules if rules is not None else (
        "    - {name: sla, kind: sla-guard}\n    - {name: cost, kind: expected-savings}\n")
    return (f"apiVersion: gearshift.dev/v1\nkind: EnginePolicy\nmetadata:\n  name: {name}\n"
            f"spec:\n  mode: auto\n  rules:\n{rules}{spec}")


@pytest.fixture
def lines_of() -> Callable[..., list[str]]:
    return trace_lines


@pytest.fixture
def policy_yaml() -> Callable[..., str]:
    return policy_text


@pytest.fixture
def profile_of() -> Callable[..., dict[str, Any]]:
    return profile
