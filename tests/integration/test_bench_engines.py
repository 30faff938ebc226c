"""The benches' emulated engines start as the benches spell them: each engine command
(bench/capacity.py for vLLM and TensorRT-LLM, bench/gateway.py's emulator upstream) is
run as is and must answer /health and list its model. The emulator refuses options an
engine's own CLI does not take, so a bench whose command drifts from the engine's real
spelling would otherwise only fail when someone next runs it (about 2 s for all three)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

from integration.helpers import stop_child

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    # bench/ is not a package, and its gateway.py shares a name with the gateway/ folder.
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


capacity = bench_module("capacity")
gateway = bench_module("gateway")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def served_models(command: list[str], port: int, log: Path) -> list[str]:
    """Runs `command` until its /v1/models answers; the model ids it lists."""
    with log.open("wb") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if child.poll() is not None:
                raise AssertionError(f"exited with {child.returncode}: {log.read_text()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models",
                                            timeout=2) as response:
                    return [row["id"] for row in json.load(response)["data"]]
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        raise AssertionError(f"not serving after 30 s: {log.read_text()}")
    finally:
        stop_child(child)


@pytest.mark.parametrize("engine", sorted(capacity.SLOTS))
def test_the_capacity_bench_engines_start_as_spelled(engine: str, tmp_path: Path) -> None:
    port = free_port()
    command = capacity.engine_command(engine, port, tmp_path)
    assert served_models(command, port, tmp_path / "engine.log") == ["m"]


def test_the_gateway_bench_emulator_starts_as_spelled(tmp_path: Path) -> None:
    port = free_port()
    command = gateway.upstream_command("emulator", port)
    assert served_models(command, port, tmp_path / "engine.log") == [gateway.MODEL]
