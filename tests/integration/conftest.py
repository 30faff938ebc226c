"""Fixtures for tests that run the whole fleet as real processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gearshift.devfleet.local_fleet import LocalFleet


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Whole fleets of processes: allow for a loaded 2-core machine.
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(300))


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[LocalFleet]:
    f = LocalFleet(tmp_path / "fleet", report_interval_s=0.5)
    try:
        yield f
    finally:
        f.stop()
