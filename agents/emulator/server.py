"""Lifecycle of one emulated engine process: load, serve, drain on SIGTERM, crash on demand.

Like the real engines, the port is not bound while the model "loads", so
connections are refused until it is ready. SIGTERM stops listening at once;
each flavour says how long in-flight requests may finish (vLLM: its
`--shutdown-timeout S`, else none; trtllm-serve: a fixed grace).
A second SIGTERM/SIGINT during a drain aborts what is left. Exit 0 on a
clean stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from gearshift.agents.emulator.app import EmulatorState, build_app
from gearshift.agents.emulator.args import EngineArgs
from gearshift.agents.emulator.batching import BatchEngine, derive_max_batch
from gearshift.agents.emulator.config import EmulatorOptions
from gearshift.agents.emulator.flavors import get_flavor
from gearshift.agents.emulator.releases import for_release

CRASH_EXIT_CODE = 1
# After the drain, connections still open get this long before aiohttp closes them.
CLOSE_CONNECTIONS_S = 0.5


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def crash_now() -> None:
    """Exit at once with a non-zero code, as a crashed engine would."""
    _log("emulator: crash fault: exiting now")
    os._exit(CRASH_EXIT_CODE)


def make_state(args: EngineArgs, options: EmulatorOptions) -> EmulatorState:
    """Build the engine model, metrics and shared state for `args`."""
    max_batch = options.max_batch or derive_max_batch(
        options.capacity_rps, options.ttft_base_s, options.itl_s, options.output_tokens)
    engine = BatchEngine(max_batch=max_batch, ttft_base_s=options.ttft_base_s,
                         itl_s=options.itl_s, latency_factor=options.faults.latency_factor)
    metrics, iterstats = get_flavor(args.flavor).make_metrics(engine, args, options)
    metrics = for_release(metrics, options.release_facts)
    return EmulatorState(args=args, options=options, engine=engine, metrics=metrics,
                         iterstats=iterstats, on_crash=crash_now, faults=options.faults)


class _Signals:
    """SIGTERM/SIGINT bookkeeping; `ignore_sigterm` is read at signal time."""

    def __init__(self) -> None:
        self.state: EmulatorState | None = None
        self.stop = asyncio.Event()
        self.abort = asyncio.Event()
        self.ignore_at_start = False

    def handle(self, signum: int) -> None:
        ignore = self.state.faults.ignore_sigterm if self.state else self.ignore_at_start
        if signum == signal.SIGTERM and ignore:
            _log("emulator: ignoring SIGTERM (fault ignore_sigterm)")
            return
        _log(f"emulator: received {signal.Signals(signum).name}")
        if self.stop.is_set():
            self.abort.set()
        self.stop.set()


async def _wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """True when `event` was set within `timeout_s`."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


def drain_grace_s(args: EngineArgs) -> float:
    """How long in-flight requests may run after SIGTERM (0: abort them)."""
    return get_flavor(args.flavor).drain_grace_s(args)


async def run_build(args: EngineArgs, options: EmulatorOptions) -> int:
    """The `trtllm-build` stand-in: take `build_s` seconds, then succeed."""
    _log(f"emulator: building engine ({options.build_s:g} s)")
    signals = _Signals()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.handle, sig)
    if await _wait_event(signals.stop, options.build_s):
        _log("emulator: build interrupted")
        return 1
    _log("emulator: build finished")
    return 0


async def run_server(args: EngineArgs, options: EmulatorOptions) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code."""
    loop = asyncio.get_running_loop()
    signals = _Signals()
    signals.ignore_at_start = options.faults.ignore_sigterm
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.handle, sig)
    for token in args.ignored:
        if token.startswith("-"):
            _log(f"WARNING emulator: ignoring option {token}")
    load_s = options.load_s + options.faults.slow_start_s
    _log(f"INFO emulator ({args.flavor} {options.engine_version}): loading {args.model} "
         f"for {load_s:g} s")
    if await _wait_event(signals.stop, load_s):
        _log("emulator: stopped while loading")
        return 0

    state = make_state(args, options)
    signals.state = state
    runner = web.AppRunner(build_app(state), access_log=None,
                           shutdown_timeout=CLOSE_CONNECTIONS_S)
    await runner.setup()
    assert runner.server is not None
    try:
        server = await loop.create_server(runner.server, args.host, args.port,
                                          reuse_address=True)
    except OSError as exc:
        _log(f"ERROR emulator: cannot listen on {args.host}:{args.port}: {exc.strerror}")
        await runner.cleanup()
        return 1
    _log(f"INFO: Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)")
    _log(f"INFO: serving model {args.served_model_name!r}, max batch {state.engine.max_batch}")
    tasks: list[asyncio.Task[None]] = []
    if state.iterstats is not None:
        tasks.append(asyncio.create_task(state.iterstats.run()))
    crash_timer = None
    if options.faults.crash_after_s is not None:
        crash_timer = loop.call_later(options.faults.crash_after_s, state.on_crash)
    try:
        await signals.stop.wait()
        state.draining = True
        server.close()  # stop accepting: new connections are refused from here on
        grace_s = drain_grace_s(args)
        if state.inflight and grace_s > 0:
            _log(f"INFO emulator: draining {len(state.inflight)} request(s) for up to {grace_s:g} s")
            drained = asyncio.create_task(state.idle.wait())
            aborted = asyncio.create_task(signals.abort.wait())
            await asyncio.wait({drained, aborted}, timeout=grace_s,
                               return_when=asyncio.FIRST_COMPLETED)
            drained.cancel()
            aborted.cancel()
        for task in list(state.inflight):
            task.cancel()
        if state.inflight:
            _log(f"INFO emulator: aborting {len(state.inflight)} request(s)")
            await _wait_event(state.idle, CLOSE_CONNECTIONS_S)
    finally:
        if crash_timer is not None:
            crash_timer.cancel()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()
    _log("INFO emulator: shutdown complete")
    return 0


def _run_loop(main: Coroutine[Any, Any, int], event_loop: str) -> int:
    """Run `main` on asyncio's loop, or on uvloop (see `EmulatorOptions.event_loop`)."""
    if event_loop == "uvloop":
        import uvloop

        return uvloop.run(main)  # type: ignore[no-any-return]
    return asyncio.run(main)


def run(args: EngineArgs, options: EmulatorOptions) -> int:
    """Entry point used by the CLI: run the server or the build stand-in."""
    if args.command == "build":
        return _run_loop(run_build(args, options), options.event_loop)
    return _run_loop(run_server(args, options), options.event_loop)
