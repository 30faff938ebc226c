"""Several controllers on one PostgreSQL database, with agents and a gateway, on loopback.

`HaFleet` extends `LocalFleet` for the HA fault-injection tests and
`bench/failover.py`: every controller's port is chosen up front, so agents, the
gateway and the CLI get the whole list (``--controller a,b,c``) and follow the
leader themselves. Agents keep a command journal (one JSON line per command
that ran), from which `executions()` tells whether any command ran twice.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gearshift.devfleet.local_fleet import LocalFleet, Proc, gearshift_cmd, spawn, wait_ready_file
from gearshift.devfleet.ports import free_port
from gearshift.v1 import control_pb2, control_pb2_grpc


@dataclass
class HaFleet(LocalFleet):
    controllers: int = 2
    lease_ttl_s: float = 3.0
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i in range(self.controllers):
            self.ports[f"c{i + 1}"] = free_port()

    @property
    def names(self) -> list[str]:
        return list(self.ports)

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    @property
    def controller_addr(self) -> str:  # every controller: clients follow the leader
        return ",".join(self.addr(n) for n in self.names)

    def start_controller(self, extra_args: tuple[str, ...] = (), name: str = "c1") -> Proc:
        self.workdir.mkdir(parents=True, exist_ok=True)
        ready = self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        args = ["controller", "--listen", self.addr(name), "--controller-id", name,
                "--db", self.db_url, "--data-dir", str(self.workdir / f"data-{name}"),
                "--report-interval", str(self.report_interval_s), "--ready-file", str(ready),
                "--lease-ttl", str(self.lease_ttl_s), *extra_args]
        proc = spawn(name, gearshift_cmd(*args), self.workdir)
        wait_ready_file(ready, proc)
        self.procs[name] = proc
        return proc

    def start_all(self, extra_args: tuple[str, ...] = ()) -> None:
        for name in self.names:
            self.start_controller(extra_args, name)

    def agent_config(self, host_id: str, deployments: list[dict[str, Any]],
                     emulator_env: dict[str, dict[str, str]] | None = None,
                     gpus: int = 4, tls: dict[str, str] | None = None) -> Path:
        import yaml

        path = super().agent_config(host_id, deployments, emulator_env, gpus, tls)
        cfg = yaml.safe_load(path.read_text())
        cfg["command_journal"] = str(self.journal(host_id))
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def journal(self, host_id: str) -> Path:
        return self.workdir / f"{host_id}.commands.jsonl"

    def executions(self) -> Counter[str]:
        """How many times each command id ran, over every agent's journal."""
        runs: Counter[str] = Counter()
        for path in self.workdir.glob("*.commands.jsonl"):
            for line in path.read_text().splitlines():
                if line.strip():
                    runs[json.loads(line)["command_id"]] += 1
        return runs

    def status(self, name: str, timeout_s: float = 2.0) -> control_pb2.ControllerStatusResponse | None:
        """ControllerStatus of one controller, or None when it does not answer."""
        with grpc.insecure_channel(self.addr(name)) as channel:
            try:
                return control_pb2_grpc.ControlServiceStub(channel).ControllerStatus(
                    control_pb2.ControllerStatusRequest(), timeout=timeout_s)
            except grpc.RpcError:
                return None

    def leader(self) -> tuple[str, int] | None:
        """(name, epoch) of the controller that says it leads, if exactly one does."""
        leading = []
        for name in self.names:
            proc = self.procs.get(name)
            if proc is None or not proc.alive():
                continue
            st = self.status(name)
            if st is not None and st.leader:
                leading.append((name, int(st.epoch)))
        return leading[0] if len(leading) == 1 else None

    def wait_leader(self, timeout_s: float = 30.0, not_name: str | None = None,
                    min_epoch: int = 0) -> tuple[str, int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.leader()
            if found is not None and found[0] != not_name and found[1] >= min_epoch:
                return found
            time.sleep(0.1)
        raise TimeoutError(f"no leader (other than {not_name}) with epoch >= {min_epoch} "
                           f"after {timeout_s}s")

    def pause(self, name: str) -> None:
        self.procs[name].popen.send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.procs[name].popen.send_signal(signal.SIGCONT)

    def cli(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gearshift.cli.main", "--controller", self.controller_addr,
             *args], capture_output=True, text=True, timeout=timeout_s)

    def stop(self) -> None:
        for proc in self.procs.values():  # a paused process would never see SIGTERM
            if proc.alive():
                proc.popen.send_signal(signal.SIGCONT)
        agents = [n for n in self.procs if n not in self.ports]
        for name in agents + self.names:
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.terminate()
        super().stop()
