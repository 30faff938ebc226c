"""Helpers for tests that run the whole fleet as real processes on loopback."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from gearshift.devfleet.load import LoadGenerator, Target
from gearshift.devfleet.local_fleet import LocalFleet
from gearshift.devfleet.waiting import wait_for

__all__ = ["FAST_ENGINE_ENV", "engine_prefix", "gateway_load", "gearshift", "gearshift_json",
           "steady_load", "wait_for"]  # wait_for lives with the development fleet; tests import it from here


def engine_prefix(root: Path, *, dist: str | None, version: str = "") -> Path:
    """A venv-shaped prefix whose python3 runs this interpreter; with `dist`, that
    package's METADATA sits in its site-packages (as `pip install` leaves it), so an
    agent reads the engine's version there as it does on a GPU host."""
    bindir = root / "bin"
    bindir.mkdir(parents=True)
    python = bindir / "python3"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    if dist:
        info = root / "lib" / "python3.12" / "site-packages" / f"{dist}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return python


FAST_ENGINE_ENV = {
    "vllm": {"GEARSHIFT_EMULATOR_LOAD_S": "0.3"},
    "tensorrt-llm": {"GEARSHIFT_EMULATOR_LOAD_S": "0.3"},
}


def gearshift(fleet: LocalFleet, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "gearshift.cli.main", "--controller", fleet.controller_addr, *args],
        capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"gearshift {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def gearshift_json(fleet: LocalFleet, *args: str) -> Any:
    return json.loads(gearshift(fleet, *args, "-o", "json").stdout)


# Rates of the tests' clients: enough to measure and to catch a failed request, light
# enough for a loaded 2-core machine.
GATEWAY_RPS = 30.0
STEADY_RPS = 20.0


def gateway_load(gateway_url: str, model: str, rps: float = GATEWAY_RPS) -> LoadGenerator:
    """Clients of the gateway for `model`, half of them streaming (use as a context)."""
    return LoadGenerator.gateway(gateway_url, {model: rps})


def steady_load(targets: list[tuple[str, str]], rps: float = STEADY_RPS) -> LoadGenerator:
    """Clients of engine endpoints: (base URL, model) pairs sharing `rps`."""
    return LoadGenerator([Target(url, model, rps / len(targets)) for url, model in targets])
