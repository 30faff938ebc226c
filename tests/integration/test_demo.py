"""`gearshift demo` runs the embedded default fleet and ends cleanly with its summary."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def test_demo_runs_and_ends_with_the_request_summary(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gearshift.cli.main", "demo", "--duration", "6", "--json-summary",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    m = re.fullmatch(r"requests: (\d+) sent, (\d+) failed", lines[-1])
    assert m, lines[-1]
    sent, failed = int(m.group(1)), int(m.group(2))
    assert sent > 0 and failed == 0
    summary = json.loads(lines[-2])
    assert summary["requests_sent"] == sent
    # Every process the demo started is gone, and its store was written.
    assert (tmp_path / "data" / "gearshift.db").exists()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in ps
