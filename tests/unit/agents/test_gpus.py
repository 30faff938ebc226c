"""GPU inventory: NVML where a driver exists; zero GPUs, said clearly, where none does."""

from __future__ import annotations

import logging

import pytest

from gearshift.agents.gpus import EmulatedGpus, NoGpus, open_gpu_source
from gearshift.v1 import agent_pb2


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return True
    except Exception:
        return False


@pytest.mark.skipif(_nvml_works(), reason="this host has an NVIDIA driver")
def test_no_driver_reports_zero_gpus_with_a_clear_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        src = open_gpu_source("auto", None)
    assert isinstance(src, NoGpus) and src.read() == []
    assert "no NVIDIA driver found" in caplog.text and "reporting zero GPUs" in caplog.text
    with pytest.raises(ValueError, match="NVML is not usable"):
        open_gpu_source("nvml", None)


def test_emulated_inventory_for_development() -> None:
    src = open_gpu_source("emulated", EmulatedGpus("NVIDIA H100 80GB HBM3", 2, 80))
    gpus = src.read()
    assert src.emulated and [g.index for g in gpus] == [0, 1]
    assert gpus[0].memory_total_bytes == 80 * 1024**3 and gpus[0].health == agent_pb2.GPU_HEALTH_OK
    with pytest.raises(ValueError, match=r"gpus\.emulated is not set"):
        open_gpu_source("emulated", None)
