"""Fixtures for tests that run the whole fleet as real processes on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gearshift.controller.server import Controller, ControllerConfig
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


@pytest.fixture
def report_interval_s() -> float:
    """The agents' report interval the `controller` fixture gives (a module may override it)."""
    return 0.2


@pytest.fixture
async def controller(tmp_path: Path, report_interval_s: float) -> AsyncIterator[Controller]:
    """A controller in the test's own process, on a free port (a test module that needs
    another configuration than the report interval defines its own)."""
    ctl = Controller(ControllerConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data",
                                      report_interval_s=report_interval_s))
    await ctl.start()
    try:
        yield ctl
    finally:
        await ctl.stop(0.1)
