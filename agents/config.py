"""The agent's configuration file (YAML), validated strictly.

Unknown keys are errors; every error names the field path and the value found, and
where a value came from other than the file (an environment variable), that source.
A relative path in the file is taken from the file's directory, not from the directory
the agent runs in; one given on the command line stays relative to the latter.
"""

from __future__ import annotations

import os
import re
import socket
import types
import typing
from collections.abc import Mapping
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
    # A container image (a tag, or pinned by digest: name@sha256:...): the engine runs as a
    # container of the `containers:` runtime instead of a host program (docs/containers.md).
    image: str = ""
    executable: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    version: str = ""                    # reported in Hello; empty = unknown
    build_executable: list[str] = Field(default_factory=list)

    @field_validator("image")
    @classmethod
    def _image_reference(cls, v: str) -> str:
        if v and (len(v) > 512 or not _IMAGE_RE.match(v)):
            raise ValueError("expected an image reference such as "
                             "docker.io/vllm/vllm-openai:v0.11.0 or name@sha256:<64 hex digits>")
        return v

    @field_validator("executable")
    @classmethod
    def _nonempty_parts(cls, v: list[str]) -> list[str]:
        if any(not p for p in v):
            raise ValueError("executable parts must be non-empty strings")
        return v


_IMAGE_RE = re.compile(
    r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")


class ContainersConfig(_Strict):
    """How engines with an `image` run: the container runtime and what every engine
    container gets (docs/containers.md)."""

    runtime: Literal["podman", "docker"] = "podman"
    # The runtime's API socket: unix:///path or tcp://host:port. "" = the runtime's
    # default (podman: /run/podman/podman.sock; docker: /var/run/docker.sock).
    endpoint: str = ""
    # GPUs: "cdi" (nvidia.com/gpu=<index> per GPU; the NVIDIA Container Toolkit's CDI
    # specification), "nvidia" (Docker's GPU request), "auto": CDI on podman, and on
    # docker where its daemon has CDI spec dirs, else Docker's GPU request.
    gpus: Literal["auto", "cdi", "nvidia"] = "auto"
    ipc_host: bool = True  # --ipc=host, as the engines' docs ask; else shm_size
    shm_size: str = "16g"
    model_cache: Path | None = None  # the Hugging Face cache, mounted read-write
    model_dirs: list[Path] = Field(default_factory=list)  # mounted read-only, same path
    # Environment variables whose values are read from files (secrets such as HF_TOKEN):
    # never put on a command line or a label.
    secret_env_files: dict[str, Path] = Field(default_factory=dict)
    # ulimits for every engine container, over those the engine's docs ask for (the
    # catalog: TensorRT-LLM's memlock=-1, stack=64 MiB); -1 = unlimited.
    ulimits: dict[str, int] = Field(default_factory=dict)
    pull_timeout_s: float = Field(1800.0, gt=0)
    network: Literal["host", "publish"] = "host"  # publish: -p bind_host:port:port

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if v and not (v.startswith(("unix:///", "tcp://", "http://", "https://"))):
            raise ValueError("expected unix:///path/to.sock or tcp://host:port")
        return v

    @field_validator("shm_size")
    @classmethod
    def _size(cls, v: str) -> str:
        parse_size(v, "shm_size")
        return v

    @field_validator("ulimits")
    @classmethod
    def _ulimit_names(cls, v: dict[str, int]) -> dict[str, int]:
        known = ("core", "memlock", "nofile", "nproc", "stack")
        for name, value in v.items():
            if name not in known:
                raise ValueError(f"unknown ulimit {name!r}; known: {', '.join(known)}")
            if value < -1:
                raise ValueError(f"ulimit {name}: {value} (give -1 for unlimited)")
        return v

    @field_validator("secret_env_files")
    @classmethod
    def _env_names(cls, v: dict[str, Path]) -> dict[str, Path]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"{name!r} is not an environment variable name")
        return v

    @property
    def socket_url(self) -> str:
        if self.endpoint:
            return self.endpoint
        return ("unix:///run/podman/podman.sock" if self.runtime == "podman"
                else "unix:///var/run/docker.sock")


def parse_size(text: str, what: str) -> int:
    """Bytes of "16g", "512m", "1024" (k, m, g, t: powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([kmgtKMGT]?)[bB]?\s*", text)
    if not m:
        raise ValueError(f"{what}: expected a size such as 16g or 512m, found {text!r}")
    return int(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " ")


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
    containers: ContainersConfig | None = None  # needed by engines that have an image
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
    def _containers(self) -> AgentConfig:
        imaged = sorted(n for n, e in self.engines.items() if e.image)
        if imaged and self.containers is None:
            raise ValueError(f"engines {', '.join(imaged)} run from images: give a "
                             "'containers' block (e.g. containers: {runtime: podman})")
        for name in imaged:
            if self.engines[name].executable or self.engines[name].build_executable:
                raise ValueError(f"engines.{name}: give image or executable, not both")
        return self

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


def _format_error(source: str, err: ValidationError, origins: Mapping[str, str]) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        found = e.get("input")
        origin = origins.get(str(e["loc"][0])) if e["loc"] else None
        note = f" (from {origin}, not in {source})" if origin else ""
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: {path}: unknown key{note}")
        elif not path:  # a rule across fields: the message names them
            elsewhere = "; ".join(f"{k} from {v}" for k, v in sorted(origins.items()))
            lines.append(f"{source}: {e['msg'].removeprefix('Value error, ')}"
                         + (f" ({elsewhere}: not in {source})" if elsewhere else ""))
        else:
            msg = e["msg"].removeprefix("Value error, ").removeprefix(f"{path}: ")
            if f"found {found!r}" not in msg:  # a message that names the value already
                msg += f"; found {found!r}"
            lines.append(f"{source}: {path}: {msg}{note}")
    return "invalid agent config:\n  " + "\n  ".join(lines)


def parse_agent_config(data: Any, source: str = "<agent config>",
                       origins: Mapping[str, str] | None = None) -> AgentConfig:
    """The validated config; `origins` names where top-level keys came from when not from
    `source` (e.g. {"tls": "$GEARSHIFT_TLS_CA"}), for the errors to say so."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, found {type(data).__name__}")
    try:
        cfg = AgentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(source, err, origins or {})) from None
    ids = [d.deployment_id for d in cfg.deployments]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"{source}: deployments: duplicate deployment_id {', '.join(dupes)}")
    return cfg


def load_agent_config(path: Path | None, overrides: dict[str, Any] | None = None,
                      defaults: dict[str, Any] | None = None, *,
                      origins: Mapping[str, str] | None = None) -> AgentConfig:
    """The config file, `overrides` (CLI flags) winning over it, it over `defaults`.

    Relative paths in the file are taken from the file's directory; those of `overrides`
    and `defaults` are left as given (relative to the current directory). `origins` names
    the source of override and default keys that are not flags (e.g. {"tls":
    "$GEARSHIFT_TLS_CA"}); an error about a key that was taken from one names it."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        loaded = _load_yaml(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, found {type(loaded).__name__}")
        data = resolve_relative_paths(dict(loaded or {}), path.absolute().parent)
    used: dict[str, str] = {}
    for k, v in (defaults or {}).items():
        if v is not None and k not in data:
            data[k] = v
            if origins and k in origins:
                used[k] = origins[k]
    for k, v in (overrides or {}).items():
        if v is not None:
            data[k] = v
            if origins and k in origins:
                used[k] = origins[k]
    return parse_agent_config(data, source, used)


def resolve_relative_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """`data` (a config file's mapping, before validation) with every relative value of a
    `Path` field of the schema, nested ones included, taken from `base`. Values of the
    wrong type are left for validation to refuse."""
    return _resolve_model(AgentConfig, data, base)


def _resolve_model(model: type[BaseModel], data: Any, base: Path) -> Any:
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, field in model.model_fields.items():
        if name in out:
            out[name] = _resolve_value(field.annotation, out[name], base)
    return out


def _resolve_value(annotation: Any, value: Any, base: Path) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):  # X | None
        for arg in args:
            value = _resolve_value(arg, value, base)
        return value
    if annotation is Path:
        if isinstance(value, str) and value and not Path(value).is_absolute():
            return os.path.normpath(base / value)
        return value
    if origin is list and args and isinstance(value, list):
        return [_resolve_value(args[0], v, base) for v in value]
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        return {k: _resolve_value(args[1], v, base) for k, v in value.items()}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _resolve_model(annotation, value, base)
    return value


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
