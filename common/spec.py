"""What to run (DeploymentSpec) and how it is doing (Phase), mirroring `gearshift.v1`.

`DeploymentSpec.from_proto` fills proto3 zero values with the defaults
(tensor parallel 1, GPU memory fraction 0.9, the engine's default backend from
the catalog) and validates every field against the engine catalog; bad specs raise `InvalidArgument`
naming the field and the value found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from gearshift.common.engine_versions import version_key
from gearshift.common.engines import ENGINE_NAMES, engine_entry, is_engine
from gearshift.common.errors import InvalidArgument
from gearshift.v1 import agent_pb2

DEFAULT_GPU_MEMORY_FRACTION = 0.9
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # what a name may not hold


class Phase(StrEnum):
    """Life of one engine deployment on an agent."""

    STARTING = "starting"      # process started, engine loading (connections refused)
    READY = "ready"            # health endpoint answers 200
    UNHEALTHY = "unhealthy"    # health endpoint failing while the process runs
    RESTARTING = "restarting"  # crashed; waiting for the next restart (backoff)
    DRAINING = "draining"      # finishing in-flight requests (SIGTERM sent, or held until none)
    STOPPED = "stopped"        # stopped on purpose; no process left
    FAILED = "failed"          # gave up restarting (or could not start at all)
    BUILDING = "building"      # engine build in progress
    PULLING = "pulling"        # the engine's container image is being pulled

    def to_proto(self) -> agent_pb2.DeploymentPhase.ValueType:
        return _PHASE_TO_PROTO[self]

    @classmethod
    def from_proto(cls, value: int) -> Phase:
        for phase, number in _PHASE_TO_PROTO.items():
            if number == value:
                return phase
        raise InvalidArgument(f"deployment phase: unknown or unspecified value {value}")


_PHASE_TO_PROTO: dict[Phase, agent_pb2.DeploymentPhase.ValueType] = {
    Phase.STARTING: agent_pb2.DEPLOYMENT_PHASE_STARTING,
    Phase.READY: agent_pb2.DEPLOYMENT_PHASE_READY,
    Phase.UNHEALTHY: agent_pb2.DEPLOYMENT_PHASE_UNHEALTHY,
    Phase.RESTARTING: agent_pb2.DEPLOYMENT_PHASE_RESTARTING,
    Phase.DRAINING: agent_pb2.DEPLOYMENT_PHASE_DRAINING,
    Phase.STOPPED: agent_pb2.DEPLOYMENT_PHASE_STOPPED,
    Phase.FAILED: agent_pb2.DEPLOYMENT_PHASE_FAILED,
    Phase.BUILDING: agent_pb2.DEPLOYMENT_PHASE_BUILDING,
    Phase.PULLING: agent_pb2.DEPLOYMENT_PHASE_PULLING,
}


@dataclass(frozen=True)
class DeploymentSpec:
    """One engine deployment: which model, which engine, where, on which GPUs."""

    deployment_id: str
    model: str                             # served model name clients use
    engine: str                            # a catalog name: "vllm", "tensorrt-llm", ...
    source: str = ""                       # checkpoint path or hub id ("" = model)
    revision: str = ""
    backend: str = ""                      # one of the entry's backends ("" when it has none)
    port: int = 0                          # 0 = the supervisor picks a free port
    tensor_parallel_size: int = 1
    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION
    gpu_indices: tuple[int, ...] = ()
    shutdown_timeout_s: float = 0.0        # the entry's drain timeout flag; 0 = not passed
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    engine_version: str = ""               # pinned release ("0.11" = any 0.11.x); "" = any

    def __post_init__(self) -> None:
        # Normalize what proto3 leaves empty, then check every field.
        if not self.source:
            object.__setattr__(self, "source", self.model)
        if is_engine(self.engine) and not self.backend:
            object.__setattr__(self, "backend", engine_entry(self.engine).default_backend)
        object.__setattr__(self, "gpu_indices", tuple(self.gpu_indices))
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        self._validate()

    def _validate(self) -> None:
        where = f"deployment spec {self.deployment_id!r}"
        if not _ID_RE.match(self.deployment_id):
            raise InvalidArgument(
                f"deployment spec: deployment_id {self.deployment_id!r} must be 1-128 letters, "
                "digits, '.', '_' or '-', starting with a letter or digit")
        if not self.model or not self.model.strip():
            raise InvalidArgument(f"{where}: model must not be empty")
        for name, limit in (("model", 256), ("revision", 128), ("source", 1024)):
            value = getattr(self, name)
            if len(value) > limit or _CONTROL_RE.search(value):
                raise InvalidArgument(f"{where}: {name} must be up to {limit} printable "
                                      f"characters, found {value[:80]!r}")
        if not is_engine(self.engine):
            raise InvalidArgument(
                f"{where}: engine {self.engine!r} is not one of {', '.join(ENGINE_NAMES)}")
        entry = engine_entry(self.engine)
        if entry.backends and self.backend not in entry.backends:
            raise InvalidArgument(f"{where}: backend {self.backend!r} is not one of "
                                  f"{', '.join(entry.backends)} ({self.engine})")
        if not entry.backends and self.backend:
            with_backends = [n for n in ENGINE_NAMES if engine_entry(n).backends]
            raise InvalidArgument(f"{where}: backend {self.backend!r} applies only to "
                                  f"{', '.join(with_backends)}; leave it empty for {self.engine}")
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"{where}: port {self.port} is outside 0..65535")
        if self.tensor_parallel_size < 1:
            raise InvalidArgument(
                f"{where}: tensor_parallel_size {self.tensor_parallel_size} must be >= 1")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise InvalidArgument(
                f"{where}: gpu_memory_fraction {self.gpu_memory_fraction} must be in (0, 1]")
        if any(i < 0 for i in self.gpu_indices) or len(set(self.gpu_indices)) != len(
                self.gpu_indices):
            raise InvalidArgument(
                f"{where}: gpu_indices {list(self.gpu_indices)} must be distinct and >= 0")
        if self.gpu_indices and len(self.gpu_indices) != self.tensor_parallel_size:
            raise InvalidArgument(
                f"{where}: {len(self.gpu_indices)} gpu_indices {list(self.gpu_indices)} do not "
                f"match tensor_parallel_size {self.tensor_parallel_size}")
        if not self.shutdown_timeout_s >= 0.0:
            raise InvalidArgument(
                f"{where}: shutdown_timeout_s {self.shutdown_timeout_s} must be >= 0")
        if self.engine_version:
            try:
                version_key(self.engine_version)
            except ValueError:
                raise InvalidArgument(
                    f"{where}: engine_version {self.engine_version!r} is not a release "
                    "version (e.g. 0.11 or 1.2.0)") from None

    @classmethod
    def from_proto(cls, msg: agent_pb2.DeploymentSpec) -> DeploymentSpec:
        """Read a spec from the wire; zero values take the engine defaults."""
        return cls(
            deployment_id=msg.deployment_id,
            model=msg.model,
            engine=msg.engine,
            source=msg.source,
            revision=msg.revision,
            backend=msg.backend,
            port=msg.port,
            tensor_parallel_size=msg.tensor_parallel_size or 1,
            gpu_memory_fraction=msg.gpu_memory_fraction or DEFAULT_GPU_MEMORY_FRACTION,
            gpu_indices=tuple(msg.gpu_indices),
            shutdown_timeout_s=msg.shutdown_timeout_s,
            extra_args=tuple(msg.extra_args),
            engine_version=msg.engine_version,
        )

    def to_proto(self) -> agent_pb2.DeploymentSpec:
        return agent_pb2.DeploymentSpec(
            deployment_id=self.deployment_id,
            model=self.model,
            source=self.source,
            revision=self.revision,
            engine=self.engine,
            backend=self.backend,
            port=self.port,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_fraction=self.gpu_memory_fraction,
            gpu_indices=list(self.gpu_indices),
            shutdown_timeout_s=self.shutdown_timeout_s,
            extra_args=list(self.extra_args),
            engine_version=self.engine_version,
        )
