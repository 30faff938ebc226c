"""Supervise one engine process: start, watch health, restart on crash, drain, stop.

The engine runs in its own process group (session) so that stopping it also
reaches the workers it spawned; SIGTERM goes to the engine itself (it drains),
SIGKILL to the whole group after the grace. A background task waits on the
process (an exit is seen at once, not at the next poll) and probes the health
URL every `health_interval_s` on a kept-alive connection (`health_probe`):
connection refused = still loading, 200 = ready, anything else = unhealthy. A crash is restarted after an exponential
backoff; more than `max_restarts` crashes in a row (without a stable run of
`STABLE_RUN_S` in between) give up with phase `failed`. Every await that could
be cancelled leaves no process behind.

With a state directory, each spawned engine is recorded there (pid, start
time, port, spec) so that it can outlive the agent: `detach()` stops watching
and leaves the engine serving, and `adopt()` lets a new supervisor take over an
engine that a predecessor recorded, without restarting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from gearshift.agents.runtimes.adopted import AdoptedProcess
from gearshift.agents.runtimes.base import (
    EngineEndpoints,
    EngineRuntime,
    HealthState,
    LaunchPlan,
    classify_health,
    endpoints_for,
    release_or_newest,
)
from gearshift.agents.runtimes.drain import aborts_on_sigterm, exit_reserve_s, wait_until_idle
from gearshift.agents.runtimes.engine_state import EngineRecord, EngineStateDir, process_start_time
from gearshift.agents.runtimes.health_probe import HealthProbe, ProbeFailed
from gearshift.common.engine_versions import EngineRelease
from gearshift.common.engines import engine_entry
from gearshift.common.errors import FailedPrecondition
from gearshift.common.spec import DeploymentSpec, Phase

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 20           # engine output lines logged when it exits unexpectedly
STABLE_RUN_S = 60.0          # a run this long resets the consecutive-crash count
HEALTH_TIMEOUT_S = 2.0
DEFAULT_STOP_GRACE_S = 5.0
_FINAL_PHASES = (Phase.STOPPED, Phase.FAILED)


class EngineHandle(Protocol):
    """What the supervisor needs of a running engine: an `asyncio.subprocess.Process`,
    an `AdoptedProcess`, or a container (`container_supervisor.ContainerHandle`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    async def wait(self) -> int: ...


def describe_exit(code: int) -> str:
    """An exit status as people read it (a negative one is the signal that killed it;
    a container runtime reports 128 + the signal)."""
    if code < 0:
        name = f" ({signal.Signals(-code).name})" if -code in _SIGNALS else ""
        return f"killed by signal {-code}{name}"
    if code > 128 and code - 128 in _SIGNALS:
        return f"exited with code {code} ({signal.Signals(code - 128).name})"
    return f"exited with code {code}"


_SIGNALS = {int(s) for s in signal.Signals}


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EngineSupervisor:
    """Runs and watches one engine deployment as a child process."""

    def __init__(self, spec: DeploymentSpec, runtime: EngineRuntime, *,
                 workdir: Path | str,
                 executable: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 restart_backoff_s: tuple[float, float] = (1.0, 30.0),
                 max_restarts: int | None = None,
                 health_interval_s: float = 1.0,
                 health_timeout_s: float = HEALTH_TIMEOUT_S,
                 bind_host: str = "127.0.0.1",
                 state: EngineStateDir | None = None,
                 on_change: Callable[[EngineSupervisor], None] | None = None,
                 release: EngineRelease | None = None) -> None:
        initial, maximum = restart_backoff_s
        if initial < 0 or maximum < initial:
            raise ValueError(f"restart_backoff_s {restart_backoff_s}: need 0 <= initial <= max")
        if health_interval_s <= 0:
            raise ValueError(f"health_interval_s {health_interval_s} must be > 0")
        self.spec = spec
        self.runtime = runtime
        self.release = release  # the engine's version-table row (None = the newest)
        self.entry = engine_entry(spec.engine)
        self.workdir = Path(workdir)
        self.executable = list(executable) if executable else list(self.entry.executable)
        self._env = dict(env or {})
        self._clock = clock
        self._backoff_s = (initial, maximum)
        self._max_restarts = max_restarts
        self._health_interval_s = health_interval_s
        self._health_timeout_s = health_timeout_s
        self._bind_host = bind_host
        self._on_change = on_change
        self._state = state
        self.adopted = False  # the engine was started by a previous agent
        self.log_path = self.workdir / f"{spec.deployment_id}.engine.log"

        self._phase = Phase.STARTING
        self._message = "not started"
        self._phase_since = clock()
        self._changed = asyncio.Event()
        self._restarts = 0
        self._crashes_in_a_row = 0
        self._port = spec.port
        self._plan: LaunchPlan | None = None
        self._proc: EngineHandle | None = None
        self._exit_waiter: asyncio.Future[int] | None = None
        self._started_at = clock()
        self._monitor: asyncio.Task[None] | None = None
        self._spawning: asyncio.Task[None] | None = None
        self._probe: HealthProbe | None = None
        self._started = False
        self._stopping = False

    # --- read-only view ------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def phase_since(self) -> float:
        """`clock()` value when the current phase began."""
        return self._phase_since

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def last_message(self) -> str:
        return self._message

    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint(self) -> str:
        host = "127.0.0.1" if self._bind_host in ("0.0.0.0", "", "::") else self._bind_host
        return f"http://{host}:{self._port}"

    @property
    def endpoints(self) -> EngineEndpoints:
        return endpoints_for(self.spec.engine, self.endpoint)

    @property
    def served_model_name(self) -> str:
        return self._plan.served_model_name if self._plan else self.spec.model

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    def _set(self, phase: Phase, message: str) -> None:
        changed = phase != self._phase
        self._message = message
        if changed:
            self._phase = phase
            self._phase_since = self._clock()
        self._changed.set()
        self._changed = asyncio.Event()
        if changed and self._on_change is not None:
            self._on_change(self)

    # --- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process and the health loop (returns once it is spawned)."""
        if self._started:
            raise FailedPrecondition(f"deployment {self.spec.deployment_id}: already started")
        self._started = True
        if self._port == 0:
            self._port = pick_free_port(self._bind_host if self._bind_host != "0.0.0.0"
                                        else "127.0.0.1")
        if not await self._prepare():
            raise FailedPrecondition(f"deployment {self.spec.deployment_id}: {self._message}")
        await self._spawn_safely()
        if self._proc is None:  # could not even exec
            raise FailedPrecondition(f"deployment {self.spec.deployment_id}: {self._message}")
        self._monitor = asyncio.create_task(self._watch(),
                                            name=f"supervise-{self.spec.deployment_id}")

    async def adopt(self, record: EngineRecord) -> None:
        """Take over the engine `record` names (started by a previous agent) without
        restarting it. The caller has checked that it is that process (pid and start
        time); the first health probe, awaited here, sets the phase it is reported in."""
        if self._started:
            raise FailedPrecondition(f"deployment {self.spec.deployment_id}: already started")
        await self._take_over(AdoptedProcess(record.pid, record.start_time), record.port,
                              record.restarts, LaunchPlan(argv=record.argv,
                                                          served_model_name=record.served_model_name),
                              f"pid {record.pid}")

    async def _take_over(self, proc: EngineHandle, port: int, restarts: int, plan: LaunchPlan,
                         what: str) -> None:
        """Watch `proc`, an engine a previous agent started, from now on."""
        self._started = True
        self.adopted = True
        self._port = port
        self._restarts = restarts
        self._plan = plan
        self._proc = proc
        self._exit_waiter = asyncio.ensure_future(proc.wait())
        self._set(Phase.STARTING, f"adopted {what} (started by a previous agent)")
        await self._check_health()
        if self._phase is Phase.READY:
            self._message = f"ready at {self.endpoint} (adopted {what})"
        self._monitor = asyncio.create_task(self._watch(),
                                            name=f"supervise-{self.spec.deployment_id}")

    async def detach(self) -> None:
        """Stop watching and leave the engine serving (its record stays for the next
        agent to adopt). Fail static: the agent going away is no reason to stop serving."""
        await self._stop_watching()
        self._release_handle()
        self._close_probe()

    async def wait_ready(self, timeout_s: float, *, crash_fails: bool = False) -> bool:
        """Wait until ready (True), or until failed/stopped or `timeout_s` passes (False).
        With `crash_fails`, an engine that exits before it was ever ready fails it too (at
        once, not at the deadline: its message has the exit code and the last output);
        the supervisor still restarts it, until its owner stops it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._phase is not Phase.READY:
            if self._phase in _FINAL_PHASES or (crash_fails and self._phase is Phase.RESTARTING):
                return False
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    async def drain(self, grace_s: float) -> None:
        """SIGTERM (the engine finishes in-flight requests), SIGKILL after `grace_s`. On
        a release that aborts them on SIGTERM, SIGTERM waits until none is in flight
        (`gearshift.agents.runtimes.drain`)."""
        await self._terminate(grace_s, draining=True)

    async def stop(self, grace_s: float = DEFAULT_STOP_GRACE_S) -> None:
        """Stop the engine: SIGTERM, then SIGKILL to its process group after `grace_s`."""
        await self._terminate(grace_s, draining=False)

    def kill_now(self) -> None:
        """Synchronous last resort (e.g. atexit): SIGKILL the engine's process group."""
        self._stopping = True
        self._kill_group()

    async def __aenter__(self) -> EngineSupervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(grace_s=0.0 if exc[0] is not None else DEFAULT_STOP_GRACE_S)

    # --- what a container supervisor does its own way (container_supervisor) ------------
    image = ""  # the engine's container image ("" = a host program)

    @property
    def image_digest(self) -> str:
        return ""

    @property
    def pull_bytes(self) -> tuple[int, int]:
        """(bytes pulled, of the total) while the image is pulled; (0, 0) otherwise."""
        return 0, 0

    @property
    def launch_host(self) -> str:
        """The address the engine is told to bind."""
        return self._bind_host

    async def _prepare(self) -> bool:
        """Before the first launch (a container's image is pulled); False = failed (the
        phase and message say why)."""
        return True

    async def _launch(self, plan: LaunchPlan) -> EngineHandle | None:
        """Start the engine of `plan`; None when it could not start (phase FAILED)."""
        try:
            log = open(self.log_path, "ab")  # noqa: SIM115 - closed below once the child has it
        except OSError as exc:
            self._set(Phase.FAILED, f"cannot open the engine log {self.log_path}: {exc}")
            return None
        env = {**os.environ, **self._env, **plan.env}
        with log:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            log.write(f"=== gearshift {stamp}: {' '.join(plan.argv)}\n".encode())
            log.flush()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *plan.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, cwd=str(self.workdir), start_new_session=True)
            except OSError as exc:
                self._set(Phase.FAILED, f"cannot run {plan.argv[0]!r}: {exc.strerror or exc}")
                return None
        self._record(plan, proc.pid)
        return proc

    def _describe(self, proc: EngineHandle) -> str:
        return f"pid {proc.pid}"

    async def _last_lines(self) -> str:
        """The engine's last lines of output, for the log and the report when it exits."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-LOG_TAIL_LINES:])

    def _release_handle(self) -> None:
        """Stop watching the engine's process handle; the engine keeps running."""
        if isinstance(self._proc, AdoptedProcess):
            self._proc.close()

    async def _after_stop(self) -> None:
        """Once the engine has stopped for good (a container is removed)."""

    # --- internals -----------------------------------------------------------------
    async def _spawn(self) -> None:
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            plan = self.runtime.launch_plan(self.spec, executable=self.executable,
                                            host=self.launch_host, port=self._port,
                                            workdir=self.workdir, release=self.release)
        except OSError as exc:
            self._proc = None
            self._set(Phase.FAILED, f"cannot prepare the launch in {self.workdir}: {exc}")
            return
        self._plan = plan
        proc = await self._launch(plan)
        self._proc = proc
        if proc is None:
            return
        self._exit_waiter = asyncio.ensure_future(proc.wait())
        self._started_at = self._clock()
        self._set(Phase.STARTING, f"started {self._describe(proc)}; loading")

    def _record(self, plan: LaunchPlan, pid: int) -> None:
        """Write the engine's record so that a later agent can adopt it."""
        if self._state is None:
            return
        started = process_start_time(pid)
        if started is None:  # it exited already: the watcher restarts it
            return
        spec = self.spec
        record = EngineRecord(
            deployment_id=spec.deployment_id, pid=pid, start_time=started,
            host=self._bind_host, port=self._port,
            spec={**spec.__dict__, "gpu_indices": list(spec.gpu_indices),
                  "extra_args": list(spec.extra_args)},
            argv=tuple(plan.argv), served_model_name=plan.served_model_name,
            restarts=self._restarts)
        try:
            self._state.write(record)
        except OSError as exc:  # the engine runs; only its adoption by a next agent is at risk
            log.error("cannot record engine %s in %s: %s", spec.deployment_id,
                      self._state.path, exc)

    async def _spawn_safely(self) -> None:
        """Spawn in a task of its own so a cancel cannot orphan a half-started process."""
        task = asyncio.create_task(self._spawn())
        self._spawning = task
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await task
            self._kill_group()
            raise
        finally:
            self._spawning = None

    async def _watch(self) -> None:
        while not self._stopping:
            waiter = self._exit_waiter
            if waiter is None:
                return
            done, _ = await asyncio.wait({waiter}, timeout=self._health_interval_s)
            if self._stopping:
                return
            try:
                if done:
                    if not await self._restart_after_exit(waiter.result()):
                        return
                    continue
                await self._check_health()
            except Exception as exc:  # keep supervising; the next tick retries
                log.exception("supervisor of %s: unexpected error", self.spec.deployment_id)
                self._message = f"supervisor error: {exc!r}"

    async def _check_health(self) -> None:
        if self._probe is None:
            self._probe = HealthProbe(self.endpoints.health_urls[0], self._health_timeout_s)
        url = self._probe.url
        try:
            status = await self._probe.status()
        except (ProbeFailed, TimeoutError) as exc:
            if self._phase in (Phase.READY, Phase.UNHEALTHY):
                self._set(Phase.UNHEALTHY, f"health probe {url} failed: {exc!r}")
            return
        if self._stopping:
            return
        state = classify_health(self.entry.health, status,
                                ready_before=self._phase in (Phase.READY, Phase.UNHEALTHY))
        if state is HealthState.READY:
            if self._phase is not Phase.READY:
                self._set(Phase.READY, f"ready at {self.endpoint}")
        elif state is HealthState.DEAD:
            self._set(Phase.UNHEALTHY, f"health {url} answered HTTP {status}")
        elif self._phase in (Phase.READY, Phase.UNHEALTHY):
            self._set(Phase.UNHEALTHY, f"health {url}: connection refused")

    async def _restart_after_exit(self, code: int) -> bool:
        """Handle an unexpected exit; False when giving up."""
        self._kill_group()  # workers the engine left behind
        if self._clock() - self._started_at >= STABLE_RUN_S:
            self._crashes_in_a_row = 0
        self._crashes_in_a_row += 1
        if isinstance(self._proc, AdoptedProcess):
            how = "exited (adopted: its exit status went to its parent)"
        else:
            how = describe_exit(code)
        last = await self._last_lines()
        said = f"; last output: {last.splitlines()[-1][:200]}" if last else ""
        if self._max_restarts is not None and self._crashes_in_a_row > self._max_restarts:
            self._set(Phase.FAILED, f"engine {how}; gave up after {self._restarts} restart(s)"
                      + said)
            log.error("engine %s %s; gave up after %d restart(s); its last output:\n%s",
                      self.spec.deployment_id, how, self._restarts, last or "(none)")
            return False
        initial, maximum = self._backoff_s
        delay_s = min(maximum, initial * 2 ** (self._crashes_in_a_row - 1))
        self._set(Phase.RESTARTING, f"engine {how}; restarting in {delay_s:g} s{said}")
        log.warning("engine %s %s; restarting in %g s; its last output:\n%s",
                    self.spec.deployment_id, how, delay_s, last or "(none)")
        await asyncio.sleep(delay_s)
        if self._stopping:
            return False
        self._restarts += 1
        await self._spawn_safely()
        return self._proc is not None and self._phase is not Phase.FAILED

    async def _drain_before_sigterm(self, grace_s: float, waiter: asyncio.Future[int]
                                    ) -> tuple[float, str]:
        """Mark the deployment draining; on a release that aborts in-flight requests on
        SIGTERM (`drain.aborts_on_sigterm`), first wait until the engine's metrics show
        none in flight (or the grace but the exit reserve has passed). Returns the grace
        left for the engine to exit after SIGTERM, and a note for the final message when
        requests were still in flight."""
        release = release_or_newest(self.spec.engine, self.release)
        if not aborts_on_sigterm(release, self.spec.shutdown_timeout_s):
            self._set(Phase.DRAINING, f"SIGTERM sent; draining for up to {grace_s:g} s")
            return grace_s, ""
        loop = asyncio.get_running_loop()
        started = loop.time()
        budget_s = grace_s - exit_reserve_s(grace_s)
        waiting = (f"waiting up to {budget_s:g} s for in-flight requests before SIGTERM "
                   f"({self.spec.engine} {release.label} aborts in-flight requests on SIGTERM)")
        self._set(Phase.DRAINING, waiting)

        def seen(count: float | None) -> None:
            shown = "unknown (metrics unreadable)" if count is None else f"{count:g}"
            self._message = f"{waiting}; in flight: {shown}"

        result = await wait_until_idle(self.endpoints, release, budget_s,
                                       exited=waiter.done, on_count=seen)
        left_s = max(0.0, grace_s - (loop.time() - started))
        if result.drained:
            self._message = f"no request in flight; SIGTERM sent; exiting within {left_s:g} s"
            return left_s, ""
        shown = "an unknown number of" if result.in_flight is None else f"{result.in_flight:g}"
        note = f"; SIGTERM with {shown} request(s) still in flight after {budget_s:g} s"
        self._message = note.removeprefix("; ")
        log.warning("%s: %s", self.spec.deployment_id, self._message)
        return left_s, note

    def _kill_group(self) -> None:
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    async def _stop_watching(self) -> None:
        """Mark the supervisor stopping, end its watch task and let a spawn in flight
        finish (its process is then this supervisor's to leave or to stop)."""
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        if self._spawning is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._spawning

    async def _terminate(self, grace_s: float, *, draining: bool) -> None:
        try:
            await self._stop_watching()
            proc, waiter = self._proc, self._exit_waiter
            if proc is None or waiter is None:
                if self._phase is not Phase.FAILED:
                    self._set(Phase.STOPPED, "stopped (no process)")
                return
            if proc.returncode is None and not waiter.done():
                term_grace_s, drain_note = grace_s, ""
                if draining:
                    term_grace_s, drain_note = await self._drain_before_sigterm(grace_s, waiter)
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                done, _ = await asyncio.wait({waiter}, timeout=max(0.0, term_grace_s))
                killed = not done
            else:
                killed, drain_note = False, ""
            self._kill_group()
            code = await waiter
            note = drain_note + (f"; killed after {grace_s:g} s grace" if killed else "")
            self._set(Phase.STOPPED, f"engine exited with code {code}{note}")
        finally:
            # Also on cancellation: never leave the engine behind.
            self._kill_group()
            if self._state is not None:
                self._state.remove(self.spec.deployment_id)
            self._close_probe()
            await self._after_stop()

    def _close_probe(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
