"""GuideLLM, a benchmark client written for vLLM that nobody here wrote, against the gateway.

`guidellm run` (PyPI's `guidellm` 0.8) sends a prompts file through the gateway with four
concurrent streams, after its default backend check: GET /health, then /v1/models for the
model to use. No tokenizer is downloaded: Hugging Face is offline for it, and the model's
name (`meta-llama/…`) would be a hub download if GuideLLM asked for one. Passes when
GuideLLM exits 0 and its JSON report counts every request successful and none errored.

The gateway and its emulated vLLM are the openai SDK test's (`client`, in this process on
loopback). GuideLLM needs PyTorch, transformers and datasets (1.5 GB), which gearshift does
not, so it has a venv of its own: `make guidellm` (a step of `make test`) installs it into
build/guidellm; where it could not, this test is skipped and names the install log.
Cost: about 15 s (GuideLLM's start is most of it)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import openai
import pytest

from integration.test_gateway_openai_sdk import MODEL, client  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / "build" / "guidellm"
GUIDELLM = VENV / "bin" / "guidellm"
INSTALLED = VENV / ".installed"  # `make guidellm` writes it once the install succeeded
INSTALL_LOG = REPO / "build" / "guidellm-install.log"
REQUESTS = 16
RUN_TIMEOUT_S = 150.0


def _guidellm() -> Path:
    if INSTALLED.exists() and GUIDELLM.exists():
        return GUIDELLM
    log = INSTALL_LOG.read_text(errors="replace") if INSTALL_LOG.exists() else ""
    errors = [line for line in log.splitlines() if line.startswith("ERROR")]
    if errors:
        pytest.skip(f"GuideLLM did not install on this Python: {errors[-1]} ({INSTALL_LOG})")
    pytest.skip("GuideLLM is not installed: `make guidellm` installs it into build/guidellm")


def _prompts(path: Path) -> Path:
    """A prompts file as GuideLLM reads one (`json_file`: JSON lines, a `prompt` column)."""
    lines = [json.dumps({"prompt": f"Write a haiku about engine number {i}."})
             for i in range(REQUESTS)]
    path.write_text("\n".join(lines) + "\n")
    return path


async def test_guidellm_benchmarks_the_gateway(client: openai.AsyncOpenAI,  # noqa: F811
                                               tmp_path: Path) -> None:
    guidellm = _guidellm()
    target = str(client.base_url).rstrip("/").removesuffix("/v1")
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GEARSHIFT_", "GUIDELLM", "HF_", "OPENAI_"))}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf"), "NO_COLOR": "1", "COLUMNS": "200"}
    proc = await asyncio.create_subprocess_exec(
        str(guidellm), "run",
        "--backend", f"kind=openai_http,target={target}",  # validate_backend: its default
        "--data", f"kind=json_file,path={_prompts(tmp_path / 'prompts.jsonl')}",
        "--profile", "kind=concurrent,streams=4",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--output", f"kind=json,path={report}",
        "--disable-progress",
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert "backend validated with model " + MODEL in text, text[-4000:]

    runs = json.loads(report.read_text())["benchmarks"]
    assert len(runs) == 1, text[-4000:]
    totals = runs[0]["metrics"]["request_totals"]
    assert totals["successful"] == REQUESTS and totals["errored"] == 0, (totals, text[-4000:])
    assert runs[0]["scheduler_state"]["errored_requests"] == 0
