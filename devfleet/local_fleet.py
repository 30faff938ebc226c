"""A whole gearshift fleet on loopback: controller, agents with emulated engines, gateway.

Used by `gearshift demo`, the integration tests and the benchmarks. Every part is a real
child process started through its real command line; only the engine
executable is the emulator (`python -m gearshift.agents.emulator`), which the
agents launch exactly as they would launch `vllm` or `trtllm-serve`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from gearshift.agents.emulator.flavors import get_flavor
from gearshift.common.engines import CATALOG
from gearshift.devfleet.ports import free_port
from gearshift.devfleet.waiting import wait_file, wait_for

READY_TIMEOUT_S = 30.0


def emulator_executable(flavor: str) -> list[str]:
    return [sys.executable, "-m", "gearshift.agents.emulator", "--flavor", flavor, "--"]


def gearshift_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gearshift.cli.main", *args]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self, grace_s: float = 10.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        # Engines the process started live in its process group: make sure none stays.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL the process alone (its engines stay: this is the crash case)."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def spawn(name: str, cmd: list[str], workdir: Path, env: dict[str, str] | None = None) -> Proc:
    """Start `cmd` in its own session (its engines in its process group), logging to
    ``workdir/NAME.log``."""
    log_path = workdir / f"{name}.log"
    log = log_path.open("ab")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                             start_new_session=True, cwd=workdir)
    log.close()
    return Proc(name, popen, log_path)


def wait_ready_file(path: Path, proc: Proc, timeout_s: float = READY_TIMEOUT_S) -> str:
    """What `proc` wrote to its ready file; its log tail in the error when it never did."""
    return wait_file(path, proc.alive,
                     lambda: f"{proc.name} (exit {proc.popen.returncode}):\n{proc.log()[-3000:]}",
                     timeout_s)


@dataclass
class LocalFleet:
    """Starts and stops the parts; knows their addresses."""

    workdir: Path
    report_interval_s: float = 1.0
    db_url: str = ""
    controller_port: int = 0
    metrics_port: int = 0
    gateway_port: int = 0
    gateway_metrics_port: int = 0  # the gateway's /metrics, /healthz, /readyz
    enrol_port: int = 0  # the controller's enrolment listener (0: none)
    procs: dict[str, Proc] = field(default_factory=dict)
    # Engines as containers: the agents' `containers:` block, and an image per engine
    # (engines without one run as host programs).
    containers: dict[str, Any] | None = None
    images: dict[str, str] = field(default_factory=dict)

    @property
    def controller_addr(self) -> str:
        return f"127.0.0.1:{self.controller_port}"

    def start_controller(self, extra_args: tuple[str, ...] = (),
                         env: dict[str, str] | None = None) -> Proc:
        self.workdir.mkdir(parents=True, exist_ok=True)
        ready = self.workdir / "controller.ready"
        ready.unlink(missing_ok=True)
        port = self.controller_port or 0
        args = ["controller", "--listen", f"127.0.0.1:{port}", "--data-dir",
                str(self.workdir / "data"), "--metrics-port", str(self.metrics_port or 0),
                "--report-interval", str(self.report_interval_s), "--ready-file", str(ready),
                *extra_args]
        if self.db_url:
            args += ["--db", self.db_url]
        proc = spawn("controller", gearshift_cmd(*args), self.workdir, env)
        grpc_port, metrics_port, enrol_port = wait_ready_file(ready, proc).split()
        self.controller_port, self.metrics_port = int(grpc_port), int(metrics_port)
        self.enrol_port = int(enrol_port)
        self.procs["controller"] = proc
        return proc

    def agent_config(self, host_id: str, deployments: list[dict[str, Any]],
                     emulator_env: dict[str, dict[str, str]] | None = None,
                     gpus: int = 4, tls: dict[str, str] | None = None) -> Path:
        engines: dict[str, dict[str, Any]] = {}
        for entry in CATALOG:  # every engine, each served by its emulator flavour
            flavor = entry.name
            if flavor in self.images:  # an emulated engine image (make image-engines)
                engines[flavor] = {"image": self.images[flavor],
                                   "env": (emulator_env or {}).get(flavor, {})}
                continue
            engines[flavor] = {"executable": emulator_executable(flavor),
                               "version": f"{get_flavor(flavor).default_version}-emulated",
                               "env": (emulator_env or {}).get(flavor, {})}
            if entry.build is not None:
                engines[flavor]["build_executable"] = [
                    sys.executable, "-m", "gearshift.agents.emulator", "--flavor", flavor,
                    "--build-s", "1", "--", "build"]
        cfg = {
            "host_id": host_id,
            "labels": {"zone": "local"},
            "controller": self.controller_addr,
            "report_interval_s": self.report_interval_s,
            "workdir": str(self.workdir / host_id),
            "gpus": {"source": "emulated",
                     "emulated": {"model": "NVIDIA H100 80GB HBM3", "count": gpus, "memory_gb": 80}},
            "engines": engines,
            "deployments": deployments,
        }
        if tls is not None:
            cfg["tls"] = tls
        if self.containers is not None:
            cfg["containers"] = self.containers
        path = self.workdir / f"{host_id}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def start_agent(self, host_id: str, deployments: list[dict[str, Any]],
                    emulator_env: dict[str, dict[str, str]] | None = None,
                    tls: dict[str, str] | None = None,
                    extra_args: tuple[str, ...] = (),
                    env: dict[str, str] | None = None) -> Proc:
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.agent_config(host_id, deployments, emulator_env, tls=tls)
        proc = spawn(host_id, gearshift_cmd("agent", "--config", str(path), *extra_args),
                     self.workdir, env)
        self.procs[host_id] = proc
        return proc

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def start_gateway(self) -> Proc:
        """Start the gateway and wait until it has its first routing table."""
        import urllib.error
        import urllib.request

        self.gateway_port = self.gateway_port or free_port()
        self.gateway_metrics_port = self.gateway_metrics_port or free_port()
        proc = spawn("gateway", gearshift_cmd(
            "gateway", "--controller", self.controller_addr,
            "--listen", f"127.0.0.1:{self.gateway_port}",
            "--metrics-listen", f"127.0.0.1:{self.gateway_metrics_port}"), self.workdir)
        self.procs["gateway"] = proc
        deadline = time.monotonic() + READY_TIMEOUT_S
        ready = f"http://127.0.0.1:{self.gateway_metrics_port}/readyz"
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(ready, timeout=2):
                    return proc
            except (urllib.error.URLError, OSError):
                if not proc.alive():
                    raise RuntimeError(f"gateway exited:\n{proc.log()[-3000:]}") from None
                time.sleep(0.1)
        raise TimeoutError(f"gateway not ready after {READY_TIMEOUT_S}s:\n{proc.log()[-3000:]}")

    def stop(self) -> None:
        # Agents first (they stop their engines), then the controller.
        for name in [n for n in self.procs if n != "controller"] + ["controller"]:
            proc = self.procs.get(name)
            if proc is not None:
                proc.terminate()
        self.procs.clear()
        kill_strays(self.workdir)


__all__ = ["READY_TIMEOUT_S", "LocalFleet", "Proc", "emulator_executable", "free_port",
           "gearshift_cmd", "kill_strays", "spawn", "wait_for", "wait_ready_file"]


def kill_strays(workdir: Path) -> int:
    """Kill engine processes left running under `workdir` (an agent that was SIGKILLed
    leaves its engines behind, as a crashed agent would on a real host)."""
    root = str(workdir.resolve())
    killed = 0
    for p in psutil.process_iter(["pid", "cwd"]):
        try:
            cwd = p.info.get("cwd") or ""
            if cwd.startswith(root) and p.pid != os.getpid():
                p.kill()
                killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed
