"""Process limits the controller needs at fleet scale.

Every agent host holds one gRPC connection (one file descriptor) to the
controller, and gateways, CLI calls, the store and the metrics endpoint add more.
Many systems start processes with a soft limit of 1,024 open files while the hard
limit is far higher; a controller left at 1,024 refuses connections (accept fails
with EMFILE, which gRPC reports to clients as UNAVAILABLE or a cancelled stream)
from about the thousandth host. `raise_open_files_limit` lifts the soft limit to
the hard one at start-up, as Go's runtime does for its servers; it never lowers
anything and never raises the hard limit (that needs privileges and is the
operator's choice: `LimitNOFILE=` in a systemd unit, `ulimit -Hn`).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

FDS_PER_AGENT = 1  # one HTTP/2 connection per agent host


def raise_open_files_limit() -> tuple[int, int] | None:
    """Lift RLIMIT_NOFILE's soft limit to the hard one; returns (soft, hard) after, or
    None where the platform has no such limit."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
        return soft, hard
    log.info("open-files limit raised from %d to %d (about %d agent hosts)", soft, target,
             target // FDS_PER_AGENT)
    return target, hard
