"""The gateway's routing table: model → endpoints with weights, and the choice among them.

A `RoutingTable` is immutable; a new table from the controller (or a routes file)
replaces the old one in one assignment, so a request that already picked an
endpoint keeps it while new requests see the new table. That is how a deployment
marked `leaving` stops getting new work while its in-flight requests finish.

Weights: an endpoint gets new requests in proportion to its weight; weight 0 or
`leaving` means no new requests. Endpoints that just refused a connection are
skipped for a short while (`EJECT_S`) unless nothing else is left.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from yarl import URL

from gearshift.common.errors import ConfigError
from gearshift.v1 import control_pb2

# How long an endpoint that refused a connection is passed over (seconds).
EJECT_S = 2.0

# The OpenAI paths the gateway forwards; each endpoint precomputes its URLs for them.
FORWARDED_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOST = re.compile(rb"[!-~]+")  # printable ASCII, no spaces: safe in a Host header


@dataclass(eq=False)
class Endpoint:
    """One deployment serving a model, as the gateway sees it."""

    deployment_id: str
    endpoint: str  # http://host:port
    weight: float = 1.0
    leaving: bool = False
    engine: str = ""
    host_id: str = ""
    served_model_name: str = ""  # the engine's own name for the model, when it differs
    urls: dict[str, URL] = field(default_factory=dict, repr=False)
    ejected_until: float = field(default=0.0, repr=False)
    # Where to connect (host, port, tls), and per forwarded path the request line and
    # Host header that start every request to this endpoint.
    upstream_key: tuple[str, int, bool] = field(default=("", 0, False), repr=False)
    request_starts: dict[str, bytes] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        base = self.endpoint.rstrip("/")
        self.urls = {p: URL(base + p, encoded=True) for p in FORWARDED_PATHS}
        try:
            url = URL(base)
            host = (url.host_port_subcomponent or "").encode("ascii")
        except (ValueError, UnicodeError):
            url, host = URL(), b""
        if not _HOST.fullmatch(host):  # never let a bad endpoint write into a request head
            url, host = URL(), b""
        self.upstream_key = (url.raw_host or "", url.port or 0, url.scheme == "https")
        self.request_starts = {
            p: b"POST " + u.raw_path.encode() + b" HTTP/1.1\r\nHost: " + host + b"\r\n"
            for p, u in self.urls.items()}

    @property
    def eligible(self) -> bool:
        """True when the endpoint may get new requests by the table (weight > 0, not leaving)."""
        return self.weight > 0 and not self.leaving

    def eject(self, now: float) -> None:
        """Pass this endpoint over for new requests for `EJECT_S` after a refused connection."""
        self.ejected_until = now + EJECT_S


@dataclass(frozen=True)
class RoutingTable:
    """Model → endpoints, plus the controller's version of the table."""

    models: Mapping[str, tuple[Endpoint, ...]]
    version: int = 0
    source: str = "static"

    def model_names(self) -> list[str]:
        return sorted(self.models)

    def pick(
        self,
        model: str,
        exclude: Iterable[Endpoint] = (),
        rng: Callable[[], float] = random.random,
        now: float | None = None,
    ) -> Endpoint | None:
        """Choose an endpoint for a new request to `model` by weight, or None if none is eligible.

        Raises KeyError when the model is not in the table at all.
        """
        endpoints = self.models[model]
        excluded = set(map(id, exclude)) if exclude else ()
        candidates = [e for e in endpoints if e.eligible and id(e) not in excluded]
        if not candidates and excluded:
            # Every weighted endpoint failed before its first byte: a standby that takes
            # no new share (weight 0) but is not leaving is better than failing the request.
            standby = [e for e in endpoints if not e.leaving and e.weight == 0.0
                       and id(e) not in excluded]
            return standby[0] if standby else None
        if not candidates:
            return None
        t = time.monotonic() if now is None else now
        healthy = [e for e in candidates if e.ejected_until <= t]
        pool = healthy or candidates
        if len(pool) == 1:
            return pool[0]
        total = sum(e.weight for e in pool)
        x = rng() * total
        for e in pool:
            x -= e.weight
            if x < 0:
                return e
        return pool[-1]

    def deployments(self) -> dict[str, Endpoint]:
        """Every endpoint in the table by deployment id."""
        return {e.deployment_id: e for eps in self.models.values() for e in eps}


EMPTY_TABLE = RoutingTable(models={}, version=0, source="none")


def _with_scheme(endpoint: str) -> str:
    return endpoint if "://" in endpoint else f"http://{endpoint}"


class TableParts:
    """A routing table the controller sent in parts (`RoutingTable.part` of `parts`, each
    under the gRPC message cap at a fleet's size): `add` returns the whole table once its
    every part has arrived, None before. A part of a newer version starts over; parts of
    an older one are dropped. A table sent whole (`parts` 0 or 1) passes straight on."""

    def __init__(self) -> None:
        self._version: int | None = None
        self._parts: dict[int, control_pb2.RoutingTable] = {}
        self._expected = 0

    def add(self, msg: control_pb2.RoutingTable) -> control_pb2.RoutingTable | None:
        if msg.parts <= 1:
            self._version, self._parts = None, {}
            return msg
        if self._version is None or msg.version > self._version or msg.parts != self._expected:
            self._version, self._parts, self._expected = msg.version, {}, msg.parts
        elif msg.version < self._version:
            return None
        if msg.part >= msg.parts:
            raise ValueError(f"routing table v{msg.version}: part {msg.part} of {msg.parts}")
        self._parts[msg.part] = msg
        if len(self._parts) < self._expected:
            return None
        whole = control_pb2.RoutingTable(version=msg.version)
        whole.generated.CopyFrom(self._parts[0].generated)
        for i in range(self._expected):
            whole.models.extend(self._parts[i].models)
        self._version, self._parts = None, {}
        return whole


def table_from_proto(msg: control_pb2.RoutingTable) -> RoutingTable:
    """Convert the controller's `RoutingTable` message into the gateway's table.

    Endpoints without a scheme get `http://`; weights that are negative or not
    finite count as 0 (no new requests) rather than breaking the weighted choice.
    """
    models: dict[str, tuple[Endpoint, ...]] = {}
    for route in msg.models:
        eps = tuple(
            Endpoint(
                deployment_id=e.deployment_id or e.endpoint,
                endpoint=_with_scheme(e.endpoint),
                weight=e.weight if math.isfinite(e.weight) and e.weight > 0 else 0.0,
                leaving=e.leaving,
                engine=e.engine,
                host_id=e.host_id,
                served_model_name=e.served_model_name if e.served_model_name != route.model else "",
            )
            for e in route.endpoints
            if e.endpoint
        )
        models[route.model] = models.get(route.model, ()) + eps
    return RoutingTable(models=models, version=msg.version, source="controller")


class _StaticEndpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(pattern=r"^https?://[^/\s]+/?$")
    weight: float = Field(default=1.0, ge=0)
    deployment_id: str | None = None
    leaving: bool = False
    engine: str = ""


def table_from_mapping(data: Any, where: str = "routes") -> RoutingTable:
    """Build a table from `{model: [{endpoint, weight, ...}, ...]}`; raises ConfigError naming the spot."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of model name to a list of endpoints, "
                          f"got {type(data).__name__}")
    models: dict[str, tuple[Endpoint, ...]] = {}
    for model, items in data.items():
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{where}: model names must be non-empty strings, got {model!r}")
        if not isinstance(items, list):
            raise ConfigError(f"{where}: {model}: expected a list of endpoints, "
                              f"got {type(items).__name__}")
        eps = []
        for i, item in enumerate(items):
            try:
                spec = _StaticEndpoint.model_validate(item)
            except ValidationError as err:
                detail = "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in err.errors()
                )
                raise ConfigError(f"{where}: {model}[{i}]: {detail}") from None
            eps.append(Endpoint(
                deployment_id=spec.deployment_id or f"{model}@{spec.endpoint.rstrip('/')}",
                endpoint=spec.endpoint,
                weight=spec.weight,
                leaving=spec.leaving,
                engine=spec.engine,
            ))
        models[model] = tuple(eps)
    return RoutingTable(models=models, version=0, source=where)


def load_routes_file(path: str | Path) -> RoutingTable:
    """Read a static routes file (YAML or JSON: model → list of {endpoint, weight})."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ConfigError(f"routes file {p}: cannot read: {err.strerror or err}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"routes file {p}: not valid {p.suffix.lstrip('.') or 'YAML'}: "
                          f"{err}") from None
    return table_from_mapping(data, where=str(p))
