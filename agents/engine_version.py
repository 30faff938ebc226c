"""Find an engine's version when the agent's config does not give it, without importing it.

First `metadata_version`: the `Version:` of the engine's installed package
(`EngineEntry.package`), read from its `*.dist-info/METADATA` in the site-packages
of the Python interpreter that runs the configured executable (the executable
itself when it is a Python, else the interpreter its `#!` line names). That is a
few file reads, so the agent knows the version before it starts any engine.

Else `probe_version`: the catalog's command that prints the version
(`EngineEntry.version_probe`, e.g. `vllm --version`), run once with a timeout;
the first version-looking word of its output. Any failure (not installed,
timeout, no version in the output) gives "" (unknown), as an unset config value does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

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


def _interpreter(executable: Sequence[str], env: Mapping[str, str] | None) -> Path | None:
    """The Python interpreter that runs `executable` (None when it is not a Python program)."""
    if not executable:
        return None
    path_var = (env or {}).get("PATH", os.environ.get("PATH", ""))
    found = shutil.which(executable[0], path=path_var)
    if found is None:
        return None
    program = Path(found)
    if program.name.startswith("python"):
        return program
    try:
        with program.open("rb") as f:
            first = f.readline(512).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!") or "python" not in first:
        return None
    words = first[2:].split()
    if not words:
        return None
    if Path(words[0]).name == "env" and len(words) > 1:  # #!/usr/bin/env python3
        which = shutil.which(words[-1], path=path_var)
        return Path(which) if which else None
    return Path(words[0])


def _site_dirs(interpreter: Path) -> list[Path]:
    """site-packages / dist-packages folders of an interpreter's prefix (venv or system)."""
    prefix = interpreter.parent.parent  # <prefix>/bin/python3
    dirs: list[Path] = []
    for pattern in ("lib/python3*/site-packages", "lib64/python3*/site-packages",
                    "local/lib/python3*/dist-packages", "lib/python3/dist-packages"):
        dirs.extend(sorted(prefix.glob(pattern)))
    return dirs


def metadata_version(package: str, executable: Sequence[str],
                     env: Mapping[str, str] | None = None) -> str:
    """The installed version of `package` next to `executable`'s interpreter, or ""."""
    if not package:
        return ""
    interpreter = _interpreter(executable, env)
    if interpreter is None:
        return ""
    wanted = re.sub(r"[-_.]+", "_", package).lower()
    for site in _site_dirs(interpreter):
        for info in sorted(site.glob("*.dist-info")):
            name = info.name[:-len(".dist-info")].rsplit("-", 1)[0]
            if re.sub(r"[-_.]+", "_", name).lower() != wanted:
                continue
            try:
                text = (info / "METADATA").read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            found = re.search(r"^Version:\s*(\S+)", text, re.MULTILINE)
            if found:
                return found.group(1)
    return ""
