"""A private PostgreSQL server for HA tests and benchmarks: initdb in a temp dir, own port.

The machine's shared server is never touched: `LocalPostgres` creates its own
cluster (trust auth, loopback only, fsync off: it holds test data only), starts
and stops it with pg_ctl — also abruptly (`stop(mode="immediate")`), to test
how controllers ride out a database restart — and removes it on `close()`.
PostgreSQL refuses to run as root; as root it runs as the `postgres` user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from gearshift.common.errors import ConfigError
from gearshift.devfleet.ports import free_port

START_TIMEOUT_S = 60


def pg_bindir() -> Path:
    """Where initdb and pg_ctl live (PATH, pg_config, or Debian's /usr/lib/postgresql)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True,
                             check=True).stdout.strip()
        if out and (Path(out) / "initdb").exists():
            return Path(out)
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(candidate) / "initdb").exists():
            return Path(candidate)
    raise ConfigError("PostgreSQL server binaries (initdb, pg_ctl) not found: install the "
                      "postgresql package")


class LocalPostgres:
    def __init__(self, port: int | None = None) -> None:
        self.bindir = pg_bindir()
        self.port = port or free_port()
        self.base = Path(tempfile.mkdtemp(prefix="gearshift-pg-"))
        self.data = self.base / "data"
        self.log = self.base / "server.log"
        self._user: str | None = None
        if os.geteuid() == 0:
            self._user = "postgres"
            pw = pwd.getpwnam(self._user)
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "-E", "UTF8", "--no-sync")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / tool), *args]
        if self._user is not None:
            cmd = ["runuser", "-u", self._user, "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT_S,
                              cwd=self.base)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{tool} failed ({proc.returncode}): {proc.stderr or proc.stdout}"
                               f"\n{self.server_log()[-2000:]}")
        return proc

    def server_log(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> None:
        opts = (f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off "
                # synchronous_commit stays on: a commit is in the WAL (the OS's cache, as
                # fsync is off) before it returns, so an immediate stop (the tests' database
                # crash) loses no committed row; with it off, the last commits were lost.
                f"-c full_page_writes=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w",
                  "-t", str(START_TIMEOUT_S), "start")

    def stop(self, mode: str = "fast") -> None:
        """`fast` (clients disconnected, clean), or `immediate` (as if it crashed)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
