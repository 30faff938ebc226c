"""Checks on messages from agents, before they touch any state.

Each check raises `InvalidArgument` (or `FailedPrecondition` for a protocol
version mismatch) whose message names the field and the value found, so the
agent's log says exactly what was wrong.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import re
from sys import intern
from urllib.parse import urlsplit

from gearshift.common.engine_versions import VERSION_SOURCES, VERSION_TEXT_RE
from gearshift.common.engines import ENGINE_NAMES
from gearshift.common.errors import FailedPrecondition, InvalidArgument
from gearshift.v1 import agent_pb2

HOST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_KNOWN_ENGINE_SET = frozenset(ENGINE_NAMES)  # the fast path's membership test
MAX_GPUS_PER_HOST = 64
MAX_DEPLOYMENTS_PER_REPORT = 256
MAX_LABELS = 64
MAX_LABEL_LEN = 256
# Physical bounds on what one engine can do, per GPU it runs on: far above any real
# engine, far below what breaks a sum over the fleet.
MAX_REQUEST_RATE_PER_GPU = 10_000.0  # finished requests per second
MAX_TOKENS_PER_S_PER_GPU = 10_000_000.0
MAX_REQUESTS_IN_FLIGHT_PER_GPU = 1_000_000.0
MAX_LATENCY_S = 7 * 86400.0
MAX_REPORT_INTERVAL_S = 86400.0
MAX_GPU_TEMPERATURE_C = 200.0
MIN_GPU_TEMPERATURE_C = -60.0
MAX_GPU_POWER_W = 10_000.0
MAX_ENDPOINT_LEN = 512
MAX_ENDPOINTS_KEPT = 64  # per stream, already checked (`check_report`)
MAX_TOKENS_PER_REQUEST = 100_000_000.0  # far above any context length
MAX_KV_BLOCKS = 2.0**40
SLEEP_STATES = frozenset(agent_pb2.EngineSleepState.values())
VERSION_MATCHES = frozenset(agent_pb2.VersionMatch.values())
MAX_EXECUTABLE_LEN = 4096
# What an agent names: bounded and printable (no C0 or C1 control characters, so
# nothing it sends can move a terminal's cursor, set its clipboard or link text), and
# counted, so that no host and no fleet can swell the store, /metrics or a list answer.
MAX_ID_LEN = 128  # deployment ids (common/spec.py's id pattern allows 128)
MAX_MODEL_LEN = 256  # served model names and hub ids are far shorter
MAX_REVISION_LEN = 128
MAX_SOURCE_LEN = 1024  # a checkpoint path
MAX_BACKEND_LEN = 32
MAX_MESSAGE_LEN = 2048  # free text; shown escaped
MAX_MODELS_PER_HOST = 64  # distinct models one report names
_PRINTABLE_RE = re.compile(r"[^\x00-\x1f\x7f-\x9f]*")  # use with fullmatch
MAX_IMAGE_LEN = 512
IMAGE_TEXT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*")  # use with fullmatch
IMAGE_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_CONTROL_CHARS_RE = re.compile(r"[\x00-\x1f\x7f]")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


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
        if not k or len(k) > MAX_LABEL_LEN or len(v) > MAX_LABEL_LEN \
                or not _PRINTABLE_RE.fullmatch(k) or not _PRINTABLE_RE.fullmatch(v):
            raise InvalidArgument(
                f"hello.labels[{k[:40]!r}]: keys 1-{MAX_LABEL_LEN} and values up to "
                f"{MAX_LABEL_LEN} printable characters")
    check_text("hello.agent_version", hello.agent_version, 64)
    if len(hello.gpus) > MAX_GPUS_PER_HOST:
        raise InvalidArgument(f"hello.gpus: at most {MAX_GPUS_PER_HOST}, found {len(hello.gpus)}")
    for i, g in enumerate(hello.gpus):
        _check_gpu(f"hello.gpus[{i}]", g)
    seen: dict[str, int] = {}
    for i, eng in enumerate(hello.engines):
        p = f"hello.engines[{i}]"
        if eng.engine not in ENGINE_NAMES:
            raise InvalidArgument(
                f"{p}.engine: expected one of {', '.join(ENGINE_NAMES)}, found {eng.engine!r}")
        first = seen.setdefault(eng.engine, i)
        if first != i:
            raise InvalidArgument(f"{p}.engine: {eng.engine!r} again (first at engines[{first}]); "
                                  f"one entry per engine")
        check_version_text(f"{p}.version", eng.version)
        check_version_text(f"{p}.release", eng.release)
        check_version_match(f"{p}.version_match", eng.version_match)
        if eng.version_source and eng.version_source not in VERSION_SOURCES:
            raise InvalidArgument(f"{p}.version_source: expected one of "
                                  f"{', '.join(VERSION_SOURCES)} or empty, "
                                  f"found {eng.version_source[:80]!r}")
        check_image_texts(f"{p}.image", eng.image, "")
        if len(eng.executable) > MAX_EXECUTABLE_LEN or _CONTROL_CHARS_RE.search(eng.executable):
            raise InvalidArgument(f"{p}.executable: expected up to {MAX_EXECUTABLE_LEN} "
                                  f"characters without control characters, "
                                  f"found {eng.executable[:80]!r}")


def check_version_text(path: str, value: str) -> None:
    """An engine version or version-table row: empty (not known) or 1-64 letters, digits,
    '.', '+', '_' or '-' starting with a letter or digit."""
    if value and not VERSION_TEXT_RE.fullmatch(value):
        raise InvalidArgument(f"{path}: expected a version of 1-64 letters, digits, '.', '+', "
                              f"'_' or '-' (or empty), found {value[:80]!r}")


def check_version_match(path: str, value: int) -> None:
    if value not in VERSION_MATCHES:
        raise InvalidArgument(f"{path}: expected one of {', '.join(agent_pb2.VersionMatch.keys())}, "
                              f"found {value}")


def _finite_nonneg(path: str, value: float, high: float = math.inf) -> None:
    if not math.isfinite(value) or value < 0 or value > high:
        bound = f"from 0 to {high:g}" if math.isfinite(high) else ">= 0"
        raise InvalidArgument(f"{path}: expected a finite number {bound}, found {value!r}")


def _check_gpu(path: str, g: agent_pb2.GpuInfo) -> None:
    _finite_nonneg(f"{path}.utilization", g.utilization, 1.0)
    _finite_nonneg(f"{path}.power_w", g.power_w, MAX_GPU_POWER_W)
    t = g.temperature_c
    if not (math.isfinite(t) and MIN_GPU_TEMPERATURE_C <= t <= MAX_GPU_TEMPERATURE_C):
        raise InvalidArgument(f"{path}.temperature_c: expected a finite number from "
                              f"{MIN_GPU_TEMPERATURE_C:g} to {MAX_GPU_TEMPERATURE_C:g}, found {t!r}")
    if g.memory_total_bytes and g.memory_used_bytes > g.memory_total_bytes:
        raise InvalidArgument(f"{path}.memory_used_bytes: expected at most memory_total_bytes "
                              f"({g.memory_total_bytes}), found {g.memory_used_bytes}")


def _gpus_of(d: agent_pb2.DeploymentReport) -> int:
    return max(1, len(d.gpu_indices), d.tensor_parallel_size)


def _looks_valid(d: agent_pb2.DeploymentReport, deployment_id: str) -> bool:
    """Fast path for the common case; the slow path below names what is wrong.

    Every figure is read once (a protobuf field read costs as much as the comparison)
    and checked with chained comparisons, which NaN and the infinities all fail. An
    optional SLA signal that is not set reads 0, which passes every bound, so no
    HasField is asked on the common path. One function: a second call per deployment
    for the SLA signals cost as much as their comparisons."""
    if not (deployment_id and d.model and d.engine in _KNOWN_ENGINE_SET
            and _names_ok(deployment_id, d.model, d.revision, d.source, d.served_model_name,
                          d.backend)
            and (not d.message or _message_ok(d.message))
            and d.engine_version_match in VERSION_MATCHES
            and _version_texts_ok(d.engine_version, d.engine_release)
            and _image_texts_ok(d.image, d.image_digest)):
        return False
    gpus = max(1, d.tensor_parallel_size, len(d.gpu_indices))
    prompt, generation = d.prompt_tokens_per_s, d.generation_tokens_per_s
    running, waiting = d.running_requests, d.waiting_requests
    t, i, e, q = d.ttft, d.itl, d.e2e, d.queue_time
    hi = MAX_LATENCY_S
    used, total = d.kv_blocks_used, d.kv_blocks_total
    return (0 <= d.request_rate <= MAX_REQUEST_RATE_PER_GPU * gpus
            and prompt >= 0 and generation >= 0
            and prompt + generation <= MAX_TOKENS_PER_S_PER_GPU * gpus
            and running >= 0 and waiting >= 0
            and running + waiting <= MAX_REQUESTS_IN_FLIGHT_PER_GPU * gpus
            and 0 <= d.kv_cache_usage <= 1.0
            and 0 <= t.p50_s <= hi and 0 <= t.p99_s <= hi and 0 <= t.mean_s <= hi
            and 0 <= i.p50_s <= hi and 0 <= i.p99_s <= hi and 0 <= i.mean_s <= hi
            and 0 <= e.p50_s <= hi and 0 <= e.p99_s <= hi and 0 <= e.mean_s <= hi
            and 0 <= q.p50_s <= hi and 0 <= q.p99_s <= hi and 0 <= q.mean_s <= hi
            and 0 <= d.preemptions_per_s <= MAX_REQUEST_RATE_PER_GPU * gpus
            and 0 <= d.prefix_cache_hit_rate <= 1.0
            and 0 <= d.mean_prompt_tokens <= MAX_TOKENS_PER_REQUEST
            and 0 <= d.mean_generation_tokens <= MAX_TOKENS_PER_REQUEST
            and d.sleep_state in SLEEP_STATES
            and total <= MAX_KV_BLOCKS
            and (used <= total or not d.HasField("kv_blocks_used")
                 or not d.HasField("kv_blocks_total")))


@functools.lru_cache(maxsize=65536)
def _names_ok(dep_id: str, model: str, revision: str, source: str, served: str,
              backend: str) -> bool:
    """Cached: a host reports the same names in every report."""
    return (len(dep_id) <= MAX_ID_LEN and len(model) <= MAX_MODEL_LEN
            and len(revision) <= MAX_REVISION_LEN and len(source) <= MAX_SOURCE_LEN
            and len(served) <= MAX_MODEL_LEN and len(backend) <= MAX_BACKEND_LEN
            and _PRINTABLE_RE.fullmatch(dep_id + model + revision + source + served + backend)
            is not None)


@functools.lru_cache(maxsize=4096)
def _message_ok(message: str) -> bool:
    return len(message) <= MAX_MESSAGE_LEN and _PRINTABLE_RE.fullmatch(message) is not None


def check_text(path: str, value: str, max_len: int) -> None:
    """A name an agent sends: up to `max_len` printable characters (no control ones)."""
    if len(value) > max_len or not _PRINTABLE_RE.fullmatch(value):
        bad = next((c for c in value if not _PRINTABLE_RE.fullmatch(c)), None)
        why = (f"a control character {bad!r}" if bad is not None
               else f"{len(value)} characters")
        raise InvalidArgument(f"{path}: expected up to {max_len} printable characters, "
                              f"found {why} in {value[:80]!r}")


@functools.lru_cache(maxsize=1024)
def _image_texts_ok(image: str, digest: str) -> bool:
    """Cached: a fleet runs few distinct images, each in every report."""
    return ((not image or (len(image) <= MAX_IMAGE_LEN and IMAGE_TEXT_RE.fullmatch(image)
                           is not None))
            and (not digest or IMAGE_DIGEST_RE.fullmatch(digest) is not None))


def check_image_texts(path: str, image: str, digest: str) -> None:
    """An engine's container image reference and digest: empty, or printable text."""
    if image and (len(image) > MAX_IMAGE_LEN or not IMAGE_TEXT_RE.fullmatch(image)):
        raise InvalidArgument(f"{path}: expected an image reference of up to {MAX_IMAGE_LEN} "
                              f"letters, digits and . _ - / : @ (or empty), found {image[:80]!r}")
    if digest and not IMAGE_DIGEST_RE.fullmatch(digest):
        raise InvalidArgument(f"{path}_digest: expected sha256:<64 hex digits> (or empty), "
                              f"found {digest[:80]!r}")


@functools.lru_cache(maxsize=1024)
def _version_texts_ok(version: str, release: str) -> bool:
    """Cached: a fleet reports few distinct versions, each in every report."""
    return ((not version or VERSION_TEXT_RE.fullmatch(version) is not None)
            and (not release or VERSION_TEXT_RE.fullmatch(release) is not None))


def _check_sla_signals(p: str, d: agent_pb2.DeploymentReport, gpus: int, per_gpu: str) -> None:
    """Name the first SLA signal that is out of range (the fast check failed)."""
    for f in ("p50_s", "p99_s", "mean_s"):
        _finite_nonneg(f"{p}.queue_time.{f}", getattr(d.queue_time, f), MAX_LATENCY_S)
    bounds = {"preemptions_per_s": MAX_REQUEST_RATE_PER_GPU * gpus, "prefix_cache_hit_rate": 1.0,
              "mean_prompt_tokens": MAX_TOKENS_PER_REQUEST,
              "mean_generation_tokens": MAX_TOKENS_PER_REQUEST}
    for name, high in bounds.items():
        if d.HasField(name):
            shown = per_gpu if name == "preemptions_per_s" else ""
            _finite_nonneg(f"{p}.{name}{shown}", getattr(d, name), high)
    if d.sleep_state not in SLEEP_STATES:
        raise InvalidArgument(f"{p}.sleep_state: expected one of "
                              f"{', '.join(agent_pb2.EngineSleepState.keys())}, "
                              f"found {d.sleep_state}")
    if d.kv_blocks_total > MAX_KV_BLOCKS:
        raise InvalidArgument(f"{p}.kv_blocks_total: expected at most {MAX_KV_BLOCKS:g}, "
                              f"found {d.kv_blocks_total}")
    if (d.HasField("kv_blocks_used") and d.HasField("kv_blocks_total")
            and d.kv_blocks_used > d.kv_blocks_total):
        raise InvalidArgument(f"{p}.kv_blocks_used: expected at most kv_blocks_total "
                              f"({d.kv_blocks_total}), found {d.kv_blocks_used}")


def peer_ip(peer: str) -> IPAddress | None:
    """The IP address in a gRPC peer string ("ipv4:10.0.0.5:5123", "ipv6:[::1]:5123");
    None for another transport (a Unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition("]")[0].removeprefix("[").split("%", 1)[0]
    else:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def check_endpoint(path: str, endpoint: str, host_id: str,
                   peer: IPAddress | None) -> None:
    """An engine endpoint gateways will send traffic to: an http(s) URL with no
    credentials, path or query, on an address of the reporting host (the address its
    stream comes from, a loopback address when that is loopback, or its host id)."""
    def refuse(why: str) -> InvalidArgument:
        where = f" ({peer})" if peer is not None else ""
        return InvalidArgument(f"{path}: expected http(s)://HOST:PORT on the reporting host"
                               f"{where}, found {endpoint[:80]!r}: {why}")
    if len(endpoint) > MAX_ENDPOINT_LEN:
        raise refuse(f"longer than {MAX_ENDPOINT_LEN} characters")
    try:
        url = urlsplit(endpoint)
        port = url.port
    except ValueError as exc:
        raise refuse(str(exc)) from None
    if url.scheme not in ("http", "https"):
        raise refuse("the scheme must be http or https")
    if url.username is not None or url.password is not None:
        raise refuse("no credentials allowed")
    if url.path not in ("", "/") or url.query or url.fragment:
        raise refuse("no path, query or fragment allowed")
    host = url.hostname or ""
    if not host or port is None or port == 0:
        raise refuse("a host and a port are required")
    try:
        ip: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is None:
        if host == host_id.lower() or (host == "localhost" and peer is not None
                                        and peer.is_loopback):
            return
        raise refuse("a name other than the host id")
    if ip.is_unspecified or ip.is_multicast:
        raise refuse("not a unicast address")
    if peer is None or ip == peer or (ip.is_loopback and peer.is_loopback):
        return
    raise refuse("not the address this host connects from")


def check_report(report: agent_pb2.Report, host_id: str = "",
                 peer: IPAddress | None = None,
                 endpoints_ok: list[str] | None = None) -> None:
    """Check one report. `endpoints_ok` (endpoints already checked for this stream)
    keeps the URL check off the common path: endpoints rarely change. A list, not a
    set: a host's few endpoints are found as fast, in a fifth of the memory (a set of 8
    strings is 0.7 KB; 7 MB over a fleet of 10,000); past `MAX_ENDPOINTS_KEPT` it starts
    over, so a host cycling through ports cannot make it long."""
    if report.seq == 0:
        raise InvalidArgument("report.seq: expected a sequence number >= 1, found 0")
    if not (math.isfinite(report.interval_s) and 0 <= report.interval_s <= MAX_REPORT_INTERVAL_S):
        raise InvalidArgument(f"report.interval_s: expected a finite number from 0 to "
                              f"{MAX_REPORT_INTERVAL_S:g}, found {report.interval_s!r}")
    if len(report.gpus) > MAX_GPUS_PER_HOST:
        raise InvalidArgument(f"report.gpus: at most {MAX_GPUS_PER_HOST}, found {len(report.gpus)}")
    for i, g in enumerate(report.gpus):
        if not (0 <= g.utilization <= 1.0 and 0 <= g.power_w <= MAX_GPU_POWER_W
                and MIN_GPU_TEMPERATURE_C <= g.temperature_c <= MAX_GPU_TEMPERATURE_C
                and (not g.memory_total_bytes or g.memory_used_bytes <= g.memory_total_bytes)):
            _check_gpu(f"report.gpus[{i}]", g)  # comparisons with NaN are all False
    if len(report.deployments) > MAX_DEPLOYMENTS_PER_REPORT:
        raise InvalidArgument(
            f"report.deployments: at most {MAX_DEPLOYMENTS_PER_REPORT}, "
            f"found {len(report.deployments)}")
    models = {d.model for d in report.deployments}
    if len(models) > MAX_MODELS_PER_HOST:
        raise InvalidArgument(f"report.deployments: at most {MAX_MODELS_PER_HOST} distinct "
                              f"models per host, found {len(models)}")
    seen: set[str] = set()
    for i, d in enumerate(report.deployments):
        dep_id = d.deployment_id
        if dep_id in seen:
            first = [x.deployment_id for x in report.deployments].index(dep_id)
            raise InvalidArgument(f"report.deployments[{i}].deployment_id: {dep_id!r} "
                                  f"again (first at deployments[{first}]); ids must be unique")
        seen.add(dep_id)
        endpoint = d.endpoint
        if endpoint and (endpoints_ok is None or endpoint not in endpoints_ok):
            check_endpoint(f"report.deployments[{i}].endpoint", endpoint, host_id, peer)
            if endpoints_ok is not None:
                if len(endpoints_ok) >= MAX_ENDPOINTS_KEPT:
                    endpoints_ok.clear()
                endpoints_ok.append(intern(endpoint))  # kept: one string with the fleet's
        if _looks_valid(d, dep_id):
            continue
        p = f"report.deployments[{i}]"
        if not d.deployment_id:
            raise InvalidArgument(f"{p}.deployment_id: expected a non-empty id, found ''")
        if d.engine not in ENGINE_NAMES:
            raise InvalidArgument(
                f"{p}.engine: expected one of {', '.join(ENGINE_NAMES)}, found {d.engine!r}")
        if not d.model:
            raise InvalidArgument(f"{p}.model: expected a model name, found ''")
        for name, limit in (("deployment_id", MAX_ID_LEN), ("model", MAX_MODEL_LEN),
                            ("revision", MAX_REVISION_LEN), ("source", MAX_SOURCE_LEN),
                            ("served_model_name", MAX_MODEL_LEN), ("backend", MAX_BACKEND_LEN),
                            ("message", MAX_MESSAGE_LEN)):
            check_text(f"{p}.{name}", getattr(d, name), limit)
        check_version_text(f"{p}.engine_version", d.engine_version)
        check_version_text(f"{p}.engine_release", d.engine_release)
        check_version_match(f"{p}.engine_version_match", d.engine_version_match)
        check_image_texts(f"{p}.image", d.image, d.image_digest)
        gpus = _gpus_of(d)
        per_gpu = f" ({gpus} GPU{'s' if gpus > 1 else ''})"
        _finite_nonneg(f"{p}.request_rate{per_gpu}", d.request_rate,
                       MAX_REQUEST_RATE_PER_GPU * gpus)
        for name in ("running_requests", "waiting_requests"):
            _finite_nonneg(f"{p}.{name}{per_gpu}", getattr(d, name),
                           MAX_REQUESTS_IN_FLIGHT_PER_GPU * gpus)
        for name in ("prompt_tokens_per_s", "generation_tokens_per_s"):
            _finite_nonneg(f"{p}.{name}{per_gpu}", getattr(d, name), MAX_TOKENS_PER_S_PER_GPU * gpus)
        if d.prompt_tokens_per_s + d.generation_tokens_per_s > MAX_TOKENS_PER_S_PER_GPU * gpus:
            raise InvalidArgument(f"{p}: prompt and generation tokens per second together: at "
                                  f"most {MAX_TOKENS_PER_S_PER_GPU * gpus:g}{per_gpu}")
        if d.running_requests + d.waiting_requests > MAX_REQUESTS_IN_FLIGHT_PER_GPU * gpus:
            raise InvalidArgument(f"{p}: running and waiting requests together: at most "
                                  f"{MAX_REQUESTS_IN_FLIGHT_PER_GPU * gpus:g}{per_gpu}")
        _finite_nonneg(f"{p}.kv_cache_usage", d.kv_cache_usage, 1.0)
        for qname in ("ttft", "itl", "e2e"):
            q = getattr(d, qname)
            for f in ("p50_s", "p99_s", "mean_s"):
                _finite_nonneg(f"{p}.{qname}.{f}", getattr(q, f), MAX_LATENCY_S)
        _check_sla_signals(p, d, gpus, per_gpu)
