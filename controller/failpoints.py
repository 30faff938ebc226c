"""Named crash points for fault-injection tests that run the controller as a real process.

With ``GEARSHIFT_FAILPOINTS=NAME[,NAME…]`` in its environment, a controller that
reaches `reach(NAME)` logs it and stops itself with SIGSTOP at that instant; the
test then reads the stored state and kills the process with SIGKILL, which is
exactly what a crash at that point leaves behind. Without the variable (always,
in production) `reach` is one lookup in an empty set.

Points:
- ``migration-end-saved``: a migration's end (done, rolled back, aborted) was just
  committed; nothing else has happened yet (its decision is still `executing`).
"""

from __future__ import annotations

import logging
import os
import signal

FAILPOINTS_ENV = "GEARSHIFT_FAILPOINTS"
MIGRATION_END_SAVED = "migration-end-saved"
KNOWN = frozenset({MIGRATION_END_SAVED})

log = logging.getLogger(__name__)

_ARMED = frozenset(n.strip() for n in os.environ.get(FAILPOINTS_ENV, "").split(",") if n.strip())
if _ARMED - KNOWN:
    raise SystemExit(f"{FAILPOINTS_ENV}: unknown failpoint(s) {', '.join(sorted(_ARMED - KNOWN))}; "
                     f"known: {', '.join(sorted(KNOWN))}")


def reach(name: str) -> None:
    """Stop the process here when the failpoint `name` is armed."""
    if name in _ARMED:
        log.warning("failpoint %s reached: stopping the process (SIGSTOP)", name)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGSTOP)


__all__ = ["FAILPOINTS_ENV", "KNOWN", "MIGRATION_END_SAVED", "reach"]
