"""`gearshift demo --engines vllm,tensorrt-llm,sglang`: a model starts on SGLang, served
through the gateway by the SGLang emulator, and moves to TensorRT-LLM with no failed request."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def test_demo_with_sglang_moves_a_model_off_sglang_with_no_failed_request(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gearshift.cli.main", "demo", "--json-summary",
         "--engines", "vllm,tensorrt-llm,sglang", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = re.fullmatch(r"requests: (\d+) sent, (\d+) failed", lines[-1])
    assert m and int(m.group(2)) == 0, lines[-1]
    summary = json.loads(lines[-2])
    assert summary["engines"]["gemma-3-4b"] == "tensorrt-llm", summary
    assert summary["engines"]["llama-3.3-70b"] == "tensorrt-llm"
    assert "gemma-3-4b sglang → tensorrt-llm" in proc.stdout
    # The SGLang emulator really served: its command line is SGLang's.
    log = "\n".join(p.read_text() for p in tmp_path.rglob("*.log"))
    assert "--enable-metrics" in log or "sglang" in log
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in ps


def test_demo_rejects_an_engine_set_without_the_scenario_engines() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gearshift.cli.main", "demo", "--engines", "vllm,sglang"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--engines" in proc.stderr and "tgi" not in proc.stderr
    assert "expected vllm and tensorrt-llm" in proc.stderr
