"""`gearshift demo`, the README's main command: the whole scenario on loopback."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def test_demo_scenario_moves_keeps_and_rolls_back_with_no_failed_request(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gearshift.cli.main", "demo", "--json-summary",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = re.fullmatch(r"requests: (\d+) sent, (\d+) failed", lines[-1])
    assert m, lines[-1]
    sent, failed = int(m.group(1)), int(m.group(2))
    assert sent > 500 and failed == 0
    summary = json.loads(lines[-2])
    assert summary["requests_sent"] == sent
    assert summary["elapsed_s"] < 180
    # The traffic riser moved; the churning model stayed; the failed canary rolled back.
    assert summary["engines"] == {"llama-3.3-70b": "tensorrt-llm", "qwen3-8b": "vllm",
                                  "mistral-7b": "vllm"}
    out = proc.stdout
    assert "canary" in out and "rolled_back" in out and "revision r2" in out
    # Every process the demo started is gone, and its store was written.
    assert (tmp_path / "data" / "gearshift.db").exists()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in ps
