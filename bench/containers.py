"""Engines as containers: what a container costs over a process, and the agent's footprint.

    python bench/containers.py [--runs 5] [--engines 8] [--interval-s 5] [--window-s 60]
                               [--skip-agent]

Needs podman set up and the emulated engine images (`make image-engines`); run with the
environment `eval "$(scripts/podman-setup.sh --with-base)"` prints.

1. Start to ready: the vLLM emulator started by the agent's supervisor as a process
   (`EngineSupervisor`, the emulator as the executable) and as a container of
   `localhost/gearshift-emulated-vllm:0.11.0` (`ContainerSupervisor` through a Podman API
   service of the bench's own, the image already pulled), alternated, `--runs` times each:
   from `start()` until the health probe answers 200. Median and each run.
   Target: the container's median at most 2 s above the process's.
2. The agent: `bench/startup.py`'s measurement with every engine a container: a
   controller, one agent process supervising `--engines` engine containers (vLLM and
   TensorRT-LLM images, alternately) and reporting every `--interval-s`, sampled for
   `--window-s` (the engines are not the agent's children here: the runtime's).
   Target: <= 80 MB RSS and <= 1 % of a core.

Prints ONE JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import MachineWatch  # type: ignore[import-not-found]
from startup import TARGETS, measure_agent  # type: ignore[import-not-found]

from gearshift.agents.config import ContainersConfig
from gearshift.agents.runtimes.base import get_runtime
from gearshift.agents.runtimes.container_supervisor import ContainerSupervisor
from gearshift.agents.runtimes.containers import ContainerRuntime, ImageInfo
from gearshift.agents.runtimes.supervisor import EngineSupervisor
from gearshift.common.engine_versions import EngineRelease
from gearshift.common.spec import DeploymentSpec
from gearshift.devfleet.local_fleet import LocalFleet, emulator_executable
from gearshift.devfleet.podman_service import EMULATED_IMAGES, PodmanService, configured_ulimits

ENV = {"GEARSHIFT_EMULATOR_LOAD_S": "0.3"}
TARGET_EXTRA_S = 2.0


async def _no_release(info: ImageInfo) -> EngineRelease | None:
    return None  # the newest row: the image is the emulator's 0.11.0


async def start_to_ready(runs: int, workdir: Path, url: str) -> dict[str, Any]:
    settings = ContainersConfig(runtime="podman", endpoint=url, ulimits=configured_ulimits())
    runtime = ContainerRuntime(settings)
    times: dict[str, list[float]] = {"process": [], "container": []}
    try:
        for i in range(runs):
            for kind in ("process", "container"):
                spec = DeploymentSpec(deployment_id=f"b{i}-{kind}", model="b", engine="vllm",
                                      source="org/b")
                sup: EngineSupervisor
                if kind == "process":
                    sup = EngineSupervisor(spec, get_runtime("vllm"),
                                           executable=emulator_executable("vllm"), env=ENV,
                                           workdir=workdir / spec.deployment_id)
                else:
                    sup = ContainerSupervisor(
                        spec, get_runtime("vllm"), env=ENV, workdir=workdir / spec.deployment_id,
                        containers=runtime, settings=settings, image=EMULATED_IMAGES["vllm"],
                        host_id="bench", gpus_emulated=True, on_image=_no_release)
                t0 = time.perf_counter()
                await sup.start()
                ready = await sup.wait_ready(60)
                took = time.perf_counter() - t0
                await sup.stop(grace_s=5)
                if not ready:
                    raise RuntimeError(f"{kind} run {i} not ready: {sup.last_message}")
                times[kind].append(round(took, 3))
    finally:
        await runtime.close()
    med = {k: round(statistics.median(v), 3) for k, v in times.items()}
    extra = round(med["container"] - med["process"], 3)
    return {"runs": runs, "process_s": times["process"], "container_s": times["container"],
            "median_process_s": med["process"], "median_container_s": med["container"],
            "container_extra_s": extra, "target_extra_s": TARGET_EXTRA_S,
            "meets_target": extra <= TARGET_EXTRA_S}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--skip-agent", action="store_true")
    args = ap.parse_args()
    if shutil.which("podman") is None:
        sys.exit("podman is not installed: scripts/podman-setup.sh --with-base, then "
                 "make image-engines")
    workdir = Path(tempfile.mkdtemp(prefix="gearshift-containers-bench-"))
    watch = MachineWatch()
    out: dict[str, Any] = {"cpus": os.cpu_count()}
    service = PodmanService(workdir / "podman")
    service.start()
    try:
        out["start_to_ready"] = asyncio.run(start_to_ready(args.runs, workdir, service.url))
        if not args.skip_agent:
            fleet = LocalFleet(workdir / "fleet", report_interval_s=args.interval_s)
            fleet.containers = {"runtime": "podman", "endpoint": service.url,
                                "ulimits": configured_ulimits()}
            fleet.images = dict(EMULATED_IMAGES)
            try:
                fleet.start_controller()
                out["agent"] = measure_agent(fleet, args.engines, args.interval_s,
                                             args.window_s)
                out["agent"]["target"] = TARGETS["agent"]
            finally:
                fleet.stop()
                drain = [sys.executable, "-m", "gearshift.cli.main", "agent", "drain",
                         "--config", str(fleet.workdir / "bench-host.yaml"), "--grace", "5"]
                import subprocess
                subprocess.run(drain, capture_output=True, timeout=120)
    finally:
        service.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    out["machine"] = watch.result()
    out["meets_targets"] = all(v["meets_target"] for k, v in out.items()
                               if isinstance(v, dict) and "meets_target" in v)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
