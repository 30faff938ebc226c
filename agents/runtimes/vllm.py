"""vLLM runtime: `vllm serve MODEL --host H --port P --served-model-name N
--tensor-parallel-size T --gpu-memory-utilization F [--shutdown-timeout S]`.

`--shutdown-timeout` exists only in some releases (the version table in
`gearshift.common.engine_versions` says which): on the others the plan leaves it
out, and vLLM aborts in-flight requests on SIGTERM.

Health (`GET /health`: refused while loading, 200 ready, 503 dead) and metrics
(`GET /metrics`, Prometheus text with `vllm:` names) are the catalog entry's
(`gearshift.common.engines.VLLM`).
"""

from __future__ import annotations

from pathlib import Path

from gearshift.agents.runtimes.base import LaunchPlan, cuda_env, register, release_or_newest
from gearshift.common.engine_versions import EngineRelease
from gearshift.common.spec import DeploymentSpec


def _number(value: float) -> str:
    """Render 0.9 as "0.9" and 30.0 as "30" (what a person would type)."""
    return f"{value:g}"


class VllmRuntime:
    name = "vllm"

    def launch_plan(self, spec: DeploymentSpec, *, executable: list[str], host: str,
                    port: int, workdir: Path, release: EngineRelease | None = None
                    ) -> LaunchPlan:
        drain_flag = release_or_newest(self.name, release).flags.drain_timeout
        argv = [*executable, "serve", spec.source,
                "--host", host,
                "--port", str(port),
                "--served-model-name", spec.model,
                "--tensor-parallel-size", str(spec.tensor_parallel_size),
                "--gpu-memory-utilization", _number(spec.gpu_memory_fraction)]
        if spec.shutdown_timeout_s > 0 and drain_flag:
            argv += [drain_flag, _number(spec.shutdown_timeout_s)]
        argv += spec.extra_args
        return LaunchPlan(argv=tuple(argv), env=cuda_env(spec), served_model_name=spec.model)


VLLM = register(VllmRuntime())
