"""The benches' emulated engines start as the benches spell them: each engine command
(bench/capacity.py for vLLM and TensorRT-LLM, bench/gateway.py's emulator upstream) is
run as is and must list its model on /v1/models. The emulator refuses options an
engine's own CLI does not take, so a bench whose command drifts from the engine's real
spelling would otherwise only fail when someone next runs it (about 2 s for all three)."""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

from gearshift.devfleet.local_fleet import spawn
from gearshift.devfleet.ports import free_port

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


def served_models(command: list[str], port: int, workdir: Path) -> list[str]:
    """Runs `command` until its /v1/models answers; the model ids it lists."""
    engine = spawn("engine", command, workdir)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not engine.alive():
                raise AssertionError(f"exited with {engine.popen.returncode}: {engine.log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models",
                                            timeout=2) as response:
                    return [row["id"] for row in json.load(response)["data"]]
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        raise AssertionError(f"not serving after 30 s: {engine.log()}")
    finally:
        engine.terminate()


@pytest.mark.parametrize("engine", sorted(capacity.SLOTS))
def test_the_capacity_bench_engines_start_as_spelled(engine: str, tmp_path: Path) -> None:
    port = free_port()
    command = capacity.engine_command(engine, port, tmp_path)
    assert served_models(command, port, tmp_path) == ["m"]


def test_the_gateway_bench_emulator_starts_as_spelled(tmp_path: Path) -> None:
    port = free_port()
    command = gateway.upstream_command("emulator", port)
    assert served_models(command, port, tmp_path) == [gateway.MODEL]
