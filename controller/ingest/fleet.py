"""Hot fleet state held in memory by the controller.

Agents' Hello and Report messages update it; the control API reads it. Host
liveness is derived from the time of the last report: a host that missed
`UNREACHABLE_AFTER_INTERVALS` report intervals is *unreachable*, which is shown
to people and never, by itself, triggers any action (docs/architecture.md, fail static).

The routing table for gateways is derived from the ready deployments; its
version increases whenever the set of endpoints or weights changes. A host that
is forgotten (gone for long, see `Persistence.prune_hosts`) or removed (revoked,
`remove_host`) takes its deployments out of the table with it.

Gateways' reports of their own counters (`ReportGateway`) are kept bounded in
`GatewayReports`.

A report costs O(the host's deployments): it compares their shape (ids,
endpoints, phases, models, engines) with the previous report's, and only a
changed shape updates the per-model index, the counts per engine and phase and
the routes of the models concerned. Views over the whole fleet are produced
lazily (`deployments`) or kept up to date (`deployment_counts`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from sys import intern

from gearshift.common.errors import ResourceExhausted
from gearshift.controller.ingest.engine_restarts import RestartTracker
from gearshift.controller.ingest.gateway_reports import GatewayReports
from gearshift.v1 import agent_pb2, control_pb2

UNREACHABLE_AFTER_INTERVALS = 3
# Distinct models the whole fleet may serve at once (controller/api/validation.py caps them
# per host): the fleet gearshift is sized for (10,000 hosts x 8 deployments) serves far
# fewer models than deployments.
MAX_FLEET_MODELS = 4096
# Route changes arriving together (a fleet reconnecting) are coalesced into one recomputation.
ROUTE_DEBOUNCE_S = 0.05
# Recomputations are spaced at least this many times their own cost apart (<= ~10% of a core).
ROUTE_REFRESH_COST_FACTOR = 10.0

Ready = agent_pb2.DEPLOYMENT_PHASE_READY
Draining = agent_pb2.DEPLOYMENT_PHASE_DRAINING

# (deployment_id, endpoint, phase, model, engine, served_model_name)
DeploymentShape = tuple[str, str, int, str, str, str]


def _shape(deps: Iterable[agent_pb2.DeploymentReport]) -> tuple[DeploymentShape, ...]:
    return tuple((d.deployment_id, d.endpoint, d.phase, d.model, d.engine, d.served_model_name)
                 for d in deps)


def _kept_shape(shape: tuple[DeploymentShape, ...]) -> tuple[DeploymentShape, ...]:
    """A shape to keep, its strings interned: each protobuf read makes a new string, and
    a deployment's id and endpoint are also kept by the routes, the rollups and the
    store's bookkeeping (one copy each instead of up to six), its model, engine and
    served name by every other host (about 3 KB per host of 8 deployments in all)."""
    return tuple((intern(s[0]), intern(s[1]), s[2], intern(s[3]), intern(s[4]), intern(s[5]))
                 for s in shape)


class Deployments(Mapping[str, agent_pb2.DeploymentReport]):
    """A host's latest deployment reports by id, kept serialized.

    A parsed report stays in memory with the whole message it came in (protobuf's
    arena): about 11 KB per host for 8 deployments, against under 3 KB for their
    bytes. Reads parse the deployment asked for (about a microsecond each) and hand
    out a fresh message: changing it changes nothing here.
    """

    __slots__ = ("_raw",)

    def __init__(self, deployments: Iterable[agent_pb2.DeploymentReport] = ()) -> None:
        self._raw = {d.deployment_id: d.SerializeToString() for d in deployments}

    @classmethod
    def of_bytes(cls, raw: dict[str, bytes]) -> Deployments:
        """Deployments already serialized, by id (the dict is kept, not copied)."""
        held = cls()
        held._raw = raw
        return held

    def __getitem__(self, deployment_id: str) -> agent_pb2.DeploymentReport:
        return agent_pb2.DeploymentReport.FromString(self._raw[deployment_id])

    def __contains__(self, deployment_id: object) -> bool:
        return deployment_id in self._raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


@dataclass(slots=True)
class HostEntry:
    """What the controller knows about one agent's host.

    Its `Hello` is kept serialized, and its GPUs too once a report replaced them: a
    parsed Hello holds the arena of the message it came in (about 4 KB for a host of 8
    GPUs, against a third of a KB as bytes; 37 MB over a fleet of 10,000), and GPUs
    taken from a report would hold that whole report. Readers (`hello`, `gpus`) parse
    a fresh copy (a few microseconds); the per-report path reads `host_id` and
    `gpu_model` only.
    """

    host_id: str
    interval_s: float
    hello_bytes: bytes  # the Hello as received
    gpu_model: str = ""  # of the host's first GPU ("" without GPUs): rollups carry it
    # (engine, version) of each engine installed whose version its Hello gives, read once
    # (the policy loop asks at every tick which release a model would move to)
    engine_versions: tuple[tuple[str, str], ...] = ()
    connected: bool = True
    last_report_ts: float = 0.0
    last_seq: int = 0
    reports: int = 0
    reported: bool = False  # a report arrived on the current stream
    # GPUs from the latest report that carried any, as a serialized Hello holding only
    # them; None: the Hello's GPUs still stand.
    gpus_bytes: bytes | None = None
    deployments: Deployments = field(default_factory=Deployments)
    deployments_at: float = 0.0  # when `deployments` were reported (all in one report)
    # route_key() of `deployments`, kept so a report compares against it without rebuilding it
    shape: tuple[DeploymentShape, ...] = ()
    # model -> request rate of its ready deployments that report metrics (`model_rates`)
    rates: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_hello(cls, hello: agent_pb2.Hello, interval_s: float,
                   last_report_ts: float) -> HostEntry:
        return cls(host_id=hello.host_id, interval_s=interval_s,
                   hello_bytes=hello.SerializeToString(),
                   gpu_model=hello.gpus[0].model if hello.gpus else "",
                   engine_versions=tuple((intern(e.engine), intern(e.version))
                                         for e in hello.engines if e.version),
                   last_report_ts=last_report_ts)

    @property
    def hello(self) -> agent_pb2.Hello:
        """The host's Hello (a fresh copy: changing it changes nothing here)."""
        return agent_pb2.Hello.FromString(self.hello_bytes)

    @property
    def gpus(self) -> list[agent_pb2.GpuInfo]:
        """The host's GPUs as last reported (a fresh copy), else as its Hello gave them."""
        raw = self.hello_bytes if self.gpus_bytes is None else self.gpus_bytes
        return list(agent_pb2.Hello.FromString(raw).gpus)

    def set_gpus(self, gpus: Iterable[agent_pb2.GpuInfo]) -> None:
        held = agent_pb2.Hello()
        held.gpus.extend(gpus)
        self.gpus_bytes = held.SerializeToString()
        self.gpu_model = held.gpus[0].model if held.gpus else ""

    @property
    def deployment_ts(self) -> dict[str, float]:
        """Deployment id -> when it was last reported."""
        return dict.fromkeys(self.deployments, self.deployments_at)

    def models(self) -> set[str]:
        return {d.model for d in self.deployments.values()}

    def route_key(self) -> tuple[DeploymentShape, ...]:
        """What of this host's deployments matters to the routing table and the counts."""
        return _shape(self.deployments.values())

    def state(self, now: float) -> int:
        if self.connected and not self.reported:
            # Between hello and the first report nothing is known of its deployments:
            # "unknown" must not read as "gone" (a migration would roll back for nothing).
            if now - self.last_report_ts > UNREACHABLE_AFTER_INTERVALS * self.interval_s:
                return control_pb2.HOST_STATE_UNREACHABLE
            return control_pb2.HOST_STATE_JOINING
        if self.connected and now - self.last_report_ts <= UNREACHABLE_AFTER_INTERVALS * self.interval_s:
            return control_pb2.HOST_STATE_CONNECTED
        if self.connected:
            return control_pb2.HOST_STATE_UNREACHABLE
        if now - self.last_report_ts <= UNREACHABLE_AFTER_INTERVALS * self.interval_s:
            # The stream closed moments ago; the host may be reconnecting.
            return control_pb2.HOST_STATE_DISCONNECTED
        return control_pb2.HOST_STATE_UNREACHABLE


RouteOverride = Callable[[str, list[control_pb2.RouteEndpoint]], list[control_pb2.RouteEndpoint]]


class FleetState:
    """In-memory view of hosts, deployments and the routing table."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.hosts: dict[str, HostEntry] = {}
        self.reports_total = 0
        self.started = clock()
        self._route_version = 0
        self._route_table: control_pb2.RoutingTable | None = None  # None: build on first read
        self._route_watchers: set[asyncio.Queue[control_pb2.RoutingTable]] = set()
        self._route_override: RouteOverride | None = None  # `route_with`
        self.gateway_stats = GatewayReports()
        self._routes_dirty = False
        self._routes_timer: asyncio.TimerHandle | None = None
        self._dirty_models: set[str] | None = set()
        # model -> (deployment id, endpoint, weight, leaving, served name) of each route
        self._route_keys: dict[str, tuple[tuple[str, str, float, bool, str], ...]] = {}
        self._route_bytes: dict[str, bytes] = {}  # model -> its serialized `models` entry
        # ids of the routed deployments, and the route version they are of (None: not built)
        self._routed_ids: frozenset[str] = frozenset()
        self._routed_ids_version: int | None = None
        self._refresh_cost_s = 0.0
        self._hosts_by_model: dict[str, set[str]] = {}
        # model -> host -> shapes of its routable (ready or draining, with endpoint) deployments
        self._routable: dict[str, dict[str, list[DeploymentShape]]] = {}
        self._counts: Counter[tuple[str, int]] = Counter()  # (engine, phase) -> deployments
        self.restarts = RestartTracker()  # engine restarts seen in reports (crash loops)

    # -- agents -----------------------------------------------------------------

    def hello(self, hello: agent_pb2.Hello, interval_s: float) -> HostEntry:
        prior = self.hosts.get(hello.host_id)
        entry = HostEntry.from_hello(hello, interval_s, self._clock())
        if prior is not None:
            # Keep the last known deployments until the first report replaces them.
            entry.deployments = prior.deployments
            entry.deployments_at = prior.deployments_at
            entry.shape = prior.shape
            entry.rates = prior.rates
            entry.reports = prior.reports
            entry.last_seq = 0
        self.hosts[hello.host_id] = entry  # its deployments, and so the routes, are unchanged
        return entry

    def check_models(self, report: agent_pb2.Report) -> None:
        """Refuse a report that would take the fleet past MAX_FLEET_MODELS distinct models
        (each model has its routes, rollups, metric series and decisions)."""
        known = self._hosts_by_model
        new = {d.model for d in report.deployments if d.model not in known}
        if new and len(known) + len(new) > MAX_FLEET_MODELS:
            raise ResourceExhausted(
                f"report.deployments: the fleet serves at most {MAX_FLEET_MODELS} distinct "
                f"models (MAX_FLEET_MODELS); {len(known)} are served and this report names "
                f"{len(new)} more")

    def report(self, host_id: str, report: agent_pb2.Report) -> bool:
        """Apply a report; returns False for a duplicate or out-of-order one."""
        entry = self.hosts[host_id]
        if report.seq and report.seq <= entry.last_seq:
            return False
        now = self._clock()
        entry.last_seq = report.seq
        entry.last_report_ts = now
        entry.reported = True
        entry.reports += 1
        self.reports_total += 1
        if report.gpus:
            entry.set_gpus(report.gpus)
        deps = report.deployments
        # One pass reads each field once for the kept bytes, the rates and the shape (a
        # protobuf field read costs about as much as the work done with it).
        raw: dict[str, bytes] = {}
        rates: dict[str, float] = {}
        shapes: list[DeploymentShape] = []
        restarted = False
        for d in deps:
            dep_id, phase, model = d.deployment_id, d.phase, d.model
            raw[dep_id] = d.SerializeToString()
            shapes.append((dep_id, d.endpoint, phase, model, d.engine, d.served_model_name))
            if phase == Ready and d.metrics_present:
                model = intern(model)  # kept until the next report: one string per model
                rates[model] = rates.get(model, 0.0) + d.request_rate
            if d.restarts:
                restarted = True
        if restarted:  # else there is no restart to count
            self.restarts.observe(host_id, entry.deployments,
                                  {d.deployment_id: d for d in deps}, now)
        entry.deployments = Deployments.of_bytes(raw)
        entry.deployments_at = now
        entry.rates = rates
        shape = tuple(shapes)
        if shape != entry.shape:
            # Rare (a deployment came, went or changed phase): the steady state skips all this.
            shape = _kept_shape(shape)
            before, entry.shape = entry.shape, shape
            self._counts.subtract((s[4], s[2]) for s in before)
            self._counts.update((s[4], s[2]) for s in shape)
            self._routes_changed(self._index_host(host_id, before, shape))
        return True

    def forget(self, host_id: str) -> None:
        """Remove a host that is gone (see `Persistence.prune_hosts`) with its deployments."""
        entry = self.hosts.pop(host_id, None)
        if entry is None:
            return
        self.restarts.forget_host(host_id)
        self._counts.subtract((s[4], s[2]) for s in entry.shape)
        self._routes_changed(self._index_host(host_id, entry.shape, ()))

    def remove_host(self, host_id: str) -> bool:
        """Forget a host that must get no more requests (revoked): like `forget`, but its
        deployments leave the routing table now, and route watchers get the new table
        now, not after the debounce. Returns whether the host was known."""
        if host_id not in self.hosts:
            return False
        self.forget(host_id)
        if self._routes_dirty:
            self._refresh_routes()
        return True

    def disconnected(self, host_id: str, entry: HostEntry) -> None:
        if self.hosts.get(host_id) is entry:
            entry.connected = False

    # -- reads ------------------------------------------------------------------

    def now(self) -> float:
        return self._clock()

    def host_state(self, host_id: str) -> int:
        return self.hosts[host_id].state(self._clock())

    def deployments(self) -> Iterator[tuple[str, agent_pb2.DeploymentReport, float]]:
        """(host_id, deployment, time of its last report) of every deployment: O(fleet),
        produced one at a time (a fleet-sized list would be garbage-collector work)."""
        for host_id, entry in self.hosts.items():
            at = entry.deployments_at
            for dep in entry.deployments.values():
                yield host_id, dep, at

    def deployments_of(self, model: str) -> list[tuple[str, agent_pb2.DeploymentReport, float]]:
        """Like `deployments`, for one model only: O(hosts serving the model)."""
        out: list[tuple[str, agent_pb2.DeploymentReport, float]] = []
        for host_id in sorted(self._hosts_by_model.get(model, ())):
            entry = self.hosts[host_id]
            deps = entry.deployments  # its shape names each one's model: parse only those
            out.extend((host_id, deps[s[0]], entry.deployments_at)
                       for s in entry.shape if s[3] == model and s[0] in deps)
        return out

    def deployment_counts(self) -> dict[tuple[str, int], int]:
        """How many deployments there are per (engine, phase), kept up to date by reports
        (for gauges: no walk over the fleet)."""
        return {k: n for k, n in self._counts.items() if n > 0}

    def host_state_counts(self) -> dict[int, int]:
        """How many hosts are in each `HostState` now."""
        now = self._clock()
        counts: Counter[int] = Counter(e.state(now) for e in self.hosts.values())
        return dict(counts)

    def model_rates(self) -> dict[str, float]:
        """Model -> total request rate of its ready deployments that report metrics, from
        what each host's last report left (O(hosts), nothing parsed: the walk over every
        deployment this replaces held the event loop for a fifth of a second at 10,000
        hosts)."""
        out: dict[str, float] = {}
        for entry in self.hosts.values():
            for model, rate in entry.rates.items():
                out[model] = out.get(model, 0.0) + rate
        return out

    def model_names(self) -> set[str]:
        """The models with at least one deployment, from the index reports keep up to date
        (the policy tick's list of models: no walk over the fleet)."""
        return set(self._hosts_by_model)

    def models(self) -> list[control_pb2.ModelSummary]:
        by_model: dict[str, control_pb2.ModelSummary] = {}
        for _host, dep, _ts in self.deployments():
            m = by_model.setdefault(dep.model, control_pb2.ModelSummary(model=dep.model))
            m.deployments += 1
            if dep.engine not in m.engines:
                m.engines.append(dep.engine)
            if dep.revision and dep.revision not in m.revisions:
                m.revisions.append(dep.revision)
            if dep.phase == Ready:
                m.ready += 1
                m.request_rate += dep.request_rate
                if dep.ttft.present:
                    m.ttft_p99_s = max(m.ttft_p99_s, dep.ttft.p99_s)
                    m.latency_present = True
                if dep.itl.present:
                    m.itl_p99_s = max(m.itl_p99_s, dep.itl.p99_s)
                    m.latency_present = True
        return [by_model[k] for k in sorted(by_model)]

    # -- routing ----------------------------------------------------------------
    #
    # Routes are recomputed per changed model (O(its endpoints)), soon after a change but no
    # more often than ROUTE_REFRESH_COST_FACTOR times the last recomputation took, so a fleet
    # (re)connecting at once cannot hold the event loop. The table is assembled from each
    # model's serialized entry, and only when someone reads it.

    @property
    def route_version(self) -> int:
        """Version of the routing table (without building it)."""
        if self._routes_dirty:
            self._refresh_routes()
        return self._route_version

    def routing_table(self) -> control_pb2.RoutingTable:
        if self._routes_dirty:
            self._refresh_routes()
        if self._route_table is None:
            table = control_pb2.RoutingTable(version=self._route_version)
            table.generated.FromSeconds(int(self._clock()))
            table.MergeFromString(b"".join(self._route_bytes[m] for m in sorted(self._route_bytes)))
            self._route_table = table
        return self._route_table

    def routed_deployment_ids(self) -> frozenset[str]:
        """Ids of the deployments in the routing table (built once per route version)."""
        version = self.route_version
        if self._routed_ids_version != version:
            self._routed_ids = frozenset(
                route[0] for key in self._route_keys.values() for route in key)
            self._routed_ids_version = version
        return self._routed_ids

    def _routes_changed(self, models: set[str] | None = None) -> None:
        """Mark models' routes stale (None: all) and recompute soon (at once outside a loop)."""
        if models is None:
            self._dirty_models = None
        elif self._dirty_models is not None:
            self._dirty_models |= models
        self._routes_dirty = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._refresh_routes()
            return
        if self._routes_timer is None:
            delay_s = max(ROUTE_DEBOUNCE_S, self._refresh_cost_s * ROUTE_REFRESH_COST_FACTOR)
            self._routes_timer = loop.call_later(delay_s, self._refresh_routes)

    def _compute_model_routes(self, model: str) -> list[control_pb2.RouteEndpoint]:
        found = sorted((s[0], host_id, s) for host_id, shapes in self._routable.get(model, {}).items()
                       for s in shapes)
        eps = [control_pb2.RouteEndpoint(
            deployment_id=dep_id, host_id=host_id, endpoint=s[1], engine=s[4], weight=1.0,
            served_model_name=s[5], leaving=s[2] == Draining) for dep_id, host_id, s in found]
        if eps and self._route_override is not None:
            eps = list(self._route_override(model, eps))
        active = [e for e in eps if not e.leaving and e.weight > 0]
        total = sum(e.weight for e in active)
        for e in eps:
            e.weight = e.weight / total if (total > 0 and not e.leaving) else 0.0
        return eps

    def _refresh_routes(self) -> None:
        started = time.perf_counter()
        self._routes_dirty = False
        if self._routes_timer is not None:
            self._routes_timer.cancel()
            self._routes_timer = None
        dirty = set(self._hosts_by_model) | set(self._route_keys) if self._dirty_models is None \
            else self._dirty_models
        self._dirty_models = set()
        changed = False
        for model in dirty:
            eps = self._compute_model_routes(model)
            key = tuple((intern(e.deployment_id), intern(e.endpoint), round(e.weight, 6),
                         e.leaving, intern(e.served_model_name)) for e in eps)  # kept: shared
            if self._route_keys.get(model, ()) == key:  # () : not in the table
                continue
            changed = True
            if eps:
                self._route_keys[model] = key
                self._route_bytes[model] = control_pb2.RoutingTable(
                    models=[control_pb2.ModelRoute(model=model, endpoints=eps)]).SerializeToString()
            else:
                self._route_keys.pop(model, None)
                self._route_bytes.pop(model, None)
        if changed:
            self._route_version += 1
            self._route_table = None
            if self._route_watchers:
                table = self.routing_table()
                for q in list(self._route_watchers):
                    if q.full():
                        q.get_nowait()  # a slow watcher only needs the newest table
                    q.put_nowait(table)
        self._refresh_cost_s = time.perf_counter() - started

    def route_with(self, override: RouteOverride | None) -> None:
        """Route through `override` from now on (a term's migrations set their targets'
        shares of traffic: `MigrationOrchestrator.route_override`), the table made again."""
        self._route_override = override
        self.refresh_routes()

    def refresh_routes(self, models: set[str] | None = None) -> None:
        """Recompute the routing table now (after a route override changed)."""
        self._routes_changed(models)
        self._refresh_routes()

    def _index_host(self, host_id: str, before: tuple[DeploymentShape, ...],
                    after: tuple[DeploymentShape, ...]) -> set[str]:
        """Re-index a host whose deployments changed; returns the models it had or has."""
        models_before = {s[3] for s in before}
        models_after = {s[3] for s in after}
        for m in models_before - models_after:
            hosts = self._hosts_by_model.get(m)
            if hosts is not None:
                hosts.discard(host_id)
                if not hosts:
                    del self._hosts_by_model[m]
        for m in models_after - models_before:
            self._hosts_by_model.setdefault(m, set()).add(host_id)
        for m in models_before:
            routable = self._routable.get(m)
            if routable is not None and routable.pop(host_id, None) is not None and not routable:
                del self._routable[m]
        for s in after:
            if s[1] and s[2] in (Ready, Draining):
                self._routable.setdefault(s[3], {}).setdefault(host_id, []).append(s)
        return models_before | models_after

    def watch_routes(self) -> asyncio.Queue[control_pb2.RoutingTable]:
        q: asyncio.Queue[control_pb2.RoutingTable] = asyncio.Queue(maxsize=1)
        q.put_nowait(self.routing_table())
        self._route_watchers.add(q)
        return q

    def unwatch_routes(self, q: asyncio.Queue[control_pb2.RoutingTable]) -> None:
        self._route_watchers.discard(q)
