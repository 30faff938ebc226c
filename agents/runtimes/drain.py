"""Drain an engine whose release aborts in-flight requests on SIGTERM.

vLLM lets in-flight requests finish on SIGTERM only from the release that added
`--shutdown-timeout` (the version table's drain flag, 0.18); before it, its HTTP
launcher cancels the server task on SIGTERM and every running request fails
(docs/engines.md, "Draining releases without a drain flag"). The same holds for a
release with the flag when the launch plan passed none. On those, the supervisor's
drain first marks the deployment draining (reports carry the phase, so gateways stop
routing to it), waits until the engine's own metrics show no running or waiting
request, or until the grace leaves only the time the engine needs to exit, and only
then sends SIGTERM.

The count is read from the release's metric names (`vllm:num_requests_running` and
`vllm:num_requests_waiting`); an unreadable scrape counts as "not drained yet" (a
drain never cuts requests short on a guess), so an engine whose metrics do not answer
is stopped when the grace runs out, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from gearshift.agents.metrics.scraper import read_engine_metrics
from gearshift.agents.runtimes.base import EngineEndpoints
from gearshift.common.engine_versions import EngineRelease
from gearshift.common.engines import engine_entry

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.2           # between two reads of the engine's in-flight count
EXIT_RESERVE_S = 5.0         # of the grace, kept for the engine to exit after SIGTERM
EXIT_RESERVE_FRACTION = 0.25  # ... at most this share of a short grace
SCRAPE_TIMEOUT_S = 2.0


def aborts_on_sigterm(release: EngineRelease, shutdown_timeout_s: float) -> bool:
    """The engine has a drain flag in some release, and this launch did not pass it
    (the release lacks it, or no drain timeout was asked for)."""
    if not engine_entry(release.engine).launch.drain_timeout_flag:
        return False  # engines without such a flag drain on SIGTERM by themselves
    return not (release.flags.drain_timeout and shutdown_timeout_s > 0)


def exit_reserve_s(grace_s: float) -> float:
    return min(EXIT_RESERVE_S, max(0.0, grace_s) * EXIT_RESERVE_FRACTION)


async def in_flight(session: aiohttp.ClientSession, endpoints: EngineEndpoints,
                    release: EngineRelease) -> float | None:
    """Running plus waiting requests from one scrape of the engine's metric endpoints;
    None when the scrape gave no such figure."""
    entry = engine_entry(release.engine)
    bodies: dict[str, str | None] = {}
    for endpoint, url in zip(entry.metric_endpoints, endpoints.metric_urls, strict=True):
        try:
            async with session.get(url) as resp:
                bodies[endpoint.path] = await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            bodies[endpoint.path] = None
    snapshot, _skips = read_engine_metrics(release.engine, bodies, release.metric_names)
    if snapshot is None or snapshot.running is None:
        return None
    return snapshot.running + (snapshot.waiting or 0.0)


@dataclass(frozen=True)
class DrainWait:
    """How the wait before SIGTERM ended."""

    drained: bool          # the engine showed no request in flight
    in_flight: float | None  # the last count read (None: never read)


async def wait_until_idle(endpoints: EngineEndpoints, release: EngineRelease, budget_s: float,
                          *, exited: Callable[[], bool],
                          on_count: Callable[[float | None], None] | None = None) -> DrainWait:
    """Poll the engine's in-flight count until it is 0, the process exits or `budget_s`
    passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, budget_s)
    last: float | None = None
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not exited():
            count = await in_flight(session, endpoints, release)
            if count != last and on_count is not None:
                on_count(count)
            last = count
            if count == 0:
                return DrainWait(True, 0.0)
            remaining = deadline - loop.time()
            if remaining <= 0:
                return DrainWait(False, last)
            await asyncio.sleep(min(DRAIN_POLL_S, remaining))
    return DrainWait(False, last)
