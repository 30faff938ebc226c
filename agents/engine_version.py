"""Find an engine's version when the agent's config does not give it.

The engine catalog names, per engine, a command that prints the version
(`EngineEntry.version_probe`); this runs it once, with a timeout, and reads the
first version-looking word. Any failure (not installed, timeout, no version in
the output) gives "" (unknown), as an unset config value does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Mapping, Sequence

VERSION_PROBE_TIMEOUT_S = 30.0  # engines import heavy packages before printing
_VERSION_RE = re.compile(r"\b\d+\.\d+(?:\.\d+)?(?:[.+-]?[A-Za-z0-9]+)*\b")


async def probe_version(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                        timeout_s: float = VERSION_PROBE_TIMEOUT_S) -> str:
    """The version `argv` prints on stdout, or "" when it cannot be found."""
    if not argv:
        return ""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            stdin=asyncio.subprocess.DEVNULL, env={**os.environ, **(env or {})})
    except OSError:
        return ""
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        return ""
    finally:
        if proc.returncode is None:  # timed out or cancelled: leave no process behind
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        return ""
    found = _VERSION_RE.search(out.decode(errors="replace"))
    return found.group(0) if found else ""
