"""Fixtures for tests that run the whole fleet as real processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gearshift.cli.local_fleet import LocalFleet


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[LocalFleet]:
    f = LocalFleet(tmp_path / "fleet", report_interval_s=0.5)
    try:
        yield f
    finally:
        f.stop()
