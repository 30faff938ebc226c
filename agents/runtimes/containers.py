"""Engines as containers: the container runtime's API, as the agent uses it.

The agent drives Podman or Docker through the Docker Engine API, which Podman also
serves (`podman system service`), with aiodocker: an asyncio client on aiohttp, which
the agent already runs on (docs/containers.md says why). Nothing here shells out to a
`podman` or `docker` command.

- `container_request` turns an engine's launch plan into the runtime's create request:
  the image, the engine's command line without what the image's ENTRYPOINT already
  supplies, host networking or a published port, GPUs by CDI or Docker's GPU request
  (none on an emulated inventory), `--ipc=host` or a shm size, the model cache and
  read-only model dirs, ulimits, secrets in the environment (read from files), and the
  labels that make the container this agent's: `dev.gearshift.deployment`, the host,
  the spec's hash and the spec itself (a successor adopts by them).
- `ContainerRuntime` pulls (with progress), inspects images, runs, signals, waits for,
  reads the last lines of, lists and removes containers. Every refusal of the runtime
  becomes a `ContainerError` carrying the runtime's own message.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import resource
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiodocker
import aiohttp

from gearshift.agents.config import ContainersConfig, parse_size
from gearshift.common.engines import EngineEntry, ImageFacts
from gearshift.common.errors import GearshiftError
from gearshift.common.spec import DeploymentSpec

log = logging.getLogger(__name__)

LABEL_DEPLOYMENT = "dev.gearshift.deployment"
LABEL_HOST = "dev.gearshift.host"
LABEL_SPEC_HASH = "dev.gearshift.spec-hash"
LABEL_SPEC = "dev.gearshift.spec"  # the DeploymentSpec as JSON (adoption)
LABEL_PORT = "dev.gearshift.port"
LABEL_SERVED = "dev.gearshift.served-model-name"
LABEL_RESTARTS = "dev.gearshift.restarts"
OCI_VERSION_LABEL = "org.opencontainers.image.version"
OCI_TITLE_LABEL = "org.opencontainers.image.title"
_VERSION_RE = re.compile(r"^v?\d+\.\d+(?:\.\d+)?[0-9A-Za-z.+-]*$")
LOG_TAIL_LINES = 20
SERVICE_START_S = 30.0  # `podman system service` answers within this
_RAISE = object()  # `_call`'s default: a 404 is an error like any other
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.-]")


class ContainerError(GearshiftError):
    """The container runtime refused or failed a request; the message is the runtime's."""


@dataclass(frozen=True)
class ImageInfo:
    """What the runtime knows of a local image."""

    reference: str
    image_id: str
    digest: str                    # repo digest (sha256:...) where known, else the image id
    labels: Mapping[str, str]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ContainerInfo:
    """One labelled container as listed by the runtime."""

    container_id: str
    name: str
    running: bool
    labels: Mapping[str, str]
    exit_code: int | None = None


@dataclass(frozen=True)
class PullProgress:
    """Bytes pulled so far of all layers seen (`total` 0 while no layer gave its size)."""

    done: int = 0
    total: int = 0

    def describe(self) -> str:
        if self.total <= 0:
            return f"{self.done / 1e6:.1f} MB" if self.done else "starting"
        return f"{self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB"


def spec_hash(spec: DeploymentSpec) -> str:
    """A short stable hash of the spec (label `dev.gearshift.spec-hash`)."""
    return hashlib.sha256(spec_json(spec).encode()).hexdigest()[:16]


def spec_json(spec: DeploymentSpec) -> str:
    data = {**spec.__dict__, "gpu_indices": list(spec.gpu_indices),
            "extra_args": list(spec.extra_args)}
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def container_name(host_id: str, deployment_id: str) -> str:
    """The container's name: unique per host id and deployment on one runtime."""
    return _NAME_BAD.sub("_", f"gearshift-{host_id}-{deployment_id}")[:200]


def version_from_tag(reference: str) -> str:
    """The version in an image tag: `...:v0.11.0` -> `0.11.0` ("" without a tag)."""
    name = reference.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return ""
    tag = last.rsplit(":", 1)[1]
    m = re.match(r"^v?(\d+(?:\.\d+){0,3}(?:(?:rc|post|\.dev)\d+)?)", tag)
    return m.group(1) if m else ""


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    read_only: bool = False

    def bind(self) -> str:
        return f"{self.source}:{self.target}:{'ro' if self.read_only else 'rw'}"


def container_request(*, image: str, argv: Sequence[str], facts: ImageFacts,
                      env: Mapping[str, str], labels: Mapping[str, str],
                      settings: ContainersConfig, gpu_request: str,
                      gpu_indices: Sequence[int], bind_host: str, port: int,
                      mounts: Sequence[Mount], stop_timeout_s: float) -> dict[str, Any]:
    """The Docker Engine API's create body for one engine container.

    `gpu_request`: "cdi" (a CDI device `nvidia.com/gpu=<index>` per GPU), "nvidia"
    (Docker's GPU request) or "none" (an emulated inventory, or no GPUs in the spec)."""
    host: dict[str, Any] = {
        "Binds": [m.bind() for m in mounts],
        "Ulimits": [{"Name": name, "Soft": value, "Hard": value}
                    for name, value in grantable_ulimits(
                        {**dict(facts.ulimits), **settings.ulimits})],
        "RestartPolicy": {"Name": "no"},  # the agent restarts it, with backoff
        "Init": False,
    }
    if settings.ipc_host:
        host["IpcMode"] = "host"
    else:
        host["ShmSize"] = parse_size(settings.shm_size, "shm_size")
    entrypoint, command = facts.entrypoint_and_command(list(argv))
    body: dict[str, Any] = {
        "Image": image,
        "Cmd": command,
        "Env": [f"{k}={v}" for k, v in sorted(env.items())],
        "Labels": dict(labels),
        "StopSignal": "SIGTERM",
        "StopTimeout": max(1, round(stop_timeout_s)),
        "HostConfig": host,
    }
    if entrypoint is not None:
        body["Entrypoint"] = entrypoint
    if settings.network == "host":
        host["NetworkMode"] = "host"
    else:
        key = f"{port}/tcp"
        body["ExposedPorts"] = {key: {}}
        host["PortBindings"] = {key: [{"HostIp": bind_host, "HostPort": str(port)}]}
    if gpu_request == "cdi" and gpu_indices:
        # A device request of the "cdi" driver: Docker's (daemon/cdi.go), and Podman's
        # compatible API from 5.4 on (containers_create.go adds its DeviceIDs to the
        # devices; CDI names in HostConfig.Devices failed there before 2026).
        host["DeviceRequests"] = [{"Driver": "cdi",
                                   "DeviceIDs": [f"nvidia.com/gpu={i}" for i in gpu_indices]}]
    elif gpu_request == "nvidia" and gpu_indices:
        # Docker's GPU request (`--gpus device=0,1`); Podman ignores it: use CDI there.
        host["DeviceRequests"] = [{"Driver": "nvidia",
                                   "DeviceIDs": [str(i) for i in gpu_indices],
                                   "Capabilities": [["gpu"]]}]
    return body


_RLIMITS = {"memlock": resource.RLIMIT_MEMLOCK, "stack": resource.RLIMIT_STACK,
             "nofile": resource.RLIMIT_NOFILE, "nproc": resource.RLIMIT_NPROC,
             "core": resource.RLIMIT_CORE}
_CAP_SYS_RESOURCE = 24


def _may_raise_limits() -> bool:
    """The agent holds CAP_SYS_RESOURCE (it may raise hard limits for its containers)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    except (OSError, ValueError):
        pass
    return False


def grantable_ulimits(wanted: Mapping[str, int]) -> list[tuple[str, int]]:
    """The ulimits to ask for: `wanted` (-1 = unlimited), each capped at the agent's own
    hard limit where the agent may not raise limits (runc fails a start that asks for
    more than it may grant). Podman's compatible API replaces its configured
    default_ulimits once a request names any ulimit: where the host's limits are below
    Podman's built-in defaults, name nofile and nproc in `containers.ulimits` too."""
    out = []
    capped = not _may_raise_limits()
    for name, value in sorted(wanted.items()):
        limit = _RLIMITS.get(name)
        if capped and limit is not None:
            hard = resource.getrlimit(limit)[1]
            if hard != resource.RLIM_INFINITY and (value < 0 or value > hard):
                log.warning("ulimit %s=%s is above what this agent may grant (%d): asking "
                            "for %d", name, value, hard, hard)
                value = hard
        out.append((name, -1 if value == resource.RLIM_INFINITY else value))
    return out


async def _answers(path: Path) -> bool:
    """Something serves HTTP on the Unix socket `path` (the runtime's `/_ping`)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 2)
    except (OSError, TimeoutError):
        return False
    try:
        writer.write(b"GET /_ping HTTP/1.0\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.read(16), 2)
        return head.startswith(b"HTTP/1.")
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


def read_secret_env(files: Mapping[str, Path]) -> dict[str, str]:
    """Each variable's value from its file (a trailing newline dropped); an unreadable
    file is a ContainerError naming the variable and the file."""
    out = {}
    for name, path in files.items():
        try:
            out[name] = path.read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ContainerError(f"containers.secret_env_files.{name}: cannot read {path}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
    return out


def _message(exc: BaseException) -> str:
    if isinstance(exc, aiodocker.DockerError):
        return str(exc.message).strip()
    return str(exc) or type(exc).__name__


class ContainerRuntime:
    """The agent's client of one container runtime's API (one per agent)."""

    def __init__(self, settings: ContainersConfig) -> None:
        self.settings = settings
        self.url = settings.socket_url
        self._docker: aiodocker.Docker | None = None
        self._cdi: bool | None = None

    @property
    def docker(self) -> aiodocker.Docker:
        if self._docker is None:
            # aiodocker takes unix:// and tcp:// (as http://) endpoints alike.
            self._docker = aiodocker.Docker(url=self.url.replace("tcp://", "http://", 1))
        return self._docker

    async def close(self) -> None:
        if self._docker is not None:
            with contextlib.suppress(Exception):
                await self._docker.close()
            self._docker = None

    async def _call(self, what: str, coro: Any, *, missing: Any = _RAISE) -> Any:
        """`await coro`; the runtime's 404 is `missing` where one is given, and any other
        refusal or failure of the API a ContainerError (`_refusal`)."""
        try:
            return await coro
        except aiodocker.DockerError as exc:
            if exc.status == 404 and missing is not _RAISE:
                return missing
            raise self._refusal(what, exc) from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise self._refusal(what, exc) from None

    def _refusal(self, what: str, exc: BaseException) -> ContainerError:
        """The runtime's own message (it refused), or the API's failure (unreachable)."""
        if isinstance(exc, aiodocker.DockerError):
            return ContainerError(f"{self.settings.runtime}: {what}: {_message(exc)}")
        return ContainerError(f"{self.settings.runtime} API at {self.url}: {what}: "
                              f"{_message(exc)}")

    async def ensure_service(self, log_path: Path) -> None:
        """With Podman at its default endpoint and nothing answering there (a host without
        the `podman.socket` unit), start `podman system service` on it, in a session of
        its own so that it outlives the agent as the containers do; a later agent finds it
        answering. Any other runtime or endpoint is the operator's to run."""
        if self.settings.runtime != "podman" or self.settings.endpoint:
            return
        path = Path(self.url.removeprefix("unix://"))
        if await _answers(path):
            return
        podman = shutil.which("podman")
        if podman is None:
            raise ContainerError(f"podman: no API at {self.url} and no podman command to "
                                 "start one (install podman, or give containers.endpoint)")
        path.parent.mkdir(parents=True, exist_ok=True)
        log.info("no podman API at %s: starting `podman system service` there (log: %s)",
                 self.url, log_path)
        with open(log_path, "ab") as out:
            subprocess.Popen([podman, "system", "service", "--time=0", self.url],
                             stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        for _ in range(int(SERVICE_START_S / 0.1)):
            if await _answers(path):
                return
            await asyncio.sleep(0.1)
        raise ContainerError(f"podman: `podman system service {self.url}` did not answer "
                             f"within {SERVICE_START_S:g} s; see {log_path}")

    async def gpu_request(self, emulated: bool) -> str:
        """How this runtime is asked for GPUs: "none", "cdi" or "nvidia"."""
        if emulated:
            return "none"
        mode = self.settings.gpus
        if mode != "auto":
            return mode
        if self.settings.runtime == "podman":
            return "cdi"
        if self._cdi is None:
            info = await self._call("info", self.docker.system.info())
            self._cdi = bool(info.get("CDISpecDirs"))
        return "cdi" if self._cdi else "nvidia"

    # -- images ----------------------------------------------------------------------

    async def image(self, reference: str) -> ImageInfo | None:
        """The local image `reference`, or None when the runtime has none by that name."""
        data = await self._call(f"inspect {reference}", self.docker.images.inspect(reference),
                                missing=None)
        if data is None:
            return None
        digests = data.get("RepoDigests") or []
        digest = ""
        for d in digests:
            if "@" in d:
                digest = d.split("@", 1)[1]
                break
        config = data.get("Config") or {}
        env = dict(e.split("=", 1) for e in config.get("Env") or [] if "=" in e)
        return ImageInfo(reference=reference, image_id=str(data.get("Id", "")),
                         digest=digest or str(data.get("Id", "")),
                         labels=dict(config.get("Labels") or {}), env=env)

    async def pull(self, reference: str,
                   on_progress: Callable[[PullProgress], None] | None = None) -> ImageInfo:
        """Pull `reference`; `on_progress` sees the bytes of every layer so far. The
        runtime's refusal (no such image, registry unreachable or refusing) is a
        ContainerError with its message."""
        layers: dict[str, tuple[int, int]] = {}
        try:
            async for item in self.docker.images.pull(reference, stream=True):
                detail = item.get("progressDetail") or {}
                layer = item.get("id")
                if layer and isinstance(detail, dict) and "current" in detail:
                    layers[layer] = (int(detail.get("current") or 0),
                                     int(detail.get("total") or 0))
                    if on_progress is not None:
                        on_progress(PullProgress(sum(c for c, _ in layers.values()),
                                                 sum(t for _, t in layers.values())))
        except (aiodocker.DockerError, aiohttp.ClientError, OSError) as exc:
            raise self._refusal(f"pull {reference}", exc) from None
        found = await self.image(reference)
        if found is None:
            raise ContainerError(f"{self.settings.runtime}: pull {reference}: the runtime "
                                 "reported no error but has no such image afterwards")
        if on_progress is not None and layers:
            total = sum(t for _, t in layers.values())
            on_progress(PullProgress(total, total))
        return found

    async def package_version(self, image: str, package: str) -> str:
        """The engine package's version read from its metadata inside `image` (a short
        container without network; "" when it cannot be read)."""
        script = f"import importlib.metadata as m; print(m.version({package!r}))"
        body: dict[str, Any] = {"Image": image, "Entrypoint": ["python3", "-c", script], "Cmd": [],
                "Labels": {"dev.gearshift.probe": "version"},
                "HostConfig": {"NetworkMode": "none"}}
        try:
            container = await self.docker.containers.create(body)
        except (aiodocker.DockerError, aiohttp.ClientError, OSError):
            return ""
        try:
            await container.start()
            result = await asyncio.wait_for(container.wait(), 60)
            if int(result.get("StatusCode", 1)) != 0:
                return ""
            lines = await container.log(stdout=True, stderr=False)
            text = "".join(lines).strip().splitlines()
            return text[-1].strip() if text else ""
        except (aiodocker.DockerError, aiohttp.ClientError, OSError, TimeoutError):
            return ""
        finally:
            with contextlib.suppress(Exception):
                await container.delete(force=True)

    # -- containers ------------------------------------------------------------------

    async def run(self, name: str, body: Mapping[str, Any]) -> tuple[str, int]:
        """Create and start container `name`; returns (id, main pid). A container left
        under that name (a crashed run) is removed first."""
        await self.remove(name)
        container = await self._call(f"create {name}",
                                     self.docker.containers.create(dict(body), name=name))
        try:
            await self._call(f"start {name}", container.start())
            data = await self._call(f"inspect {name}", container.show())
        except ContainerError:
            with contextlib.suppress(Exception):
                await container.delete(force=True)
            raise
        return container.id, int((data.get("State") or {}).get("Pid") or 0)

    async def wait(self, container_id: str) -> int:
        """The container's exit code, once it has exited."""
        data = await self._call(f"wait {container_id[:12]}",
                                self.docker.containers.container(container_id).wait(
                                    condition="not-running"))
        return int(data.get("StatusCode", -1))

    async def state(self, container_id: str) -> dict[str, Any] | None:
        """The container's State, or None when it no longer exists."""
        data = await self._call(f"inspect {container_id[:12]}",
                                self.docker.containers.container(container_id).show(),
                                missing=None)
        if data is None:
            return None
        return dict(data.get("State") or {})

    async def kill(self, container_id: str, signal: str) -> None:
        """Send `signal` to the container's main process (nothing if it has exited)."""
        try:
            await self.docker.containers.container(container_id).kill(signal=signal)
        except aiodocker.DockerError as exc:
            if exc.status == 404 or (exc.status in (409, 500)
                                     and "running" in _message(exc).lower()):
                return  # not running (any more), or gone
            raise self._refusal(f"kill {container_id[:12]}", exc) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise self._refusal(f"kill {container_id[:12]}", exc) from None

    async def tail(self, container_id: str, lines: int = LOG_TAIL_LINES) -> str:
        """The container's last `lines` lines of output ("" when it cannot be read)."""
        try:
            out = await self.docker.containers.container(container_id).log(
                stdout=True, stderr=True, tail=lines)
        except (aiodocker.DockerError, aiohttp.ClientError, OSError):
            return ""
        return "".join(out).rstrip()

    async def remove(self, name_or_id: str) -> bool:
        """Remove the container (killing it if it runs); False when there was none."""
        gone = await self._call(f"remove {name_or_id[:40]}",
                                self.docker.containers.container(name_or_id).delete(
                                    force=True, v=True), missing=False)
        return gone is not False

    async def labelled(self, host_id: str) -> list[ContainerInfo]:
        """Every container of any state that carries this host's gearshift labels."""
        filters = json.dumps({"label": [LABEL_DEPLOYMENT, f"{LABEL_HOST}={host_id}"]})
        found = await self._call("list containers",
                                 self.docker.containers.list(all=True, filters=filters))
        out = []
        for c in found:
            data = c._container
            labels = data.get("Labels") or {}
            if labels.get(LABEL_HOST) != host_id or LABEL_DEPLOYMENT not in labels:
                continue  # a runtime that ignored the filter: never touch another's
            names = data.get("Names") or [""]
            out.append(ContainerInfo(container_id=str(data.get("Id", "")),
                                     name=str(names[0]).lstrip("/"),
                                     running=str(data.get("State", "")) == "running",
                                     labels=dict(labels)))
        return out


async def image_version(runtime: ContainerRuntime, info: ImageInfo, engine: EngineEntry
                        ) -> tuple[str, str]:
    """(version, where it was read) of the engine in image `info`:

    1. "image-label": the OCI version label, where the image's title names the engine
       (an image built FROM ubuntu inherits its `org.opencontainers.image.version=22.04`,
       and the engines' own images set no label of their own);
    2. "image-env": the variable the catalog names (TensorRT-LLM's TRT_LLM_VERSION);
    3. "image-metadata": the engine package's metadata, read in a short container;
    4. "image-tag": the tag (`v0.11.0` -> 0.11.0); ("", "") when none of these gives one."""
    title = info.labels.get(OCI_TITLE_LABEL, "").lower()
    label = info.labels.get(OCI_VERSION_LABEL, "").strip()
    names = {engine.name, engine.package.replace("_", "-"), engine.package}
    if label and any(n in title for n in names) and _VERSION_RE.match(label):
        return label.removeprefix("v"), "image-label"
    facts = engine.image
    if facts is not None and facts.version_env:
        found = info.env.get(facts.version_env, "").strip()
        if _VERSION_RE.match(found):
            return found.removeprefix("v"), "image-env"
    found = await runtime.package_version(info.reference, engine.package)
    if _VERSION_RE.match(found):
        return found, "image-metadata"
    tagged = version_from_tag(info.reference)
    return (tagged, "image-tag") if tagged else ("", "")


async def drain_containers(runtime: ContainerRuntime, host_id: str, grace_s: float) -> list[str]:
    """Stop (SIGTERM, SIGKILL after `grace_s`) and remove every engine container of
    `host_id`; one line per container (`gearshift agent drain`)."""
    lines = []
    for found in await runtime.labelled(host_id):
        if found.running:
            await runtime.kill(found.container_id, "SIGTERM")
            with contextlib.suppress(TimeoutError, ContainerError):
                await asyncio.wait_for(runtime.wait(found.container_id), grace_s)
        await runtime.remove(found.container_id)
        lines.append(f"{found.labels.get(LABEL_DEPLOYMENT, '?')}: container {found.name} "
                     f"{'stopped and ' if found.running else ''}removed")
    return lines
