"""The one batching writer of the controller (DESIGN §7b).

The asyncio loop hands writes to `BatchingWriter.submit_*`, which never block
on the database: they coalesce the row into a pending set keyed by the row's
identity (last write wins, so a host reporting 500 times between two flushes is
written once). A background thread commits the whole pending set in one
transaction (`Store.write_batch`) every `flush_interval_s`, or sooner once
`max_batch` keys are pending. A failed commit is logged and counted; its rows
go back under anything submitted since, and the next round retries them.

The pending set is bounded by `max_pending` keys: when it is full a write for a
new key is dropped and counted in ``gearshift_store_writes_dropped_total{kind,
reason="full"}`` (an update of a key already pending is always accepted). When
the database refuses the batch because of the rows themselves (a constraint or
a value it cannot store), the writer commits them one by one and drops, logs
and counts (reason="rejected") only the rows refused on their own, so one bad
row cannot block every later write. Submitted rows are
copied (shallowly): do not mutate their JSON values afterwards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import TypeVar

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gearshift.controller.store import Store, WriteBatch
from gearshift.controller.tables import CommandLogRow, DeploymentRow, HostRow, RollupRow

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0
MAX_BATCH = 1000
MAX_PENDING = 100_000
CLOSE_TIMEOUT_S = 30.0

K = TypeVar("K")
V = TypeVar("V")


class WriterMetrics:
    """The writer's Prometheus metrics, registered in one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.write_errors = Counter(
            "gearshift_store_write_errors_total",
            "Batch commits that failed (their rows are retried on the next flush).",
            registry=registry)
        self.dropped = Counter(
            "gearshift_store_writes_dropped_total",
            "Writes dropped: reason=full (pending set full), closed (writer closed), "
            "rejected (the database refuses the row itself).",
            ["kind", "reason"], registry=registry)
        self.flush_seconds = Histogram(
            "gearshift_store_flush_seconds", "Time to commit one batch, in seconds.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry)
        self.pending = Gauge(
            "gearshift_store_pending_writes", "Rows waiting for the next batch commit.",
            registry=registry)


class _Pending:
    """Pending rows keyed by identity; a deployment mapped to None is to be deleted."""

    def __init__(self) -> None:
        self.hosts: dict[str, HostRow] = {}
        self.deployments: dict[str, DeploymentRow | None] = {}
        self.rollups: dict[tuple[str, str, datetime], RollupRow] = {}
        self.commands: dict[str, CommandLogRow] = {}

    def __len__(self) -> int:
        return len(self.hosts) + len(self.deployments) + len(self.rollups) + len(self.commands)

    def batch(self) -> WriteBatch:
        return WriteBatch(
            hosts=list(self.hosts.values()),
            deployments=[d for d in self.deployments.values() if d is not None],
            deleted_deployments=[k for k, d in self.deployments.items() if d is None],
            rollups=list(self.rollups.values()),
            commands=list(self.commands.values()),
        )

    def singles(self) -> Iterator[tuple[str, object, _Pending]]:
        """(kind, key, a set holding only that row) for every pending row."""
        for kind, name in _KINDS:
            for key, value in getattr(self, name).items():
                one = _Pending()
                getattr(one, name)[key] = value
                yield kind, key, one

    def restore_under(self, newer: _Pending) -> None:
        """Put this (failed) set back, letting rows submitted since win."""
        newer.hosts = _under(self.hosts, newer.hosts)
        newer.deployments = _under(self.deployments, newer.deployments)
        newer.rollups = _under(self.rollups, newer.rollups)
        newer.commands = _under(self.commands, newer.commands)


_KINDS = (("host", "hosts"), ("deployment", "deployments"), ("rollup", "rollups"),
          ("command", "commands"))


def _is_bad_data(err: Exception) -> bool:
    """True when the rows themselves are at fault (a retry cannot succeed): constraint or
    value errors, or a value the driver could not even bind. Anything else (connection
    lost, database locked, schema missing) is retried."""
    if isinstance(err, sa.exc.IntegrityError | sa.exc.DataError | TypeError | ValueError):
        return True  # TypeError/ValueError: a driver-side adapter could not encode a value
    return isinstance(err, sa.exc.StatementError) and not isinstance(err, sa.exc.DBAPIError)


def _under(older: dict[K, V], newer: dict[K, V]) -> dict[K, V]:
    merged = dict(older)
    merged.update(newer)
    return merged


class BatchingWriter:
    """Batches controller writes into one transaction per flush, on one thread."""

    def __init__(self, store: Store, *, flush_interval_s: float = FLUSH_INTERVAL_S,
                 max_batch: int = MAX_BATCH, max_pending: int = MAX_PENDING,
                 registry: CollectorRegistry | None = None) -> None:
        """`registry` defaults to a private one; pass the controller's to export metrics."""
        if flush_interval_s <= 0 or max_batch < 1 or max_pending < 1:
            raise ValueError(
                f"BatchingWriter needs flush_interval_s > 0, max_batch >= 1, max_pending >= 1; "
                f"got flush_interval_s={flush_interval_s}, max_batch={max_batch}, "
                f"max_pending={max_pending}")
        self._store = store
        self._interval_s = flush_interval_s
        self._max_batch = max_batch
        self._max_pending = max_pending
        self.metrics = WriterMetrics(registry or CollectorRegistry())
        self._lock = threading.Lock()
        self._durable_cv = threading.Condition(self._lock)
        self._pending = _Pending()
        self._accepted = 0  # writes accepted so far
        self._durable = 0  # of those, how many are committed
        self._closed = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.metrics.pending.set_function(lambda: len(self._pending))
        self._thread = threading.Thread(target=self._run, name="gearshift-store-writer",
                                        daemon=True)
        self._thread.start()

    # -- submit (non-blocking, thread-safe) ------------------------------------------------

    def submit_host(self, row: HostRow) -> bool:
        return self._submit("host", "hosts", row.host_id, row.model_copy())

    def submit_deployment(self, row: DeploymentRow) -> bool:
        return self._submit("deployment", "deployments", row.deployment_id, row.model_copy())

    def submit_deployment_removal(self, deployment_id: str) -> bool:
        return self._submit("deployment", "deployments", deployment_id, None)

    def submit_rollups(self, rows: list[RollupRow]) -> int:
        """Returns how many of `rows` were accepted."""
        return sum(self._submit("rollup", "rollups", (r.model, r.engine, r.minute),
                                r.model_copy()) for r in rows)

    def submit_command(self, row: CommandLogRow) -> bool:
        """Insert a command, or update the phase and message of one already logged."""
        return self._submit("command", "commands", row.command_id, row.model_copy())

    def _submit(self, kind: str, field: str, key: object, value: object) -> bool:
        with self._lock:
            # The pending set is swapped on every flush: look the dict up under the lock.
            pending: dict[object, object] = getattr(self._pending, field)
            if self._closed or (key not in pending and len(self._pending) >= self._max_pending):
                self.metrics.dropped.labels(kind, "closed" if self._closed else "full").inc()
                return False
            pending[key] = value
            self._accepted += 1
            if len(self._pending) >= self._max_batch:
                self._wake.set()
            return True

    # -- durability ---------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Rows waiting for a commit."""
        with self._lock:
            return len(self._pending)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Block until everything submitted so far is committed. False on timeout
        (e.g. the database is down; the rows stay queued)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            target = self._accepted
            if self._durable >= target:
                return True
            if not self._thread.is_alive():
                return False
            self._wake.set()
            while self._durable < target:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not self._thread.is_alive():
                    return False
                self._durable_cv.wait(left if left is not None else self._interval_s)
            return True

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Flush and stop the thread. False when some rows could not be committed."""
        ok = self.flush(timeout_s)
        with self._lock:
            self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        with self._lock:
            return ok and self._durable >= self._accepted

    # -- the writer thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            stopping = self._stop.is_set()
            self._flush_once()
            if stopping:
                break
        left = self.pending
        if left:
            log.error("store writer stopped with %d rows not committed", left)

    def _flush_once(self) -> None:
        with self._lock:
            if not len(self._pending):
                return
            taken, self._pending = self._pending, _Pending()
            target = self._accepted
        started = time.perf_counter()
        try:
            self._store.write_batch(taken.batch())
        except Exception as err:  # any database error: keep the rows and retry
            self.metrics.write_errors.inc()
            if _is_bad_data(err):
                log.warning("store batch of %d rows refused (%s); writing them one by one",
                            len(taken), err)
                taken = self._salvage(taken)
            else:
                log.warning("store batch of %d rows failed, retrying in %.1f s: %s",
                            len(taken), self._interval_s, err)
            if len(taken):
                with self._lock:
                    taken.restore_under(self._pending)
                return
        finally:
            self.metrics.flush_seconds.observe(time.perf_counter() - started)
        with self._lock:
            self._durable = max(self._durable, target)
            self._durable_cv.notify_all()

    def _salvage(self, taken: _Pending) -> _Pending:
        """Commit rows one at a time; drop (log, count) those the database refuses on
        their own. Returns the rows to retry later (the database failed otherwise)."""
        retry = _Pending()
        for kind, key, one in taken.singles():
            try:
                self._store.write_batch(one.batch())
            except Exception as err:
                if not _is_bad_data(err):
                    one.restore_under(retry)
                    continue
                self.metrics.dropped.labels(kind, "rejected").inc()
                log.error("store dropped %s %r the database refuses: %s", kind, key, err)
        return retry
