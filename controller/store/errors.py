"""What a failing store says, in one line: "the store refused the write: disk full".

A database error (SQLite's "database or disk is full", PostgreSQL's "No space left on
device", a read-only file, a lost connection) is named by its cause, never shown as a
traceback or as gRPC's "Unexpected <class 'sqlalchemy.exc.OperationalError'>". The
interceptor (`controller.api.interceptors`) answers such a call UNAVAILABLE with that line;
the batching writer (`controller.store.writer`) counts it by cause and holds `/readyz` not
ready while writes fail.
"""

from __future__ import annotations

from gearshift.common.errors import Unavailable

# (what the database's message contains, lower case) -> the cause people read
_CAUSES = (
    (("disk is full", "no space left", "disk full", "could not extend file"), "disk full"),
    (("readonly", "read-only", "read only"), "read-only store"),
    (("database is locked", "could not obtain lock", "lock timeout"), "store locked"),
    (("disk i/o error", "i/o error", "input/output error"), "disk I/O error"),
    (("could not connect", "connection refused", "server closed the connection",
      "connection is closed", "terminating connection", "connection reset"),
     "store unreachable"),
    (("unable to open database", "no such file"), "store file missing"),
)
MAX_CAUSE_CHARS = 200


def store_cause(err: BaseException) -> str:
    """The cause of a database error in a few words (its first line when unknown)."""
    text = str(getattr(err, "orig", None) or err)
    low = text.lower()
    for needles, cause in _CAUSES:
        if any(n in low for n in needles):
            return cause
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return first[:MAX_CAUSE_CHARS]


def store_refused(err: BaseException) -> Unavailable:
    """The error a caller sees when the store refused its write."""
    return Unavailable(f"the store refused the write: {store_cause(err)}")
