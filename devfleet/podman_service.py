"""Podman's API service on a socket of its own, for tests and the demo.

`podman system service` serves the Docker Engine API (and Podman's own) on a Unix
socket; the agent's container launcher talks to it as it would to the host's
`podman.socket` unit or to dockerd. One per test or demo run, in its work dir, so that
nothing of the host's own service is touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from gearshift.common.engines import CATALOG

START_TIMEOUT_S = 30.0
# The emulated engine images of `make image-engines` (scripts/build-engine-images.sh), by
# engine: the release each emulates is its catalog entry's `image.emulated_release`.
EMULATED_IMAGES = {e.name: f"localhost/gearshift-emulated-{e.name}:{e.image.emulated_release}"
                   for e in CATALOG if e.image is not None and e.image.emulated_release}


def configured_ulimits(env: dict[str, str] | None = None) -> dict[str, int]:
    """The `default_ulimits` of the containers.conf that $CONTAINERS_CONF names (what
    scripts/podman-setup.sh writes), as `containers.ulimits` takes them: Podman's API
    drops them once a container asks for any ulimit, so an agent names them again."""
    path = (env or os.environ).get("CONTAINERS_CONF", "")
    if not path:
        return {}
    try:
        import tomllib
        with open(path, "rb") as f:
            listed = tomllib.load(f).get("containers", {}).get("default_ulimits", [])
    except (OSError, ValueError):
        return {}
    out = {}
    for item in listed:
        name, _, value = str(item).partition("=")
        soft, _, hard = value.partition(":")
        if name and (hard or soft).lstrip("-").isdigit():
            out[name] = int(hard or soft)
    return out


def api_answers(socket_path: Path) -> bool:
    """A container runtime's API answers on the Unix socket `socket_path` (`/_ping`)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(str(socket_path))
            s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.")
        except OSError:
            return False


class PodmanService:
    """Starts and stops `podman system service` on `<workdir>/podman.sock`."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.env = {**os.environ, **(env or {})}
        self.socket_path = workdir / "podman.sock"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self) -> str:
        """Start the service; returns its URL once it answers."""
        podman = shutil.which("podman")
        if podman is None:
            raise RuntimeError("podman is not installed (scripts/podman-setup.sh installs it)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        log = (self.workdir / "podman-service.log").open("ab")
        self._proc = subprocess.Popen([podman, "system", "service", "--time=0", self.url],
                                      stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                      start_new_session=True)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"podman system service exited with {self._proc.returncode}"
                                   f": {self.log()[-2000:]}")
            if self._answers():
                return self.url
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"podman system service did not answer on {self.url} within "
                           f"{START_TIMEOUT_S:g} s")

    def _answers(self) -> bool:
        return api_answers(self.socket_path)

    def log(self) -> str:
        try:
            return (self.workdir / "podman-service.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def __enter__(self) -> PodmanService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
