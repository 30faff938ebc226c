"""TensorRT-LLM runtime: `trtllm-serve MODEL --host H --port P --backend pytorch|tensorrt
--tp_size T --kv_cache_free_gpu_memory_fraction F --config extra.yaml`.

The extra config's flag is the release's (version table,
`gearshift.common.engine_versions`): `--config` from 1.2 on (an alias added by
NVIDIA/TensorRT-LLM PR #9104), `--extra_llm_api_options` before, where `--config`
is an unknown option and trtllm-serve exits at once.

The extra config turns on the two metric surfaces gearshift scrapes:
`enable_iter_perf_stats` (JSON `/metrics`, drained on each read) and
`return_perf_metrics` (Prometheus `/prometheus/metrics`). `/health` and
`/health_generate` answer 200 when ready (catalog entry
`gearshift.common.engines.TENSORRT_LLM`).

trtllm-serve names the model after MODEL (a local directory by its basename)
unless `--served-model-name` is given, which only recent releases accept; the
registered runtime keeps to the command line of docs/engines.md, and
`TrtllmRuntime(pass_served_model_name=True)` adds the flag.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from gearshift.agents.runtimes.base import LaunchPlan, cuda_env, register, release_or_newest
from gearshift.common.engine_versions import EngineRelease
from gearshift.common.spec import DeploymentSpec

EXTRA_OPTIONS = {"enable_iter_perf_stats": True, "return_perf_metrics": True}


class TrtllmRuntime:
    name = "tensorrt-llm"

    def __init__(self, *, pass_served_model_name: bool = False) -> None:
        self.pass_served_model_name = pass_served_model_name

    def config_path(self, spec: DeploymentSpec, workdir: Path) -> Path:
        return workdir / f"{spec.deployment_id}.extra-llm-api-options.yaml"

    def served_model_name(self, spec: DeploymentSpec) -> str:
        if self.pass_served_model_name:
            return spec.model
        if os.path.isdir(spec.source):
            return os.path.basename(os.path.normpath(spec.source))
        return spec.source

    def launch_plan(self, spec: DeploymentSpec, *, executable: list[str], host: str,
                    port: int, workdir: Path, release: EngineRelease | None = None
                    ) -> LaunchPlan:
        config_flag = release_or_newest(self.name, release).flags.config_file
        config = self.config_path(spec, workdir)
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump(EXTRA_OPTIONS, sort_keys=True), encoding="utf-8")
        argv = [*executable, spec.source,
                "--host", host,
                "--port", str(port),
                "--backend", spec.backend,
                "--tp_size", str(spec.tensor_parallel_size),
                "--kv_cache_free_gpu_memory_fraction", f"{spec.gpu_memory_fraction:g}",
                config_flag, str(config)]
        if self.pass_served_model_name:
            argv += ["--served-model-name", spec.model]
        argv += spec.extra_args
        return LaunchPlan(argv=tuple(argv), env=cuda_env(spec),
                          served_model_name=self.served_model_name(spec), files=(config,))


TRTLLM = register(TrtllmRuntime())
