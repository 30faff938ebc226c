"""`run_event_loop`: the daemons' loop, uvloop by default where installed."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from gearshift.common.errors import ConfigError
from gearshift.common.event_loop import default_event_loop, run_event_loop

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_runs_on_asyncio_own_loop() -> None:
    assert run_event_loop(_loop_module(), "asyncio").startswith("asyncio")


@pytest.mark.skipif(not HAS_UVLOOP, reason="uvloop not installed")
def test_the_default_is_uvloop_where_installed() -> None:
    assert default_event_loop() == "uvloop"
    assert run_event_loop(_loop_module()).startswith("uvloop")


def test_an_unknown_loop_is_a_config_error_and_the_coroutine_is_closed() -> None:
    main = _loop_module()
    with pytest.raises(ConfigError, match="expected uvloop or asyncio, found 'trio'"):
        run_event_loop(main, "trio")
    assert main.cr_frame is None  # closed: no "never awaited" warning
