import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]

class GpuHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GPU_HEALTH_UNSPECIFIED: _ClassVar[GpuHealth]
    GPU_HEALTH_OK: _ClassVar[GpuHealth]
    GPU_HEALTH_DEGRADED: _ClassVar[GpuHealth]
    GPU_HEALTH_FAILED: _ClassVar[GpuHealth]

class VersionMatch(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_MATCH_UNSPECIFIED: _ClassVar[VersionMatch]
    VERSION_MATCH_KNOWN: _ClassVar[VersionMatch]
    VERSION_MATCH_NEAREST: _ClassVar[VersionMatch]
    VERSION_MATCH_UNKNOWN: _ClassVar[VersionMatch]

class DeploymentPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEPLOYMENT_PHASE_UNSPECIFIED: _ClassVar[DeploymentPhase]
    DEPLOYMENT_PHASE_STARTING: _ClassVar[DeploymentPhase]
    DEPLOYMENT_PHASE_READY: _ClassVar[DeploymentPhase]
    DEPLOYMENT_PHASE_UNHEALTHY: _ClassVar[DeploymentPhase]
    DEPLOYMENT_PHASE_RESTARTING: _ClassVar[DeploymentPhase]
    DEPLOYMENT_PHASE_DRAINING: _ClassVar[DeploymentPhase]
    DEPLOYMENT_PHASE_STOPPED: _ClassVar[DeploymentPhase]
    DEPLOYMENT_PHASE_FAILED: _ClassVar[DeploymentPhase]
    DEPLOYMENT_PHASE_BUILDING: _ClassVar[DeploymentPhase]
    DEPLOYMENT_PHASE_PULLING: _ClassVar[DeploymentPhase]

class EngineSleepState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_SLEEP_STATE_UNSPECIFIED: _ClassVar[EngineSleepState]
    ENGINE_SLEEP_STATE_AWAKE: _ClassVar[EngineSleepState]
    ENGINE_SLEEP_STATE_WEIGHTS_OFFLOADED: _ClassVar[EngineSleepState]
    ENGINE_SLEEP_STATE_DISCARD_ALL: _ClassVar[EngineSleepState]

class CommandPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMAND_PHASE_UNSPECIFIED: _ClassVar[CommandPhase]
    COMMAND_PHASE_ACCEPTED: _ClassVar[CommandPhase]
    COMMAND_PHASE_RUNNING: _ClassVar[CommandPhase]
    COMMAND_PHASE_SUCCEEDED: _ClassVar[CommandPhase]
    COMMAND_PHASE_FAILED: _ClassVar[CommandPhase]
    COMMAND_PHASE_REJECTED: _ClassVar[CommandPhase]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion
GPU_HEALTH_UNSPECIFIED: GpuHealth
GPU_HEALTH_OK: GpuHealth
GPU_HEALTH_DEGRADED: GpuHealth
GPU_HEALTH_FAILED: GpuHealth
VERSION_MATCH_UNSPECIFIED: VersionMatch
VERSION_MATCH_KNOWN: VersionMatch
VERSION_MATCH_NEAREST: VersionMatch
VERSION_MATCH_UNKNOWN: VersionMatch
DEPLOYMENT_PHASE_UNSPECIFIED: DeploymentPhase
DEPLOYMENT_PHASE_STARTING: DeploymentPhase
DEPLOYMENT_PHASE_READY: DeploymentPhase
DEPLOYMENT_PHASE_UNHEALTHY: DeploymentPhase
DEPLOYMENT_PHASE_RESTARTING: DeploymentPhase
DEPLOYMENT_PHASE_DRAINING: DeploymentPhase
DEPLOYMENT_PHASE_STOPPED: DeploymentPhase
DEPLOYMENT_PHASE_FAILED: DeploymentPhase
DEPLOYMENT_PHASE_BUILDING: DeploymentPhase
DEPLOYMENT_PHASE_PULLING: DeploymentPhase
ENGINE_SLEEP_STATE_UNSPECIFIED: EngineSleepState
ENGINE_SLEEP_STATE_AWAKE: EngineSleepState
ENGINE_SLEEP_STATE_WEIGHTS_OFFLOADED: EngineSleepState
ENGINE_SLEEP_STATE_DISCARD_ALL: EngineSleepState
COMMAND_PHASE_UNSPECIFIED: CommandPhase
COMMAND_PHASE_ACCEPTED: CommandPhase
COMMAND_PHASE_RUNNING: CommandPhase
COMMAND_PHASE_SUCCEEDED: CommandPhase
COMMAND_PHASE_FAILED: CommandPhase
COMMAND_PHASE_REJECTED: CommandPhase

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "model", "memory_total_bytes", "memory_used_bytes", "utilization", "temperature_c", "power_w", "health", "health_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    model: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization: float
    temperature_c: float
    power_w: float
    health: GpuHealth
    health_reason: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., model: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., utilization: _Optional[float] = ..., temperature_c: _Optional[float] = ..., power_w: _Optional[float] = ..., health: _Optional[_Union[GpuHealth, str]] = ..., health_reason: _Optional[str] = ...) -> None: ...

class EngineInstall(_message.Message):
    __slots__ = ("engine", "version", "executable", "release", "version_match", "version_source", "image")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXECUTABLE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    VERSION_MATCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_SOURCE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    engine: str
    version: str
    executable: str
    release: str
    version_match: VersionMatch
    version_source: str
    image: str
    def __init__(self, engine: _Optional[str] = ..., version: _Optional[str] = ..., executable: _Optional[str] = ..., release: _Optional[str] = ..., version_match: _Optional[_Union[VersionMatch, str]] = ..., version_source: _Optional[str] = ..., image: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("host_id", "labels", "agent_version", "protocol_version", "gpus", "engines", "emulated_gpus", "session_token")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    EMULATED_GPUS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    labels: _containers.ScalarMap[str, str]
    agent_version: str
    protocol_version: ProtocolVersion
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInstall]
    emulated_gpus: bool
    session_token: str
    def __init__(self, host_id: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., agent_version: _Optional[str] = ..., protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., engines: _Optional[_Iterable[_Union[EngineInstall, _Mapping]]] = ..., emulated_gpus: _Optional[bool] = ..., session_token: _Optional[str] = ...) -> None: ...

class Quantiles(_message.Message):
    __slots__ = ("present", "p50_s", "p99_s", "mean_s", "count")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    P50_S_FIELD_NUMBER: _ClassVar[int]
    P99_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_S_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    present: bool
    p50_s: float
    p99_s: float
    mean_s: float
    count: int
    def __init__(self, present: _Optional[bool] = ..., p50_s: _Optional[float] = ..., p99_s: _Optional[float] = ..., mean_s: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class DeploymentReport(_message.Message):
    __slots__ = ("deployment_id", "engine", "engine_version", "model", "revision", "phase", "endpoint", "request_rate", "running_requests", "waiting_requests", "ttft", "itl", "e2e", "prompt_tokens_per_s", "generation_tokens_per_s", "kv_cache_usage", "errors_total", "restarts", "gpu_indices", "message", "metrics_present", "backend", "served_model_name", "source", "tensor_parallel_size", "partial_interval", "engine_release", "engine_version_match", "queue_time", "preemptions_per_s", "prefix_cache_hit_rate", "sleep_state", "mean_prompt_tokens", "mean_generation_tokens", "kv_blocks_total", "kv_blocks_used", "image", "image_digest", "pull_bytes_done", "pull_bytes_total")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_RATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TTFT_FIELD_NUMBER: _ClassVar[int]
    ITL_FIELD_NUMBER: _ClassVar[int]
    E2E_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METRICS_PRESENT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_RELEASE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_MATCH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SLEEP_STATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PULL_BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    PULL_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    engine: str
    engine_version: str
    model: str
    revision: str
    phase: DeploymentPhase
    endpoint: str
    request_rate: float
    running_requests: float
    waiting_requests: float
    ttft: Quantiles
    itl: Quantiles
    e2e: Quantiles
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    kv_cache_usage: float
    errors_total: int
    restarts: int
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    message: str
    metrics_present: bool
    backend: str
    served_model_name: str
    source: str
    tensor_parallel_size: int
    partial_interval: bool
    engine_release: str
    engine_version_match: VersionMatch
    queue_time: Quantiles
    preemptions_per_s: float
    prefix_cache_hit_rate: float
    sleep_state: EngineSleepState
    mean_prompt_tokens: float
    mean_generation_tokens: float
    kv_blocks_total: int
    kv_blocks_used: int
    image: str
    image_digest: str
    pull_bytes_done: int
    pull_bytes_total: int
    def __init__(self, deployment_id: _Optional[str] = ..., engine: _Optional[str] = ..., engine_version: _Optional[str] = ..., model: _Optional[str] = ..., revision: _Optional[str] = ..., phase: _Optional[_Union[DeploymentPhase, str]] = ..., endpoint: _Optional[str] = ..., request_rate: _Optional[float] = ..., running_requests: _Optional[float] = ..., waiting_requests: _Optional[float] = ..., ttft: _Optional[_Union[Quantiles, _Mapping]] = ..., itl: _Optional[_Union[Quantiles, _Mapping]] = ..., e2e: _Optional[_Union[Quantiles, _Mapping]] = ..., prompt_tokens_per_s: _Optional[float] = ..., generation_tokens_per_s: _Optional[float] = ..., kv_cache_usage: _Optional[float] = ..., errors_total: _Optional[int] = ..., restarts: _Optional[int] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., message: _Optional[str] = ..., metrics_present: _Optional[bool] = ..., backend: _Optional[str] = ..., served_model_name: _Optional[str] = ..., source: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., partial_interval: _Optional[bool] = ..., engine_release: _Optional[str] = ..., engine_version_match: _Optional[_Union[VersionMatch, str]] = ..., queue_time: _Optional[_Union[Quantiles, _Mapping]] = ..., preemptions_per_s: _Optional[float] = ..., prefix_cache_hit_rate: _Optional[float] = ..., sleep_state: _Optional[_Union[EngineSleepState, str]] = ..., mean_prompt_tokens: _Optional[float] = ..., mean_generation_tokens: _Optional[float] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., image: _Optional[str] = ..., image_digest: _Optional[str] = ..., pull_bytes_done: _Optional[int] = ..., pull_bytes_total: _Optional[int] = ...) -> None: ...

class Report(_message.Message):
    __slots__ = ("seq", "time", "gpus", "deployments", "interval_s")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: _timestamp_pb2.Timestamp
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    deployments: _containers.RepeatedCompositeFieldContainer[DeploymentReport]
    interval_s: float
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., deployments: _Optional[_Iterable[_Union[DeploymentReport, _Mapping]]] = ..., interval_s: _Optional[float] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("command_id", "phase", "progress", "message")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    phase: CommandPhase
    progress: float
    message: str
    def __init__(self, command_id: _Optional[str] = ..., phase: _Optional[_Union[CommandPhase, str]] = ..., progress: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("hello", "report", "command_result")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    COMMAND_RESULT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    report: Report
    command_result: CommandResult
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., report: _Optional[_Union[Report, _Mapping]] = ..., command_result: _Optional[_Union[CommandResult, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("report_interval_s", "controller_epoch", "controller_id", "session_token")
    REPORT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    report_interval_s: float
    controller_epoch: int
    controller_id: str
    session_token: str
    def __init__(self, report_interval_s: _Optional[float] = ..., controller_epoch: _Optional[int] = ..., controller_id: _Optional[str] = ..., session_token: _Optional[str] = ...) -> None: ...

class DeploymentSpec(_message.Message):
    __slots__ = ("deployment_id", "model", "source", "revision", "engine", "backend", "port", "tensor_parallel_size", "gpu_memory_fraction", "gpu_indices", "shutdown_timeout_s", "extra_args", "engine_version")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    EXTRA_ARGS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    model: str
    source: str
    revision: str
    engine: str
    backend: str
    port: int
    tensor_parallel_size: int
    gpu_memory_fraction: float
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    shutdown_timeout_s: float
    extra_args: _containers.RepeatedScalarFieldContainer[str]
    engine_version: str
    def __init__(self, deployment_id: _Optional[str] = ..., model: _Optional[str] = ..., source: _Optional[str] = ..., revision: _Optional[str] = ..., engine: _Optional[str] = ..., backend: _Optional[str] = ..., port: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., gpu_memory_fraction: _Optional[float] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., shutdown_timeout_s: _Optional[float] = ..., extra_args: _Optional[_Iterable[str]] = ..., engine_version: _Optional[str] = ...) -> None: ...

class StartDeployment(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: DeploymentSpec
    def __init__(self, spec: _Optional[_Union[DeploymentSpec, _Mapping]] = ...) -> None: ...

class DrainDeployment(_message.Message):
    __slots__ = ("deployment_id", "grace_s")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    grace_s: float
    def __init__(self, deployment_id: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...

class StopDeployment(_message.Message):
    __slots__ = ("deployment_id", "grace_s")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    grace_s: float
    def __init__(self, deployment_id: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...

class BuildEngine(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: DeploymentSpec
    def __init__(self, spec: _Optional[_Union[DeploymentSpec, _Mapping]] = ...) -> None: ...

class PrepareDeployment(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: DeploymentSpec
    def __init__(self, spec: _Optional[_Union[DeploymentSpec, _Mapping]] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("command_id", "epoch", "start", "drain", "stop", "build", "prepare")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    epoch: int
    start: StartDeployment
    drain: DrainDeployment
    stop: StopDeployment
    build: BuildEngine
    prepare: PrepareDeployment
    def __init__(self, command_id: _Optional[str] = ..., epoch: _Optional[int] = ..., start: _Optional[_Union[StartDeployment, _Mapping]] = ..., drain: _Optional[_Union[DrainDeployment, _Mapping]] = ..., stop: _Optional[_Union[StopDeployment, _Mapping]] = ..., build: _Optional[_Union[BuildEngine, _Mapping]] = ..., prepare: _Optional[_Union[PrepareDeployment, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("welcome", "command", "ack")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    command: Command
    ack: Ack
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ...) -> None: ...
