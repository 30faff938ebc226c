"""GPU inventory and health: NVML where a driver exists, emulated for development.

NVML is read through nvidia-ml-py (`pynvml`). Where no NVIDIA driver exists the
agent reports zero GPUs and says so once in its log; an emulated inventory
(model, count, memory) can be configured for development hosts and the demo.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from gearshift.v1 import agent_pb2

log = logging.getLogger(__name__)

GIB = 1024**3
HOT_TEMPERATURE_C = 90.0


class GpuSource(Protocol):
    emulated: bool

    def read(self) -> list[agent_pb2.GpuInfo]: ...


@dataclass
class EmulatedGpus:
    model: str
    count: int
    memory_gb: float
    emulated: bool = True

    def read(self) -> list[agent_pb2.GpuInfo]:
        return [agent_pb2.GpuInfo(
            index=i, uuid=f"GPU-emulated-{i:04d}", model=self.model,
            memory_total_bytes=int(self.memory_gb * GIB), memory_used_bytes=0,
            utilization=0.0, temperature_c=40.0, power_w=80.0,
            health=agent_pb2.GPU_HEALTH_OK) for i in range(self.count)]


class NoGpus:
    emulated = False

    def read(self) -> list[agent_pb2.GpuInfo]:
        return []


class NvmlGpus:
    """Reads the real GPUs through NVML; per-GPU errors degrade that GPU's health."""

    emulated = False

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self.count = pynvml.nvmlDeviceGetCount()

    def read(self) -> list[agent_pb2.GpuInfo]:
        nv = self._nvml
        out = []
        for i in range(self.count):
            info = agent_pb2.GpuInfo(index=i, health=agent_pb2.GPU_HEALTH_OK)
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                name = nv.nvmlDeviceGetName(h)
                info.model = name.decode() if isinstance(name, bytes) else str(name)
                uuid = nv.nvmlDeviceGetUUID(h)
                info.uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                info.memory_total_bytes, info.memory_used_bytes = int(mem.total), int(mem.used)
                info.utilization = nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
                info.temperature_c = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
                info.power_w = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
                if info.temperature_c >= HOT_TEMPERATURE_C:
                    info.health = agent_pb2.GPU_HEALTH_DEGRADED
                    info.health_reason = f"temperature {info.temperature_c:.0f} C"
            except nv.NVMLError as exc:  # a GPU fallen off the bus answers with errors
                info.health = agent_pb2.GPU_HEALTH_FAILED
                info.health_reason = f"NVML: {exc}"
            out.append(info)
        return out


def open_gpu_source(mode: str, emulated: EmulatedGpus | None) -> GpuSource:
    """`auto` tries NVML and falls back to emulated (if configured) or none."""
    if mode == "emulated":
        if emulated is None:
            raise ValueError("gpus.source is 'emulated' but gpus.emulated is not set")
        return emulated
    if mode == "none":
        return NoGpus()
    try:
        src = NvmlGpus()
        log.info("NVML: %d NVIDIA GPU(s) found", src.count)
        return src
    except Exception as exc:  # pynvml raises NVMLError_LibraryNotFound / DriverNotLoaded
        if mode == "nvml":
            raise ValueError(f"gpus.source is 'nvml' but NVML is not usable: {exc}") from exc
        if emulated is not None:
            log.info("no NVIDIA driver (%s); using the emulated inventory (%d x %s)",
                     exc, emulated.count, emulated.model)
            return emulated
        log.warning("no NVIDIA driver found (%s); reporting zero GPUs", exc)
        return NoGpus()
