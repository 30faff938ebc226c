"""Checks on messages from agents, before they touch any state.

Each check raises `InvalidArgument` (or `FailedPrecondition` for a protocol
version mismatch) whose message names the field and the value found, so the
agent's log says exactly what was wrong.
"""

from __future__ import annotations

import math
import re

from gearshift.common.engines import ENGINE_NAMES
from gearshift.common.errors import FailedPrecondition, InvalidArgument
from gearshift.v1 import agent_pb2

HOST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
KNOWN_ENGINES = ENGINE_NAMES  # the engine catalog's
MAX_GPUS_PER_HOST = 64
MAX_DEPLOYMENTS_PER_REPORT = 256
MAX_LABELS = 64
MAX_LABEL_LEN = 256


def check_hello(hello: agent_pb2.Hello) -> None:
    if hello.protocol_version != agent_pb2.PROTOCOL_VERSION_1:
        raise FailedPrecondition(
            f"hello.protocol_version: expected {agent_pb2.PROTOCOL_VERSION_1} "
            f"(PROTOCOL_VERSION_1), found {hello.protocol_version}")
    if not HOST_ID_RE.match(hello.host_id):
        raise InvalidArgument(
            f"hello.host_id: expected 1-253 characters of letters, digits, '.', '_' or '-', "
            f"found {hello.host_id[:80]!r}")
    if len(hello.labels) > MAX_LABELS:
        raise InvalidArgument(f"hello.labels: at most {MAX_LABELS} labels, found {len(hello.labels)}")
    for k, v in hello.labels.items():
        if not k or len(k) > MAX_LABEL_LEN or len(v) > MAX_LABEL_LEN:
            raise InvalidArgument(
                f"hello.labels[{k[:40]!r}]: keys 1-{MAX_LABEL_LEN} and values up to "
                f"{MAX_LABEL_LEN} characters")
    if len(hello.gpus) > MAX_GPUS_PER_HOST:
        raise InvalidArgument(f"hello.gpus: at most {MAX_GPUS_PER_HOST}, found {len(hello.gpus)}")
    for i, eng in enumerate(hello.engines):
        if eng.engine not in KNOWN_ENGINES:
            raise InvalidArgument(
                f"hello.engines[{i}].engine: expected one of {', '.join(KNOWN_ENGINES)}, "
                f"found {eng.engine!r}")


def _finite_nonneg(path: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{path}: expected a finite number >= 0, found {value!r}")


def _looks_valid(d: agent_pb2.DeploymentReport) -> bool:
    """Fast path for the common case; the slow path below names what is wrong."""
    nums = (d.request_rate, d.running_requests, d.waiting_requests, d.prompt_tokens_per_s,
            d.generation_tokens_per_s, d.kv_cache_usage, d.ttft.p99_s, d.ttft.p50_s, d.ttft.mean_s,
            d.itl.p99_s, d.itl.p50_s, d.itl.mean_s, d.e2e.p99_s, d.e2e.p50_s, d.e2e.mean_s)
    return (bool(d.deployment_id) and bool(d.model) and d.engine in KNOWN_ENGINES
            and math.isfinite(sum(nums)) and min(nums) >= 0 and d.kv_cache_usage <= 1.0)


def check_report(report: agent_pb2.Report) -> None:
    if report.seq == 0:
        raise InvalidArgument("report.seq: expected a sequence number >= 1, found 0")
    if len(report.gpus) > MAX_GPUS_PER_HOST:
        raise InvalidArgument(f"report.gpus: at most {MAX_GPUS_PER_HOST}, found {len(report.gpus)}")
    if len(report.deployments) > MAX_DEPLOYMENTS_PER_REPORT:
        raise InvalidArgument(
            f"report.deployments: at most {MAX_DEPLOYMENTS_PER_REPORT}, "
            f"found {len(report.deployments)}")
    for i, d in enumerate(report.deployments):
        if _looks_valid(d):
            continue
        p = f"report.deployments[{i}]"
        if not d.deployment_id:
            raise InvalidArgument(f"{p}.deployment_id: expected a non-empty id, found ''")
        if d.engine not in KNOWN_ENGINES:
            raise InvalidArgument(
                f"{p}.engine: expected one of {', '.join(KNOWN_ENGINES)}, found {d.engine!r}")
        if not d.model:
            raise InvalidArgument(f"{p}.model: expected a model name, found ''")
        for name in ("request_rate", "running_requests", "waiting_requests",
                     "prompt_tokens_per_s", "generation_tokens_per_s", "kv_cache_usage"):
            _finite_nonneg(f"{p}.{name}", getattr(d, name))
        if d.kv_cache_usage > 1.0:
            raise InvalidArgument(f"{p}.kv_cache_usage: expected 0..1, found {d.kv_cache_usage}")
        for qname in ("ttft", "itl", "e2e"):
            q = getattr(d, qname)
            if q.present:
                for f in ("p50_s", "p99_s", "mean_s"):
                    _finite_nonneg(f"{p}.{qname}.{f}", getattr(q, f))
