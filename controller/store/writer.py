"""The one batching writer of the controller (docs/store.md).

The asyncio loop hands writes to `BatchingWriter.submit_*`, which never block
on the database: they coalesce the row into a pending set keyed by the row's
identity (last write wins, so a host reporting 500 times between two flushes is
written once). Rows are SQLModel objects or, on hot paths, plain dicts of
column values (see `gearshift.controller.store.upserts`); either way the writer keeps
a shallow copy of the values: do not mutate their JSON values afterwards. A
background thread commits the whole pending set in one transaction (Core
``INSERT … ON CONFLICT`` statements of up to `WRITE_CHUNK_ROWS` rows per table) every
`flush_interval_s`, or sooner once `max_batch` keys are pending. A failed commit is
logged and counted; its rows go back under anything submitted since, and the next round
retries them.

The pending set is bounded by `max_pending` keys: when it is full a write for a
new key is dropped and counted in ``gearshift_store_writes_dropped_total{kind,
reason="full"}`` (an update of a key already pending is always accepted). When
the database refuses the batch because of the rows themselves (a constraint or
a value it cannot store), the writer commits them one by one and drops, logs
and counts (reason="rejected") only the rows refused on their own, so one bad
row cannot block every later write.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from collections.abc import Hashable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any, TypeAlias

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlmodel import SQLModel

from gearshift.controller.store.database import Store
from gearshift.controller.store.errors import store_cause
from gearshift.controller.store.tables import CommandLogRow, DeploymentRow, HostRow, RollupRow
from gearshift.controller.store.upserts import (
    COMMANDS,
    DEPLOYMENTS,
    HOSTS,
    REVISIONS,
    ROLLUPS,
    SPECS,
    TableSpec,
    Values,
)

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0
MAX_BATCH = 1000
MAX_PENDING = 100_000
WRITE_CHUNK_ROWS = 1000  # rows per statement within a batch's transaction
CLOSE_TIMEOUT_S = 30.0

HostValues: TypeAlias = HostRow | Mapping[str, Any]
DeploymentValues: TypeAlias = DeploymentRow | Mapping[str, Any]
RollupValues: TypeAlias = RollupRow | Mapping[str, Any]
CommandValues: TypeAlias = CommandLogRow | Mapping[str, Any]


PR_SET_NAME = 15  # prctl(2): set the calling thread's name
WRITER_THREAD_NAME = "gs-store-writer"  # as `top -H` and /proc/PID/task/*/comm show it


def name_os_thread(name: str) -> None:
    """Give the calling thread its name in the OS too (Linux, 15 bytes), so per-thread
    CPU (top -H, bench/ingest.py) can tell the writer from the event loop and gRPC's
    threads; elsewhere, nothing."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


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
        for spec in SPECS:  # present from the start, so increase() sees the first drop
            for reason in ("full", "rejected"):
                self.dropped.labels(spec.kind, reason)
        self.flush_seconds = Histogram(
            "gearshift_store_flush_seconds", "Time to commit one batch, in seconds.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry)
        self.pending = Gauge(
            "gearshift_store_pending_writes", "Rows waiting for the next batch commit.",
            registry=registry)
        self.failing = Gauge(
            "gearshift_store_writes_failing",
            "1 while the store refuses the writer's commits (/readyz says not ready), else 0.",
            registry=registry)
        self.refusals = Counter(
            "gearshift_store_refusals_total",
            "Commits the store refused, by cause (disk full, read-only store, store locked, "
            "disk I/O error, store unreachable, ...).", ["cause"], registry=registry)


class _Pending:
    """Pending rows (column values) per table, keyed by identity; None: delete that row."""

    def __init__(self) -> None:
        self.rows: dict[TableSpec, dict[Hashable, Values | None]] = {spec: {} for spec in SPECS}
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def put(self, spec: TableSpec, key: Hashable, values: Values | None) -> None:
        rows = self.rows[spec]
        if key not in rows:
            self.count += 1
        rows[key] = values

    def has(self, spec: TableSpec, key: Hashable) -> bool:
        return key in self.rows[spec]

    def write(self, conn: sa.Connection) -> None:
        """Everything, in one transaction the caller owns: each table's rows in statements
        of at most `WRITE_CHUNK_ROWS` rows, in order. What a statement's rows cost beyond
        the pending set (their completed values, the driver's parameters) is then held
        for one chunk at a time: after a connect burst the set held 25,000 rows."""
        for spec in SPECS:
            rows = self.rows[spec]
            if rows:
                upserts = [v for v in rows.values() if v is not None]
                for start in range(0, len(upserts), WRITE_CHUNK_ROWS):
                    spec.write(conn, upserts[start:start + WRITE_CHUNK_ROWS], [])
                deleted = [k for k, v in rows.items() if v is None]
                if deleted:
                    spec.write(conn, [], deleted)

    def singles(self) -> Iterator[tuple[str, Hashable, _Pending]]:
        """(kind, key, a set holding only that row) for every pending row."""
        for spec in SPECS:
            for key, values in self.rows[spec].items():
                one = _Pending()
                one.put(spec, key, values)
                yield spec.kind, key, one

    def restore_under(self, newer: _Pending) -> None:
        """Put this (failed) set back, letting rows submitted since win."""
        for spec in SPECS:
            mine, theirs = self.rows[spec], newer.rows[spec]
            for key, values in mine.items():
                if key not in theirs:
                    newer.put(spec, key, values)


def _is_bad_data(err: Exception) -> bool:
    """True when the rows themselves are at fault (a retry cannot succeed): constraint or
    value errors, or a value the driver could not even bind. Anything else (connection
    lost, database locked, schema missing) is retried."""
    if isinstance(err, sa.exc.IntegrityError | sa.exc.DataError | TypeError | ValueError):
        return True  # TypeError/ValueError: a driver-side adapter could not encode a value
    return isinstance(err, sa.exc.StatementError) and not isinstance(err, sa.exc.DBAPIError)


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
        self.failing: str | None = None  # the cause while the store refuses commits
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

    def submit_host(self, row: HostValues) -> bool:
        """Insert or replace a host (an existing host keeps its `first_seen`)."""
        return self._submit(HOSTS, (row,)) == 1

    def submit_deployment(self, row: DeploymentValues) -> bool:
        return self._submit(DEPLOYMENTS, (row,)) == 1

    def submit_deployments(self, rows: Iterable[DeploymentValues]) -> int:
        """Returns how many of `rows` were accepted."""
        return self._submit(DEPLOYMENTS, rows)

    def submit_deployment_removal(self, deployment_id: str) -> bool:
        return self._put(DEPLOYMENTS, [(deployment_id, None)]) == 1

    def submit_rollups(self, rows: Iterable[RollupValues]) -> int:
        """Returns how many of `rows` were accepted."""
        return self._submit(ROLLUPS, rows)

    def submit_command(self, row: CommandValues) -> bool:
        """Insert a command, or update the phase and message of one already logged."""
        return self._submit(COMMANDS, (row,)) == 1

    def submit_revision(self, model: str, revision: str, published_at: datetime,
                        source: str) -> bool:
        """Record a published revision unless (model, revision) is already stored."""
        return self._put(REVISIONS, [((model, revision), {
            "model": model, "revision": revision, "published_at": published_at,
            "source": source})]) == 1

    def _submit(self, spec: TableSpec, rows: Iterable[SQLModel | Mapping[str, Any]]) -> int:
        """Rows are SQLModel objects or dicts of column values (cheaper to build on a hot
        path); a dict with unknown or missing required columns raises ValueError."""
        items = []
        for row in rows:
            values = spec.values(row)
            items.append((spec.key(values), values))
        return self._put(spec, items)

    def _put(self, spec: TableSpec, items: list[tuple[Hashable, Values | None]]) -> int:
        accepted = 0
        with self._lock:
            pending = self._pending  # swapped on every flush: read it under the lock
            for key, values in items:
                if self._closed or (len(pending) >= self._max_pending
                                    and not pending.has(spec, key)):
                    self.metrics.dropped.labels(
                        spec.kind, "closed" if self._closed else "full").inc()
                    continue
                pending.put(spec, key, values)
                accepted += 1
            self._accepted += accepted
            if len(pending) >= self._max_batch:
                self._wake.set()
        return accepted

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
        name_os_thread(WRITER_THREAD_NAME)
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
            self._commit(taken)
        except Exception as err:  # any database error: keep the rows and retry
            self.metrics.write_errors.inc()
            self._refused(err)
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
        if self.failing is not None:
            log.warning("the store accepts writes again (it refused them: %s)", self.failing)
            self.failing = None
            self.metrics.failing.set(0)

    def _refused(self, err: BaseException) -> None:
        """Name the cause once per episode (the retries say nothing new), count each."""
        cause = store_cause(err)
        self.metrics.refusals.labels(cause).inc()
        if self.failing is None:
            log.error("the store refused the write: %s", cause)
        self.failing = cause
        self.metrics.failing.set(1)

    def _commit(self, rows: _Pending) -> None:
        with self._store.engine.begin() as conn:
            rows.write(conn)

    def _salvage(self, taken: _Pending) -> _Pending:
        """Commit rows one at a time; drop (log, count) those the database refuses on
        their own. Returns the rows to retry later (the database failed otherwise)."""
        retry = _Pending()
        for kind, key, one in taken.singles():
            try:
                self._commit(one)
            except Exception as err:
                if not _is_bad_data(err):
                    one.restore_under(retry)
                    continue
                self.metrics.dropped.labels(kind, "rejected").inc()
                log.error("store dropped %s %r the database refuses: %s", kind, key, err)
        return retry
