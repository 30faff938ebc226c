"""The event loop a daemon runs on: uvloop where it is installed, else asyncio's own.

The controller carries every agent's stream on one loop, and gRPC's asyncio server wakes
that loop for each message read and each ack written; uvloop makes each wake-up, timer
and callback cheaper (the 10,000-agent ingest in docs/performance.md). Its timers step by
whole milliseconds, which nothing in the controller measures finer than.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

from gearshift.common.errors import ConfigError

T = TypeVar("T")
EventLoop = Literal["uvloop", "asyncio"]


def default_event_loop() -> EventLoop:
    """uvloop where it is installed (every platform but Windows), else asyncio's."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def run_event_loop(main: Coroutine[Any, Any, T], loop: str | None = None) -> T:
    """Run `main` to its end on `loop` (None: `default_event_loop()`)."""
    loop = loop or default_event_loop()
    if loop == "asyncio":
        return asyncio.run(main)
    if loop != "uvloop":
        main.close()
        raise ConfigError(f"event loop: expected uvloop or asyncio, found {loop!r}")
    try:
        import uvloop
    except ImportError:
        main.close()
        raise ConfigError("event loop: uvloop is not installed (pip install uvloop), "
                          "or choose asyncio") from None
    return uvloop.run(main)  # type: ignore[no-any-return]
