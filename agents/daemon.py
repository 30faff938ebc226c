"""The agent daemon: supervises engines and streams reports to the controller.

One `Agent` per GPU host. It starts the configured deployments, keeps one
bidirectional stream to the controller (reconnecting with exponential backoff
and jitter), sends a `Report` every interval, and executes the controller's
commands. Fail static: when the controller is away, engines keep running and
nothing is stopped because of it; when the agent itself goes away (SIGTERM,
crash, upgrade), engines keep running too, and the next agent adopts them
(`handover`). Only `drain_on_exit` (decommissioning) stops them on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import grpc
from grpc import aio

from gearshift.agents.commands import CommandExecutor
from gearshift.agents.config import AgentConfig, EngineConfig
from gearshift.agents.engine_version import metadata_version, probe_version
from gearshift.agents.gpus import EmulatedGpus, GpuSource, open_gpu_source
from gearshift.agents.handover import WorkdirLock, clean_up_dead, survey
from gearshift.agents.metrics import EngineScraper, to_proto
from gearshift.agents.ops_metrics import AgentMetrics
from gearshift.agents.runtimes.base import get_runtime
from gearshift.agents.runtimes.engine_state import EngineRecord, EngineStateDir
from gearshift.agents.runtimes.supervisor import EngineSupervisor
from gearshift.common.credentials import TlsFiles, secure_channel
from gearshift.common.endpoints import ControllerEndpoints, leader_hint
from gearshift.common.engine_versions import (
    EngineRelease,
    ResolvedRelease,
    VersionMatch,
    check_pinned_version,
    release_for,
)
from gearshift.common.engines import ENGINE_NAMES, engine_entry
from gearshift.common.errors import FailedPrecondition, GearshiftError, InvalidArgument
from gearshift.common.ops_http import OpsListener, parse_listen
from gearshift.common.spec import DeploymentSpec, Phase
from gearshift.v1 import agent_pb2, agent_pb2_grpc

if TYPE_CHECKING:
    # Engines as containers (docs/containers.md) are imported only by an agent that has a
    # `containers:` block: the container client is not loaded otherwise.
    from gearshift.agents.enrolment import Enroller
    from gearshift.agents.runtimes.containers import ContainerRuntime, ImageInfo, PullProgress

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 15.0
FOLLOWER_RETRY_S = 0.5  # a follower answered but named no leader: leadership is settling
FOLLOWER_RECENT_S = 30.0  # a follower answered this recently: retry at FOLLOWER_RETRY_S
STALL_INTERVALS = 3  # no answer from the controller for this many intervals: reconnect
STALL_MIN_S = 5.0
STREAM_END_WAIT_S = 1.0  # a finished call's reader ends within this
PENDING_RESULTS_LIMIT = 1000
# The channel to the controller, without gRPC's bandwidth-delay probe: it would send a
# PING for the first DATA frame read once the probe's delay (at most 10 s) has passed, so
# for about every ack of the controller's, to grow a window that acks and commands never
# fill (the controller's server does without it too: controller/api/grpc_server.py, BDP_PROBE).
CHANNEL_OPTIONS: list[tuple[str, int]] = [("grpc.http2.bdp_probe", 0)]
DEFAULT_DRAIN_GRACE_S = 30.0
VERSION_MATCH_PROTO = {
    VersionMatch.KNOWN: agent_pb2.VERSION_MATCH_KNOWN,
    VersionMatch.NEAREST: agent_pb2.VERSION_MATCH_NEAREST,
    VersionMatch.UNKNOWN: agent_pb2.VERSION_MATCH_UNKNOWN,
}


class Agent:
    def __init__(self, config: AgentConfig, *, gpu_source: GpuSource | None = None,
                 backoff_max_s: float = BACKOFF_MAX_S) -> None:
        self.config = config
        if gpu_source is None:
            em = config.gpus.emulated
            gpu_source = open_gpu_source(
                config.gpus.source,
                EmulatedGpus(em.model, em.count, em.memory_gb) if em is not None else None)
        self.gpus = gpu_source
        self.interval_s = config.report_interval_s
        self.backoff_max_s = backoff_max_s
        self.supervisors: dict[str, EngineSupervisor] = {}
        self.state = EngineStateDir(config.workdir)
        self.adopted: list[str] = []  # deployments taken over from a previous agent
        self.scrapers: dict[str, EngineScraper] = {}
        self.seq = 0
        self.epoch_seen = 0
        self.endpoints = ControllerEndpoints(config.controller, "controller")
        self.controller_id = ""  # the controller of the current stream
        self._session_token = ""  # from the last Welcome: proves a reconnect is this agent
        self._last_heard = 0.0
        self._follower_seen = -FOLLOWER_RECENT_S  # when a follower last answered
        self.connected = asyncio.Event()
        self.connects = 0
        self._pending_results: deque[agent_pb2.CommandResult] = deque(maxlen=PENDING_RESULTS_LIMIT)
        self._call: aio.StreamStreamCall | None = None
        self._write_lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self.commands = CommandExecutor(self._emit_result, {
            "start": self._cmd_start, "drain": self._cmd_drain, "stop": self._cmd_stop,
            "build": self._cmd_build, "prepare": self._cmd_prepare},
            journal=config.command_journal)
        self._stopping = asyncio.Event()
        # Versions found by detection (package METADATA, else the catalog's probe) for
        # engines whose config gives none, and where each was read.
        self.probed_versions: dict[str, str] = {}
        self.version_sources: dict[str, str] = {}
        self._probing: asyncio.Task[None] | None = None
        self._releases: dict[tuple[str, str], ResolvedRelease] = {}  # by (engine, version)
        self.metrics = AgentMetrics()
        self.metrics.watch_engines(lambda: [(dep_id, sup.spec.engine, sup)
                                            for dep_id, sup in list(self.supervisors.items())])
        self.started = False  # engines adopted and configured deployments started
        self.ops: OpsListener | None = None
        self.enroller: Enroller | None = None
        # Engines with an `image` run as containers of this runtime (docs/containers.md).
        self.containers: ContainerRuntime | None = None
        if config.containers is not None:
            from gearshift.agents.runtimes.containers import ContainerRuntime
            self.containers = ContainerRuntime(config.containers)
        self._pulls: dict[str, asyncio.Task[ImageInfo]] = {}  # by image reference
        # (engine, image id) -> (version, where it was read): one image is read once.
        self._image_versions: dict[tuple[str, str], tuple[str, str]] = {}
        if config.enrols:
            self.enroller = self._enroller()

    def _enroller(self) -> Enroller:
        """Enrolment by bootstrap token (imported only by agents that enrol)."""
        from gearshift.agents.enrolment import Enroller, Identity, load_bootstrap_token
        cfg = self.config
        assert cfg.tls is not None
        identity = Identity(cfg.workdir, cfg.tls.ca, cfg.host_id, cfg.tls.server_name)
        return Enroller(identity, cfg.enrol_controller,
                        lambda: load_bootstrap_token(cfg.bootstrap_token_file),
                        controllers=self.endpoints)

    # -- engines ----------------------------------------------------------------

    def _engine(self, name: str) -> EngineConfig:
        return self.config.engine(name)

    def engine_image(self, name: str) -> str:
        """The engine's container image ("" = it runs as a host program)."""
        eng = self.config.engines.get(name)
        return eng.image if eng is not None else ""

    def engine_version(self, name: str) -> str:
        """The configured version, else what detection found ("" = unknown)."""
        return self._engine(name).version or self.probed_versions.get(name, "")

    def version_source(self, name: str) -> str:
        """Where the engine's version was read: "config", "metadata", "probe" or ""."""
        if self._engine(name).version:
            return "config"
        return self.version_sources.get(name, "")

    def engine_release(self, name: str) -> ResolvedRelease:
        """The version-table row the engine runs with, and how its version matched."""
        version = self.engine_version(name)
        found = self._releases.get((name, version))
        if found is None:  # read for each deployment of each report: looked up once
            found = self._releases[(name, version)] = release_for(name, version)
        return found

    def read_package_versions(self) -> None:
        """Each unconfigured engine's version from its package METADATA (file reads only)."""
        for name in ENGINE_NAMES:
            eng = self._engine(name)
            if eng.version or name in self.probed_versions or self.engine_image(name):
                continue
            found = metadata_version(engine_entry(name).package, eng.executable, eng.env)
            if found:
                self.probed_versions[name] = found
                self.version_sources[name] = "metadata"

    async def probe_versions(self) -> None:
        """Run the catalog's version probe of every engine whose version is still unknown."""
        async def one(name: str) -> None:
            eng = self._engine(name)
            if self.engine_image(name):  # read from the image where the runtime has it
                with contextlib.suppress(GearshiftError):
                    info = await self._runtime().image(self.engine_image(name))
                    if info is not None:
                        await self._version_from_image(name, info)
                return
            found = await probe_version(engine_entry(name).version_probe, env=eng.env)
            if found:
                self.probed_versions[name] = found
                self.version_sources[name] = "probe"
        await asyncio.gather(*(one(n) for n in ENGINE_NAMES if not self.engine_version(n)))

    def _runtime(self) -> ContainerRuntime:
        if self.containers is None:
            raise FailedPrecondition("engines run from images need a 'containers' block")
        return self.containers

    async def _version_from_image(self, name: str, info: ImageInfo) -> None:
        """The engine's version as its image says (`containers.image_version`)."""
        if self._engine(name).version:
            return
        found = self._image_versions.get((name, info.image_id))
        if found is None:  # an image's version is read once: it may take a container run
            from gearshift.agents.runtimes.containers import image_version
            found = await image_version(self._runtime(), info, engine_entry(name))
            self._image_versions[(name, info.image_id)] = found
        version, source = found
        if version:
            self.probed_versions[name] = version
            self.version_sources[name] = source

    async def pull_image(self, name: str,
                         on_progress: Callable[[PullProgress], None] | None = None
                         ) -> ImageInfo:
        """The engine's image, pulled when the runtime lacks it (one pull per image at a
        time: a prepare and a start share it), and its version read."""
        reference = self.engine_image(name)
        runtime = self._runtime()
        info = await runtime.image(reference)
        if info is None:
            task = self._pulls.get(reference)
            if task is None or task.done():
                task = self._pulls[reference] = asyncio.ensure_future(
                    runtime.pull(reference, on_progress))
            info = await asyncio.wait_for(asyncio.shield(task),
                                          runtime.settings.pull_timeout_s)
        await self._version_from_image(name, info)
        return info

    async def _image_ready(self, spec: DeploymentSpec, info: ImageInfo) -> EngineRelease:
        """The release row `spec` launches with, once its image is here (the version it
        pins is checked against the image's)."""
        await self._version_from_image(spec.engine, info)
        check_pinned_version(spec.engine, spec.engine_version, self.engine_version(spec.engine))
        resolved = self.engine_release(spec.engine)
        if resolved.flagged:
            log.warning("%s %s: launching with the flags of %s (%s)", spec.engine,
                        resolved.describe(), resolved.row.label, resolved.match.value)
        return resolved.row

    async def start_deployment(self, spec: DeploymentSpec) -> EngineSupervisor:
        existing = self.supervisors.get(spec.deployment_id)
        if existing is not None and existing.phase not in (Phase.STOPPED, Phase.FAILED):
            if existing.spec == spec:
                return existing
            raise FailedPrecondition(
                f"deployment {spec.deployment_id} already runs with another spec; stop it first")
        if self._probing is not None and not self._probing.done():
            # The command line depends on the engine's release: know it first.
            await asyncio.shield(self._probing)
        if not self.engine_image(spec.engine):  # an image's version is read once it is here
            resolved = self.engine_release(spec.engine)
            check_pinned_version(spec.engine, spec.engine_version,
                                 self.engine_version(spec.engine))
            if resolved.flagged:
                log.warning("%s %s: launching with the flags of %s (%s)", spec.engine,
                            resolved.describe(), resolved.row.label, resolved.match.value)
        sup = self._new_supervisor(spec, self.config.bind_host)
        self.supervisors[spec.deployment_id] = sup
        await sup.start()
        self._watch_metrics(sup)
        return sup

    def _new_supervisor(self, spec: DeploymentSpec, bind_host: str) -> EngineSupervisor:
        eng = self._engine(spec.engine)
        workdir = Path(self.config.workdir).absolute() / spec.deployment_id
        if self.engine_image(spec.engine):
            assert self.config.containers is not None  # the config's validator says so
            from gearshift.agents.runtimes.container_supervisor import ContainerSupervisor
            return ContainerSupervisor(
                spec, get_runtime(spec.engine), executable=eng.executable,
                env=dict(eng.env), workdir=workdir, bind_host=bind_host,
                release=self.engine_release(spec.engine).row,
                containers=self._runtime(), settings=self.config.containers,
                image=self.engine_image(spec.engine), host_id=self.config.host_id,
                gpus_emulated=self.gpus.emulated,
                on_image=lambda info: self._image_ready(spec, info))
        return EngineSupervisor(spec, get_runtime(spec.engine), executable=eng.executable,
                                env=dict(eng.env), workdir=workdir, bind_host=bind_host,
                                state=self.state, release=self.engine_release(spec.engine).row)

    def _watch_metrics(self, sup: EngineSupervisor) -> None:
        assert self._session is not None
        # A version the table knows is read under its release's names; any other under
        # the catalog's, which list every release's spellings.
        resolved = self.engine_release(sup.spec.engine)
        self.scrapers[sup.spec.deployment_id] = EngineScraper(
            sup.spec.engine, sup.endpoint, session=self._session,
            timeout_s=self.config.scrape_timeout_s, registry=self.metrics.registry,
            names=None if resolved.flagged else resolved.row.metric_names)

    async def adopt_engines(self) -> list[str]:
        """Take over the engines a previous agent left running in this work dir; remove
        the records (and leftover workers) of those that died. Returns adopted ids."""
        found = survey(self.state)
        for record in found.dead:
            killed = clean_up_dead(self.state, record)
            log.info("engine %s (pid %d) is gone; record removed%s", record.deployment_id,
                     record.pid, f", {killed} leftover worker(s) killed" if killed else "")
        for path, why in found.invalid:
            log.warning("unreadable engine record %s left alone: %s", path, why)
        adopted = []
        for record in found.alive:
            sup = await self._adopt(record)
            if sup is not None:
                adopted.append(record.deployment_id)
                self.metrics.adopted.inc()
        if self.containers is not None:
            try:
                adopted += await self._adopt_containers()
            except GearshiftError as exc:
                log.error("engine containers not adopted: %s", exc.message)
        self.adopted = adopted
        return adopted

    async def _adopt_containers(self) -> list[str]:
        """Take over this host's running engine containers (by their labels); remove
        those that have exited or whose engine no longer runs from an image here."""
        from gearshift.agents.runtimes.container_supervisor import (
            ContainerSupervisor,
            spec_from_labels,
        )
        from gearshift.agents.runtimes.containers import LABEL_DEPLOYMENT, LABEL_PORT
        runtime = self._runtime()
        adopted = []
        for found in await runtime.labelled(self.config.host_id):
            dep_id = found.labels[LABEL_DEPLOYMENT]
            why = ""
            try:
                spec = DeploymentSpec(**spec_from_labels(found.labels))
                state = await runtime.state(found.container_id) if found.running else None
            except (ValueError, KeyError, TypeError, InvalidArgument) as exc:
                spec, state, why = None, None, f"unreadable labels ({exc})"
            if spec is not None and not self.engine_image(spec.engine):
                why = f"{spec.engine} no longer runs from an image on this host"
            elif spec is not None and dep_id in self.supervisors:
                why = "its deployment already runs"
            elif spec is not None and (state is None or not state.get("Running")):
                why = "it has exited"
            if why or spec is None or state is None:
                await runtime.remove(found.container_id)
                log.info("engine container %s (%s) removed: %s", found.name, dep_id, why)
                continue
            sup = self._new_supervisor(spec, self.config.bind_host)
            assert isinstance(sup, ContainerSupervisor)
            self.supervisors[dep_id] = sup
            await sup.adopt_container(found, int(state.get("Pid") or 0))
            self._watch_metrics(sup)
            self.metrics.adopted.inc()
            adopted.append(dep_id)
            log.info("adopted engine container %s (%s, port %s): %s", found.name, dep_id,
                     found.labels.get(LABEL_PORT), sup.phase.value)
        return adopted

    async def _adopt(self, record: EngineRecord) -> EngineSupervisor | None:
        try:
            spec = record.deployment_spec()
            self._engine(spec.engine)
        except (InvalidArgument, KeyError) as exc:
            log.warning("engine record %s does not fit this agent (%s): left alone",
                        record.deployment_id, exc)
            return None
        sup = self._new_supervisor(spec, record.host)
        self.supervisors[spec.deployment_id] = sup
        await sup.adopt(record)
        self._watch_metrics(sup)
        log.info("adopted engine %s (pid %d, port %d): %s", spec.deployment_id, record.pid,
                 record.port, sup.phase.value)
        return sup

    async def _cmd_start(self, cmd: agent_pb2.Command, progress) -> str:  # type: ignore[no-untyped-def]
        spec = DeploymentSpec.from_proto(cmd.start.spec)
        progress(0.1, f"starting {spec.engine} for {spec.model}")
        sup = await self.start_deployment(spec)
        # An engine that exits before it is ready fails the start at once (a move rolls
        # back within one restart backoff, not at its phase deadline), saying why.
        if not await sup.wait_ready(timeout_s=600, crash_fails=True):
            raise RuntimeError(f"{spec.deployment_id} did not become ready: {sup.last_message}")
        return f"{spec.deployment_id} ready at {sup.endpoint}"

    def _supervisor(self, deployment_id: str) -> EngineSupervisor:
        sup = self.supervisors.get(deployment_id)
        if sup is None:
            raise InvalidArgument(f"no deployment {deployment_id!r} on this host")
        return sup

    async def _cmd_drain(self, cmd: agent_pb2.Command, progress) -> str:  # type: ignore[no-untyped-def]
        sup = self._supervisor(cmd.drain.deployment_id)
        await sup.drain(cmd.drain.grace_s or DEFAULT_DRAIN_GRACE_S)
        return f"{cmd.drain.deployment_id} drained"

    async def _cmd_stop(self, cmd: agent_pb2.Command, progress) -> str:  # type: ignore[no-untyped-def]
        dep_id = cmd.stop.deployment_id
        sup = self.supervisors.get(dep_id)
        if sup is None:
            if self.containers is not None:  # a container of it left behind: not wanted
                from gearshift.agents.runtimes.containers import LABEL_DEPLOYMENT
                for found in await self.containers.labelled(self.config.host_id):
                    if found.labels.get(LABEL_DEPLOYMENT) == dep_id:
                        await self.containers.remove(found.container_id)
                        return f"{dep_id} was not running; its container {found.name} removed"
            return f"{dep_id} was not running"
        await sup.stop(cmd.stop.grace_s or DEFAULT_DRAIN_GRACE_S)
        self.supervisors.pop(dep_id, None)
        self.scrapers.pop(dep_id, None)
        return f"{dep_id} stopped"

    async def _cmd_prepare(self, cmd: agent_pb2.Command, progress) -> str:  # type: ignore[no-untyped-def]
        """Pull the image of the spec's engine before the deployment starts (a move's
        window then leaves out the download); nothing for a host program."""
        spec = DeploymentSpec.from_proto(cmd.prepare.spec)
        image = self.engine_image(spec.engine)
        if not image:
            return f"{spec.engine} runs as a host program here: nothing to pull"
        loop = asyncio.get_running_loop()
        started = loop.time()

        def pulled(p: PullProgress) -> None:
            progress(p.done / p.total if p.total else 0.0, f"pulling {image}: {p.describe()}")

        progress(0.0, f"pulling {image}")
        info = await self.pull_image(spec.engine, pulled)
        check_pinned_version(spec.engine, spec.engine_version, self.engine_version(spec.engine))
        return (f"{image} is here ({info.digest[:19]}; {spec.engine} "
                f"{self.engine_version(spec.engine) or 'version unknown'}) after "
                f"{loop.time() - started:.1f} s")

    async def _cmd_build(self, cmd: agent_pb2.Command, progress) -> str:  # type: ignore[no-untyped-def]
        """Run the engine's build step (catalog `BuildStep`, e.g. `trtllm-build`)."""
        spec = DeploymentSpec.from_proto(cmd.build.spec)
        entry = engine_entry(spec.engine)
        if entry.build is None or not entry.needs_build(spec.backend):
            raise InvalidArgument(f"build: {spec.engine} backend {spec.backend!r} has no build "
                                  "step")
        eng = self._engine(spec.engine)
        out_dir = Path(self.config.workdir) / "engines" / spec.deployment_id
        out_dir.mkdir(parents=True, exist_ok=True)
        argv = entry.build.argv(eng.build_executable, source=spec.source,
                                output_dir=str(out_dir),
                                tensor_parallel_size=spec.tensor_parallel_size)
        log_path = out_dir / "build.log"
        progress(0.05, f"building a {entry.display_name} engine for {spec.model} into {out_dir}")
        with log_path.open("ab") as log_file:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=log_file, stderr=asyncio.subprocess.STDOUT, cwd=str(out_dir),
                env={**os.environ, **eng.env}, start_new_session=True)
            try:
                code = await proc.wait()
            except asyncio.CancelledError:
                proc.kill()
                raise
        if code != 0:
            raise RuntimeError(f"{argv[0]} exited with {code}; see {log_path}")
        return f"engine for {spec.deployment_id} built in {out_dir}"

    # -- reports ----------------------------------------------------------------

    async def build_report(self) -> agent_pb2.Report:
        self.seq += 1
        report = agent_pb2.Report(seq=self.seq, interval_s=self.interval_s)
        report.time.GetCurrentTime()
        try:
            report.gpus.extend(self.gpus.read())
        except Exception as exc:  # a GPU read failure must not stop reporting
            log.warning("GPU read failed: %s", exc)
        now = time.time()
        sups = list(self.supervisors.items())
        samples = await asyncio.gather(*(
            self.scrapers[dep_id].scrape(now) if sup.phase == Phase.READY and dep_id in self.scrapers
            else _none() for dep_id, sup in sups))
        for (dep_id, sup), sample in zip(sups, samples, strict=True):
            spec = sup.spec
            resolved = self.engine_release(spec.engine)
            d = report.deployments.add(
                deployment_id=dep_id, engine=spec.engine, engine_version=self.engine_version(spec.engine),
                engine_release=resolved.row.label,
                engine_version_match=VERSION_MATCH_PROTO[resolved.match],
                model=spec.model, revision=spec.revision, phase=sup.phase.to_proto(),
                endpoint=sup.endpoint or "", restarts=sup.restarts,
                message=printable(sup.last_message or "", MAX_MESSAGE_CHARS),
                backend=spec.backend, served_model_name=sup.served_model_name,
                source=spec.source, tensor_parallel_size=spec.tensor_parallel_size)
            d.gpu_indices.extend(spec.gpu_indices)
            if sup.image:
                d.image, d.image_digest = sup.image, sup.image_digest
                d.pull_bytes_done, d.pull_bytes_total = sup.pull_bytes
            if sample is not None:
                to_proto(sample, d)
        return report

    # -- connection -------------------------------------------------------------

    def _hello(self) -> agent_pb2.Hello:
        hello = agent_pb2.Hello(
            host_id=self.config.host_id, agent_version=AGENT_VERSION,
            protocol_version=agent_pb2.PROTOCOL_VERSION_1, emulated_gpus=self.gpus.emulated,
            session_token=self._session_token)
        hello.labels.update(self.config.labels)
        hello.gpus.extend(self.gpus.read())
        for name in ENGINE_NAMES:
            if not self._has_engine(name):
                continue
            eng = self._engine(name)
            resolved = self.engine_release(name)
            hello.engines.add(engine=name, version=self.engine_version(name),
                              executable=" ".join(eng.executable), release=resolved.row.label,
                              version_match=VERSION_MATCH_PROTO[resolved.match],
                              version_source=self.version_source(name),
                              image=self.engine_image(name))
        return hello

    def _has_engine(self, name: str) -> bool:
        """The host has this engine: its config names it (`engines.<name>`, or a
        deployment on it), or its version was found (package METADATA, or a probe that
        has answered). Else it is left out of the Hello, and the controller places none
        of its deployments here."""
        return (name in self.config.engines or bool(self.engine_version(name))
                or any(d.engine == name for d in self.config.deployments))

    def _emit_result(self, result: agent_pb2.CommandResult) -> None:
        self._pending_results.append(result)
        asyncio.get_running_loop().create_task(self._flush_results())

    async def _flush_results(self) -> None:
        call: aio.StreamStreamCall | None = self._call
        if call is None:
            return
        async with self._write_lock:
            while self._pending_results and self._call is call:
                result = self._pending_results[0]
                try:
                    await call.write(  # type: ignore[union-attr]  # narrowed by the loop test
                        agent_pb2.AgentMessage(command_result=result))
                except (grpc.RpcError, asyncio.InvalidStateError, aio.UsageError):
                    return
                self._pending_results.popleft()

    async def _session_once(self, channel: aio.Channel) -> None:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        call = stub.Connect()
        await call.write(agent_pb2.AgentMessage(hello=self._hello()))
        first = await call.read()
        if first is aio.EOF or first.WhichOneof("body") != "welcome":
            raise ConnectionError("controller did not answer the hello with a welcome")
        self.interval_s = first.welcome.report_interval_s or self.interval_s
        self.epoch_seen = max(self.epoch_seen, first.welcome.controller_epoch)
        self.commands.observe_epoch(first.welcome.controller_epoch)
        self.controller_id = first.welcome.controller_id
        self._session_token = first.welcome.session_token
        self._last_heard = time.monotonic()
        self.endpoints.succeeded()
        self._call = call
        self.connects += 1
        self.connected.set()
        self.metrics.following(self.controller_id, self.endpoints.current)
        log.info("connected to controller %s (epoch %d, interval %.1fs)",
                 first.welcome.controller_id, first.welcome.controller_epoch, self.interval_s)
        await self._flush_results()
        reader = asyncio.create_task(self._read_loop(call))
        try:
            while not reader.done():
                silent_s = time.monotonic() - self._last_heard
                if silent_s > max(STALL_MIN_S, STALL_INTERVALS * self.interval_s):
                    raise ConnectionError(f"controller {self.controller_id} has not answered "
                                          f"for {silent_s:.0f}s")
                began = time.monotonic()
                report = await self.build_report()
                try:
                    async with self._write_lock:
                        await call.write(agent_pb2.AgentMessage(report=report))
                except (asyncio.InvalidStateError, aio.UsageError):
                    # The call finished while the report was built (the controller
                    # closed it, or went away): its reader says why.
                    await asyncio.wait({reader}, timeout=STREAM_END_WAIT_S)
                    if reader.done():
                        break
                    raise ConnectionError("the stream finished while a report was "
                                          "being built") from None
                self.metrics.report_seconds.observe(time.monotonic() - began)
                self.metrics.reports.inc()
                self.metrics.last_report.set(time.time())
                _done, _ = await asyncio.wait({reader}, timeout=self.interval_s)
            await reader  # re-raise what ended the stream
        finally:
            reader.cancel()
            self._call = None
            self.connected.clear()
            self.metrics.disconnected()
            call.cancel()

    async def _read_loop(self, call: aio.StreamStreamCall) -> None:
        while True:
            msg = await call.read()
            if msg is aio.EOF:
                raise ConnectionError("controller closed the stream")
            self._last_heard = time.monotonic()
            kind = msg.WhichOneof("body")
            if kind == "command":
                self.commands.submit(msg.command)
            elif kind == "welcome":
                self.interval_s = msg.welcome.report_interval_s or self.interval_s

    async def run(self) -> None:
        """Adopt engines left running, start configured deployments, then stay
        connected until `stop()`."""
        lock = WorkdirLock(self.config.workdir)
        lock.acquire()
        self._session = aiohttp.ClientSession()
        self.read_package_versions()
        probing = self._probing = asyncio.create_task(self.probe_versions())
        renewing: asyncio.Task[None] | None = None
        try:
            if self.config.metrics_listen:
                self.ops = OpsListener(self.metrics.registry, self.readiness)
                port = await self.ops.start(*parse_listen(self.config.metrics_listen))
                log.info("metrics, /healthz and /readyz on %s:%d", self.ops.host, port)
            if self.containers is not None:
                try:
                    await self.containers.ensure_service(
                        Path(self.config.workdir).absolute() / "podman-service.log")
                except GearshiftError as exc:
                    log.error("engine containers: %s", exc.message)
            await self.adopt_engines()
            for dep in self.config.deployments:
                spec = DeploymentSpec(**dep.model_dump())
                try:
                    await self._start_configured(spec)
                except InvalidArgument as exc:  # e.g. a pinned version this host lacks
                    log.error("deployment %s not started: %s", spec.deployment_id, exc.message)
            self.started = True
            if self.enroller is not None:
                if not await self.enroller.ensure(self._stopping):
                    return
                renewing = asyncio.create_task(self.enroller.renew_forever(self._stopping))
            await self._connect_forever()
        finally:
            for task in (probing, renewing):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            try:
                await self.shutdown(drain=self.config.drain_on_exit)
            finally:
                lock.release()

    def readiness(self) -> tuple[bool, str]:
        """Ready = its engines adopted and its configured deployments started, and a
        controller has welcomed it at least once (its config and credentials work); from
        then on either connected to a leading controller or running fail static
        (engines serving on, reports resumed when a controller answers)."""
        if not self.started:
            return False, "adopting and starting engines"
        if self.connected.is_set():
            return True, f"connected to {self.controller_id}"
        serving = sum(1 for s in self.supervisors.values() if s.phase is Phase.READY)
        if self.connects == 0:  # never welcomed: a wrong address, CA or token shows here
            if self.enroller is not None and self.enroller.issued is None:
                return False, (f"enrolling at {self.config.enrol_controller} (no certificate "
                               f"yet); {serving} engine(s) ready")
            return False, (f"no controller has answered yet (trying "
                           f"{self.endpoints.current}); {serving} engine(s) ready")
        return True, f"fail static: no controller stream; {serving} engine(s) ready"

    async def _start_configured(self, spec: DeploymentSpec) -> None:
        running = self.supervisors.get(spec.deployment_id)
        if running is not None and running.adopted and running.spec != spec:
            # The config changed while the agent was away: the operator's file wins.
            log.warning("adopted engine %s runs another spec than the config names; "
                        "replacing it", spec.deployment_id)
            await running.stop(DEFAULT_DRAIN_GRACE_S)
            self.supervisors.pop(spec.deployment_id, None)
        await self.start_deployment(spec)

    async def _connect_forever(self) -> None:
        backoff = BACKOFF_INITIAL_S
        while not self._stopping.is_set():
            addr = self.endpoints.current
            started = time.monotonic()
            delay: float | None = None
            async with self._channel(addr) as channel:
                try:
                    await self._session_once(channel)
                    self.endpoints.failed(None)  # ended without an error: try the next one
                except (grpc.RpcError, ConnectionError, OSError) as exc:
                    detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)  # type: ignore[attr-defined]
                    code = exc.code() if isinstance(exc, grpc.RpcError) else None  # type: ignore[attr-defined]
                    log.warning("controller %s: stream ended: %s", addr, detail)
                    follower = leader_hint(exc) is not None
                    if self.endpoints.failed(exc):
                        delay = 0.0  # a follower named the leader: go there at once
                        log.info("following the leader to %s", self.endpoints.current)
                    elif follower:  # leadership is settling: ask again soon
                        delay = FOLLOWER_RETRY_S * random.uniform(0.5, 1.0)
                    if follower:
                        self._follower_seen = time.monotonic()
                        backoff = BACKOFF_INITIAL_S
                    elif code in (grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.PERMISSION_DENIED):
                        log.error("the controller refused this agent: %s", detail)
            if time.monotonic() - started > 3 * self.interval_s:
                backoff = BACKOFF_INITIAL_S  # the session was healthy: start over
            if delay is None and time.monotonic() - self._follower_seen < FOLLOWER_RECENT_S:
                # Another controller is up and a leader is being elected: the dead one's
                # lease runs out within its TTL, so keep asking rather than back off.
                delay = FOLLOWER_RETRY_S * random.uniform(0.5, 1.0)
            if delay is None:
                delay = random.uniform(0.5, 1.0) * backoff
                backoff = min(self.backoff_max_s, backoff * 2)
            if delay > 0:
                log.info("reconnecting to %s in %.1fs (engines keep running)",
                         self.endpoints.current, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)

    def _channel(self, addr: str) -> aio.Channel:
        tls = self.config.tls
        if self.enroller is not None:  # read afresh: a renewal replaces the file
            files: TlsFiles | None = self.enroller.identity.tls_files()
        else:
            files = None if tls is None else TlsFiles(tls.ca, tls.cert, tls.key,
                                                      tls.server_name)
        channel: aio.Channel = secure_channel(addr, files, None, aio=True,
                                              options=CHANNEL_OPTIONS)
        return channel

    def stop(self) -> None:
        self._stopping.set()

    async def shutdown(self, grace_s: float = 10.0, *, drain: bool = False) -> None:
        """Leave: engines keep serving (their records let the next agent adopt them),
        or, with `drain`, are stopped (SIGTERM, SIGKILL after `grace_s`)."""
        await self.commands.close()
        if self.ops is not None:
            await self.ops.stop()
        if drain:
            await asyncio.gather(*(s.stop(grace_s) for s in self.supervisors.values()),
                                 return_exceptions=True)
        else:
            await asyncio.gather(*(s.detach() for s in self.supervisors.values()),
                                 return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self.containers is not None:
            await self.containers.close()


MAX_MESSAGE_CHARS = 2000  # the controller takes up to 2048 (controller/api/validation.py)
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str, limit: int) -> str:
    """`text` without control characters (an engine's colored output), cut to `limit`."""
    text = _CONTROLS.sub(" ", text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


async def _none() -> None:
    return None


async def run_agent(config: AgentConfig) -> None:
    agent = Agent(config)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: task.cancel() if task else None)
    try:
        await agent.run()
    except asyncio.CancelledError:
        if config.drain_on_exit:
            log.info("agent stopped; its engines were drained (drain on exit)")
        else:
            log.info("agent stopped; its engines keep serving for the next agent to adopt")
