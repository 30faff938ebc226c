"""A Docker engine of the tests' own: `dockerd` (Debian's docker.io) with host networking
only (no bridge, no iptables: nothing on the host's network changes), its data under
build/docker so that loaded images stay between runs, on a socket of its own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from gearshift.devfleet.podman_service import api_answers
from integration.podman import REPO

START_TIMEOUT_S = 60.0


class DockerDaemon:
    def __init__(self, data_root: Path = REPO / "build" / "docker") -> None:
        self.data_root = data_root
        # A short exec root: a Unix socket's path must stay under 108 bytes.
        self.exec_root = Path(tempfile.mkdtemp(prefix="gs-dockerd-"))
        self.socket_path = self.exec_root / "docker.sock"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.url}

    def start(self) -> str:
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            pytest.skip("dockerd is not installed (scripts/podman-setup.sh installs "
                        "docker.io as root on Debian/Ubuntu)")
        self.data_root.mkdir(parents=True, exist_ok=True)
        log = (self.exec_root / "dockerd.log").open("ab")
        self._proc = subprocess.Popen(
            [dockerd, "--iptables=false", "--ip6tables=false", "--bridge=none",
             "--data-root", str(self.data_root), "--exec-root", str(self.exec_root / "exec"),
             "--pidfile", str(self.exec_root / "dockerd.pid"), "-H", self.url],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                pytest.skip(f"dockerd cannot run here (exit {self._proc.returncode}): "
                            f"{self.log()[-800:]}")
            if self._answers():
                return self.url
            time.sleep(0.2)
        self.stop()
        pytest.skip(f"dockerd did not answer within {START_TIMEOUT_S:g} s: {self.log()[-800:]}")

    def _answers(self) -> bool:
        return api_answers(self.socket_path)

    def log(self) -> str:
        try:
            return (self.exec_root / "dockerd.log").read_text(errors="replace")
        except OSError:
            return ""

    def load_from_podman(self, images: list[str], podman_env: dict[str, str]) -> None:
        """Copy `images` from podman's store into this engine where it lacks them or has
        another build (no registry between the two: `podman save | docker load`, which
        keeps the image id)."""
        for image in images:
            want = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", image],
                                  capture_output=True, text=True, env=podman_env).stdout.strip()
            have = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image],
                                  capture_output=True, text=True, env=self.env).stdout.strip()
            if want and have.removeprefix("sha256:") == want:
                continue
            save = subprocess.Popen(["podman", "save", image], stdout=subprocess.PIPE,
                                    env=podman_env)
            load = subprocess.run(["docker", "load"], stdin=save.stdout, capture_output=True,
                                  text=True, env=self.env, timeout=600)
            assert save.wait(600) == 0 and load.returncode == 0, load.stderr[-2000:]

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        shutil.rmtree(self.exec_root, ignore_errors=True)
