"""The agent's configuration file (YAML), validated strictly.

Unknown keys are errors; every error names the field path and the value found.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gearshift.common.endpoints import parse_controllers
from gearshift.common.engines import ENGINE_NAMES, engine_entry, is_engine
from gearshift.common.errors import ConfigError
from gearshift.common.ops_http import parse_listen

MAX_CONFIG_BYTES = 1024 * 1024  # an agent config is a page of YAML
MAX_CONFIG_NODES = 100_000  # YAML nodes counted with aliases expanded (alias bombs)
MAX_CONFIG_DEPTH = 32  # the schema nests five levels; anything deeper is a mistake


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EmulatedGpuConfig(_Strict):
    model: str = "NVIDIA H100 80GB HBM3"
    count: int = Field(8, ge=0, le=64)
    memory_gb: float = Field(80.0, gt=0)


class GpuConfig(_Strict):
    source: Literal["auto", "nvml", "emulated", "none"] = "auto"
    emulated: EmulatedGpuConfig | None = None

    @model_validator(mode="after")
    def _emulated_block(self) -> GpuConfig:
        if self.source == "emulated" and self.emulated is None:
            raise ValueError("source 'emulated' needs an 'emulated' block "
                             "(e.g. emulated: {count: 8, model: NVIDIA H100 80GB HBM3})")
        return self


class EngineConfig(_Strict):
    executable: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    version: str = ""                    # reported in Hello; empty = unknown
    build_executable: list[str] = Field(default_factory=list)

    @field_validator("executable")
    @classmethod
    def _nonempty_parts(cls, v: list[str]) -> list[str]:
        if any(not p for p in v):
            raise ValueError("executable parts must be non-empty strings")
        return v


class DeploymentConfig(_Strict):
    deployment_id: str = Field(min_length=1)
    model: str = Field(min_length=1)
    source: str = ""
    revision: str = ""
    engine: str  # a name in the engine catalog
    backend: str = ""  # one of the engine's backends; "" = its default
    port: int = Field(0, ge=0, le=65535)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    gpu_memory_fraction: float = Field(0.9, gt=0, le=1)
    gpu_indices: list[int] = Field(default_factory=list)
    shutdown_timeout_s: float = Field(30.0, ge=0)
    extra_args: list[str] = Field(default_factory=list)
    engine_version: str = ""  # pinned engine release ("0.11" = any 0.11.x); "" = any

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        if not is_engine(v):
            raise ValueError(f"unknown engine {v!r}; known: {', '.join(ENGINE_NAMES)}")
        return v

    @model_validator(mode="after")
    def _known_backend(self) -> DeploymentConfig:
        backends = engine_entry(self.engine).backends
        if self.backend and self.backend not in backends:
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(backends)} "
                             f"({self.engine})" if backends else
                             f"backend {self.backend!r}: {self.engine} has no backends")
        return self


class TlsConfig(_Strict):
    """Mutual TLS to the controller: its CA, and this host's certificate and key
    (pre-made), or none of them: the agent enrols with a bootstrap token and keeps
    the certificate it is given in its work dir (docs/enrolment.md)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None  # the controller's name in its certificate, if not the address

    @model_validator(mode="after")
    def _pair(self) -> TlsConfig:
        if (self.cert is None) != (self.key is None):
            raise ValueError("give both cert and key (a pre-made certificate) or neither "
                             "(enrolment by bootstrap token)")
        return self


class AgentConfig(_Strict):
    host_id: str = Field(default_factory=socket.gethostname, min_length=1, max_length=253)
    labels: dict[str, str] = Field(default_factory=dict)
    controller: str = "127.0.0.1:50051"  # HOST:PORT, or several comma-separated (HA)
    command_journal: Path | None = None  # append every command that runs (JSON lines)
    report_interval_s: float = Field(10.0, gt=0, le=3600)
    scrape_timeout_s: float = Field(2.0, gt=0, le=60)
    workdir: Path = Path("./agent-data")
    bind_host: str = "127.0.0.1"
    tls: TlsConfig | None = None  # None: plaintext, for a controller on loopback only
    # Enrolment (tls without cert/key): the controller's enrolment listener(s), and the
    # bootstrap token's file (else $GEARSHIFT_BOOTSTRAP_TOKEN_FILE / _TOKEN).
    enrol_controller: str = ""
    bootstrap_token_file: Path | None = None
    drain_on_exit: bool = False  # stop engines when the agent exits (decommissioning)
    metrics_listen: str = ""  # HOST:PORT of /metrics, /healthz, /readyz; empty: none
    gpus: GpuConfig = GpuConfig()
    engines: dict[str, EngineConfig] = Field(default_factory=dict)
    deployments: list[DeploymentConfig] = Field(default_factory=list)

    @field_validator("engines")
    @classmethod
    def _known_engines(cls, v: dict[str, EngineConfig]) -> dict[str, EngineConfig]:
        for name in v:
            if not is_engine(name):
                raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINE_NAMES)}")
        return v

    @field_validator("metrics_listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        if v:
            parse_listen(v, "metrics_listen")
        return v

    @field_validator("controller", mode="before")
    @classmethod
    def _host_port(cls, v: Any) -> str:
        if isinstance(v, list):
            v = ",".join(str(x) for x in v)
        if not isinstance(v, str):
            raise ValueError("expected HOST:PORT or a list of them")
        try:
            return ",".join(parse_controllers(v, "controller"))
        except ConfigError as err:
            raise ValueError(err.message.removeprefix("controller: ")) from None

    @field_validator("enrol_controller", mode="before")
    @classmethod
    def _enrol_addresses(cls, v: Any) -> str:
        if isinstance(v, list):
            v = ",".join(str(x) for x in v)
        if not v:
            return ""
        if not isinstance(v, str):
            raise ValueError("expected HOST:PORT or a list of them")
        try:
            return ",".join(parse_controllers(v, "enrol_controller"))
        except ConfigError as err:
            raise ValueError(err.message.removeprefix("enrol_controller: ")) from None

    @model_validator(mode="after")
    def _enrolment(self) -> AgentConfig:
        enrols = self.tls is not None and self.tls.cert is None
        if enrols and not self.enrol_controller:
            raise ValueError("tls without cert and key means enrolment by bootstrap token: "
                             "give enrol_controller (--enrol-controller HOST:PORT, the "
                             "controller's --enrol-listen)")
        if self.enrol_controller and not enrols:
            raise ValueError("enrol_controller needs tls with a CA and without cert/key "
                             "(a pre-made certificate needs no enrolment)")
        return self

    @property
    def enrols(self) -> bool:
        """Joins by bootstrap token (no pre-made certificate)."""
        return self.tls is not None and self.tls.cert is None

    def engine(self, name: str) -> EngineConfig:
        cfg = self.engines.get(name) or EngineConfig()
        if not cfg.executable:
            cfg = cfg.model_copy(update={"executable": list(engine_entry(name).executable)})
        return cfg


def _format_error(source: str, err: ValidationError, data: Any) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        found = e.get("input")
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: {path}: unknown key")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{source}: {path}: {msg}; found {found!r}")
    return "invalid agent config:\n  " + "\n  ".join(lines)


def parse_agent_config(data: Any, source: str = "<agent config>") -> AgentConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, found {type(data).__name__}")
    try:
        cfg = AgentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(source, err, data)) from None
    ids = [d.deployment_id for d in cfg.deployments]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"{source}: deployments: duplicate deployment_id {', '.join(dupes)}")
    return cfg


def load_agent_config(path: Path | None, overrides: dict[str, Any] | None = None,
                      defaults: dict[str, Any] | None = None) -> AgentConfig:
    """The config file, `overrides` (CLI flags) winning over it, it over `defaults`."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        loaded = _load_yaml(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, found {type(loaded).__name__}")
        data = dict(loaded or {})
    for k, v in (defaults or {}).items():
        if v is not None and k not in data:
            data[k] = v
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return parse_agent_config(data, source)


def _load_yaml(path: Path) -> Any:
    """The file's YAML value, read up to MAX_CONFIG_BYTES and checked for size and
    depth before it is built (every refusal is a one-line `ConfigError`)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_yaml_bytes(data, path)


def parse_yaml_bytes(data: bytes, path: Path | str) -> Any:
    """The YAML value of a config file's bytes (see `_load_yaml`)."""
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return None
        _check_shape(node, path)
        return yaml.SafeLoader(text).construct_document(node)
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()
        raise ConfigError(f"{path}: not valid YAML: {' '.join(ln.strip() for ln in first)}"
                          ) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested more than {MAX_CONFIG_DEPTH} levels deep") from None
    except (ValueError, TypeError) as exc:  # e.g. a malformed timestamp scalar
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def _check_shape(root: yaml.Node, path: Path | str) -> None:
    """Depth and node count (aliases expanded), walked without recursion."""
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_CONFIG_NODES:
            raise ConfigError(f"{path}: more than {MAX_CONFIG_NODES} YAML nodes "
                              f"(aliases expanded)")
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{path}:{node.start_mark.line + 1}: nested more than "
                              f"{MAX_CONFIG_DEPTH} levels deep")
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.append((k, depth + 1))
                stack.append((v, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((n, depth + 1) for n in node.value)
