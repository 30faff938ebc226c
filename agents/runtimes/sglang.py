"""SGLang runtime: `python3 -m sglang.launch_server --model-path SOURCE --host H --port P
--served-model-name N --tp-size T --mem-fraction-static F --enable-metrics`.

The flags are SGLang's own (`ServerArgs` in `python/sglang/srt/server_args.py`, where each
flag is derived from a field name: `model_path` -> `--model-path`, `tp_size` ->
`--tp-size` with the alias `--tensor-parallel-size`, `mem_fraction_static`,
`served_model_name`, `enable_metrics`; checked in sgl-project/sglang at commit
001067ff, the 0.5 line, and in the 0.4 docs `docs/references/production_metrics.md`,
whose launch example is `python -m sglang.launch_server --model-path M --port 30000
--host 0.0.0.0 --enable-metrics`). `--mem-fraction-static` is the share of GPU memory
for the weights and the KV-cache pool, which is what the spec's `gpu_memory_fraction`
means. Without `--enable-metrics` SGLang serves no `/metrics`, so it is always passed.

Health and metrics are the catalog entry's (`gearshift.common.engines.SGLANG`): the
HTTP server answers `/health` and `/health_generate` with 503 while it starts (and
while it exits) and 200 once a one-token generation succeeds
(`python/sglang/srt/entrypoints/http_server.py`, commit 0025436e); `/metrics` is
Prometheus text with `sglang:` names (`python/sglang/srt/metrics/collector.py`,
commit 00ae9c15). SGLang has no drain-timeout flag: the controller passes none.
"""

from __future__ import annotations

from pathlib import Path

from gearshift.agents.runtimes.base import LaunchPlan, cuda_env, register
from gearshift.common.engine_versions import EngineRelease
from gearshift.common.spec import DeploymentSpec


class SglangRuntime:
    name = "sglang"

    def launch_plan(self, spec: DeploymentSpec, *, executable: list[str], host: str,
                    port: int, workdir: Path, release: EngineRelease | None = None
                    ) -> LaunchPlan:
        # Every row of SGLang's version table knows these flags.
        argv = [*executable,
                "--model-path", spec.source,
                "--host", host,
                "--port", str(port),
                "--served-model-name", spec.model,
                "--tp-size", str(spec.tensor_parallel_size),
                "--mem-fraction-static", f"{spec.gpu_memory_fraction:g}",
                "--enable-metrics",
                *spec.extra_args]
        return LaunchPlan(argv=tuple(argv), env=cuda_env(spec), served_model_name=spec.model)


SGLANG = register(SglangRuntime())
