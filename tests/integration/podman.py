"""Podman as the tests use it: installed and configured by scripts/podman-setup.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCAL_BASE_IMAGE = "localhost/gearshift-debian:bookworm"


def podman_env() -> dict[str, str]:
    """The environment podman runs with here; skips the test with the reason where none."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (scripts/podman-setup.sh installs it as root on "
                    "Debian/Ubuntu; `make test` and .ci/run call it)")
    env = {**os.environ, "GEARSHIFT_PODMAN_NO_INSTALL": "1"}
    setup = subprocess.run([str(REPO / "scripts" / "podman-setup.sh"), "--with-base"],
                           capture_output=True, text=True, env=env, timeout=900)
    if setup.returncode == 3:  # a package is missing and this run may not install it
        pytest.skip(f"podman is not usable here: {setup.stderr.strip()[-500:]}")
    assert setup.returncode == 0, f"scripts/podman-setup.sh failed:\n{setup.stderr[-3000:]}"
    for line in setup.stdout.splitlines():
        if line.startswith("export CONTAINERS_CONF="):
            env["CONTAINERS_CONF"] = line.split("=", 1)[1]
    probe = subprocess.run(["podman", "run", "--rm", "--network", "none", LOCAL_BASE_IMAGE,
                            "true"], capture_output=True, text=True, env=env, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run containers here: {probe.stderr.strip()[-500:]}")
    return env


