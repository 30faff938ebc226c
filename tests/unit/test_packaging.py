"""The package builds without a warning (the license an SPDX string, every package and
its data listed) and the wheel carries the data the code reads: the engine release
tables, the migrations' templates, the example policies."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_builds_without_warnings_and_carries_its_data(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines()
                if "Warning" in line and "Location 'file" not in line]
    assert not warnings, "\n".join(warnings)
    [wheel] = tmp_path.glob("gearshift-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    releases = [n for n in names if n.startswith("gearshift/common/engine_releases/")]
    assert any(n.endswith(".json") for n in releases), releases
    assert any(n.startswith("gearshift/policies/examples/") and n.endswith(".yaml")
               for n in names)
    assert any(n.startswith("gearshift/controller/store/schema/versions/0007") for n in names)
    metadata = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "License-Expression: Apache-2.0" in text
