"""What the controller writes durably, and when.

Hot state stays in memory (`FleetState`); this adapter turns it into rows for
the one batching writer: hosts on hello and then every few seconds, and a
deployment when its phase, revision or endpoint changes (and the revision it
reports, the first time it is seen). The per-minute rollups are built and handed
to the writer by the term's rate series (`controller.ingest.series`). The report
hot path only compares a few fields; rows are plain dicts of column values (no
SQLModel objects on the event loop).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from sys import intern
from typing import Any

from prometheus_client import CollectorRegistry

from gearshift.common.enum_labels import UNKNOWN, enum_label
from gearshift.controller.ingest.fleet import FleetState, HostEntry
from gearshift.controller.store.database import Store, default_sqlite_url
from gearshift.controller.store.tables import SETTING_PAUSED
from gearshift.controller.store.writer import BatchingWriter
from gearshift.v1 import agent_pb2

log = logging.getLogger(__name__)

# last_seen is for people and restarts; liveness itself lives in memory. Saves are
# spread over ticks (at most HOSTS_SAVED_PER_TICK rows) so a large fleet never
# stalls the event loop building thousands of rows at once.
HOST_SAVE_INTERVAL_S = 300.0
HOSTS_SAVED_PER_TICK = 200
# Hosts that are gone are forgotten: one that said hello and never reported after
# HELLO_ONLY_RETENTION_S, any other after HOST_RETENTION_S without a report.
HELLO_ONLY_RETENTION_S = 600.0
HOST_RETENTION_S = 7 * 86400.0


def _version_match(value: int) -> str:
    """"known", "nearest", "unknown" ("" when the agent did not say: before version tables)."""
    if value == agent_pb2.VERSION_MATCH_UNSPECIFIED:
        return ""
    return enum_label(agent_pb2.VersionMatch, "VERSION_MATCH_", value)


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)  # SQLite drops the zone


_PHASE_NAMES = {v: enum_label(agent_pb2.DeploymentPhase, "DEPLOYMENT_PHASE_", v)
                for v in agent_pb2.DeploymentPhase.values()}


class Persistence:
    def __init__(self, store: Store, writer: BatchingWriter) -> None:
        self.store = store
        self.writer = writer
        self._deployment_keys: dict[str, tuple[str, str, str, int]] = {}
        self._revisions: set[tuple[str, str]] = set()  # (model, revision) already submitted
        self._hosts_saved_at: dict[str, float] = {}
        self._paused_cache: bool | None = None

    @classmethod
    def open(cls, db_url: str, data_dir: Path, registry: CollectorRegistry) -> Persistence:
        url = db_url or default_sqlite_url(data_dir)
        store = Store.open(url)
        writer = BatchingWriter(store, registry=registry)
        return cls(store, writer)

    @property
    def dialect(self) -> str:
        return self.store.dialect

    def next_epoch(self) -> int:
        return self.store.bump_epoch()

    def reload_settings(self) -> None:
        """Forget cached settings (another controller may have changed them)."""
        self._paused_cache = None

    def paused(self) -> bool:
        if self._paused_cache is None:
            self._paused_cache = bool(self.store.get_setting(SETTING_PAUSED, False))
        return self._paused_cache

    def set_paused(self, value: bool) -> None:
        self.store.set_setting(SETTING_PAUSED, value)
        self._paused_cache = value

    def _host_row(self, entry: HostEntry) -> dict[str, Any]:
        h = entry.hello
        return {
            "host_id": h.host_id, "labels": dict(h.labels), "agent_version": h.agent_version,
            "gpus": [{"index": g.index, "uuid": g.uuid, "model": g.model,
                      "memory_total_bytes": g.memory_total_bytes} for g in entry.gpus],
            "engines": [{"engine": e.engine, "version": e.version, "executable": e.executable,
                         "release": e.release, "version_match": _version_match(e.version_match),
                         "version_source": e.version_source}
                        for e in h.engines],
            "last_seen": _dt(entry.last_report_ts),
            "last_report_seq": entry.last_seq or None,
        }

    def host_seen(self, entry: HostEntry) -> None:
        self.writer.submit_host(self._host_row(entry))
        self._hosts_saved_at[entry.host_id] = entry.last_report_ts

    def report(self, host_id: str, report: agent_pb2.Report, ts: float) -> None:
        """Submit the deployments of a host's report whose stored fields changed."""
        known = self._deployment_keys
        changed: list[dict[str, Any]] = []
        for dep in report.deployments:
            key = (host_id, dep.revision, dep.endpoint, dep.phase)
            if known.get(dep.deployment_id) != key:
                changed.append(self._deployment_changed(host_id, dep, key, ts))
        if changed:
            self.writer.submit_deployments(changed)

    def _deployment_changed(self, host_id: str, dep: agent_pb2.DeploymentReport,
                            key: tuple[str, str, str, int], ts: float) -> dict[str, Any]:
        # Kept, so interned: one string with the fleet's copies (see fleet._kept_shape).
        self._deployment_keys[intern(dep.deployment_id)] = (
            key[0], intern(key[1]), intern(key[2]), key[3])
        if dep.revision and (dep.model, dep.revision) not in self._revisions:
            # A revision an agent reports counts toward the model's churn.
            self._revisions.add((dep.model, dep.revision))
            self.writer.submit_revision(dep.model, dep.revision, _dt(ts), "agent")
        return {"deployment_id": dep.deployment_id, "host_id": host_id, "model": dep.model,
                "engine": dep.engine, "engine_version": dep.engine_version,
                "revision": dep.revision, "phase": _PHASE_NAMES.get(dep.phase, UNKNOWN),
                "endpoint": dep.endpoint, "updated": _dt(ts)}

    def save_hosts(self, fleet: FleetState) -> None:
        due = [e for hid, e in fleet.hosts.items()
               if e.last_report_ts - self._hosts_saved_at.get(hid, 0.0) >= HOST_SAVE_INTERVAL_S]
        due.sort(key=lambda e: self._hosts_saved_at.get(e.host_id, 0.0))
        due = due[:HOSTS_SAVED_PER_TICK]
        if due:
            for e in due:
                self.writer.submit_host(self._host_row(e))
                self._hosts_saved_at[e.host_id] = e.last_report_ts

    def prune_hosts(self, fleet: FleetState, now: float, *,
                    hello_only_s: float = HELLO_ONLY_RETENTION_S,
                    retention_s: float = HOST_RETENTION_S) -> list[str]:
        """Forget hosts that are gone, in memory then in the store; returns their ids."""
        return sorted({*self.prune_fleet(fleet, now, hello_only_s=hello_only_s,
                                         retention_s=retention_s),
                       *self.prune_stored(set(fleet.hosts), now, hello_only_s=hello_only_s,
                                          retention_s=retention_s)})

    def prune_fleet(self, fleet: FleetState, now: float, *,
                    hello_only_s: float = HELLO_ONLY_RETENTION_S,
                    retention_s: float = HOST_RETENTION_S) -> list[str]:
        """The in-memory half of `prune_hosts` (on the event loop)."""
        drop = [hid for hid, e in fleet.hosts.items() if not e.connected
                and now - e.last_report_ts > (retention_s if e.reports else hello_only_s)]
        for hid in drop:
            fleet.forget(hid)
            self._hosts_saved_at.pop(hid, None)
        return drop

    def prune_stored(self, live: set[str], now: float, *,
                     hello_only_s: float = HELLO_ONLY_RETENTION_S,
                     retention_s: float = HOST_RETENTION_S) -> list[str]:
        """The store half of `prune_hosts` (blocking: off the event loop). The store
        hands back only hosts seen before the shorter retention."""
        candidates = self.store.hosts_seen_before(_dt(now - min(hello_only_s, retention_s)))
        stored = [host_id for host_id, seen, reported in candidates if host_id not in live
                  and now - _aware(seen).timestamp() > (retention_s if reported else hello_only_s)]
        self.store.delete_hosts(stored)
        return stored

    def close(self, fleet: FleetState) -> None:
        """Save every host, then drain the writer (the rate series has handed on its open
        minutes by now: `RateSeries.close`)."""
        for e in fleet.hosts.values():
            self.writer.submit_host(self._host_row(e))
        self.writer.close()
        self.store.close()
