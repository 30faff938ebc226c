import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from gearshift.v1 import agent_pb2 as _agent_pb2
from gearshift.v1 import enrol_pb2 as _enrol_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HostState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HOST_STATE_UNSPECIFIED: _ClassVar[HostState]
    HOST_STATE_CONNECTED: _ClassVar[HostState]
    HOST_STATE_UNREACHABLE: _ClassVar[HostState]
    HOST_STATE_DISCONNECTED: _ClassVar[HostState]
    HOST_STATE_JOINING: _ClassVar[HostState]
HOST_STATE_UNSPECIFIED: HostState
HOST_STATE_CONNECTED: HostState
HOST_STATE_UNREACHABLE: HostState
HOST_STATE_DISCONNECTED: HostState
HOST_STATE_JOINING: HostState

class Host(_message.Message):
    __slots__ = ("host_id", "labels", "agent_version", "state", "last_report", "gpus", "engines", "deployments", "emulated_gpus", "reports")
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
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    EMULATED_GPUS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    labels: _containers.ScalarMap[str, str]
    agent_version: str
    state: HostState
    last_report: _timestamp_pb2.Timestamp
    gpus: _containers.RepeatedCompositeFieldContainer[_agent_pb2.GpuInfo]
    engines: _containers.RepeatedCompositeFieldContainer[_agent_pb2.EngineInstall]
    deployments: int
    emulated_gpus: bool
    reports: int
    def __init__(self, host_id: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., agent_version: _Optional[str] = ..., state: _Optional[_Union[HostState, str]] = ..., last_report: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[_agent_pb2.GpuInfo, _Mapping]]] = ..., engines: _Optional[_Iterable[_Union[_agent_pb2.EngineInstall, _Mapping]]] = ..., deployments: _Optional[int] = ..., emulated_gpus: _Optional[bool] = ..., reports: _Optional[int] = ...) -> None: ...

class Deployment(_message.Message):
    __slots__ = ("host_id", "report", "updated")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    report: _agent_pb2.DeploymentReport
    updated: _timestamp_pb2.Timestamp
    def __init__(self, host_id: _Optional[str] = ..., report: _Optional[_Union[_agent_pb2.DeploymentReport, _Mapping]] = ..., updated: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ModelSummary(_message.Message):
    __slots__ = ("model", "engines", "deployments", "ready", "request_rate", "ttft_p99_s", "itl_p99_s", "latency_present", "revisions")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_RATE_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_S_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    REVISIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    engines: _containers.RepeatedScalarFieldContainer[str]
    deployments: int
    ready: int
    request_rate: float
    ttft_p99_s: float
    itl_p99_s: float
    latency_present: bool
    revisions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., engines: _Optional[_Iterable[str]] = ..., deployments: _Optional[int] = ..., ready: _Optional[int] = ..., request_rate: _Optional[float] = ..., ttft_p99_s: _Optional[float] = ..., itl_p99_s: _Optional[float] = ..., latency_present: _Optional[bool] = ..., revisions: _Optional[_Iterable[str]] = ...) -> None: ...

class ListHostsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListHostsResponse(_message.Message):
    __slots__ = ("hosts", "next_page_token")
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[Host]
    next_page_token: str
    def __init__(self, hosts: _Optional[_Iterable[_Union[Host, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListDeploymentsRequest(_message.Message):
    __slots__ = ("model", "host_id", "page_size", "page_token")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    host_id: str
    page_size: int
    page_token: str
    def __init__(self, model: _Optional[str] = ..., host_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListDeploymentsResponse(_message.Message):
    __slots__ = ("deployments", "next_page_token")
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    deployments: _containers.RepeatedCompositeFieldContainer[Deployment]
    next_page_token: str
    def __init__(self, deployments: _Optional[_Iterable[_Union[Deployment, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "next_page_token")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelSummary]
    next_page_token: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class FleetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FleetStatusResponse(_message.Message):
    __slots__ = ("controller_id", "epoch", "store", "hosts", "hosts_connected", "hosts_unreachable", "gpus", "deployments", "deployments_ready", "models", "request_rate", "reports_total", "started", "paused")
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    HOSTS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    HOSTS_UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_READY_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_RATE_FIELD_NUMBER: _ClassVar[int]
    REPORTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    controller_id: str
    epoch: int
    store: str
    hosts: int
    hosts_connected: int
    hosts_unreachable: int
    gpus: int
    deployments: int
    deployments_ready: int
    models: int
    request_rate: float
    reports_total: int
    started: _timestamp_pb2.Timestamp
    paused: bool
    def __init__(self, controller_id: _Optional[str] = ..., epoch: _Optional[int] = ..., store: _Optional[str] = ..., hosts: _Optional[int] = ..., hosts_connected: _Optional[int] = ..., hosts_unreachable: _Optional[int] = ..., gpus: _Optional[int] = ..., deployments: _Optional[int] = ..., deployments_ready: _Optional[int] = ..., models: _Optional[int] = ..., request_rate: _Optional[float] = ..., reports_total: _Optional[int] = ..., started: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., paused: _Optional[bool] = ...) -> None: ...

class RouteEndpoint(_message.Message):
    __slots__ = ("deployment_id", "host_id", "endpoint", "engine", "weight", "leaving", "served_model_name")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    host_id: str
    endpoint: str
    engine: str
    weight: float
    leaving: bool
    served_model_name: str
    def __init__(self, deployment_id: _Optional[str] = ..., host_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., engine: _Optional[str] = ..., weight: _Optional[float] = ..., leaving: _Optional[bool] = ..., served_model_name: _Optional[str] = ...) -> None: ...

class ModelRoute(_message.Message):
    __slots__ = ("model", "endpoints")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    endpoints: _containers.RepeatedCompositeFieldContainer[RouteEndpoint]
    def __init__(self, model: _Optional[str] = ..., endpoints: _Optional[_Iterable[_Union[RouteEndpoint, _Mapping]]] = ...) -> None: ...

class RoutingTable(_message.Message):
    __slots__ = ("version", "generated", "models", "part", "parts")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    generated: _timestamp_pb2.Timestamp
    models: _containers.RepeatedCompositeFieldContainer[ModelRoute]
    part: int
    parts: int
    def __init__(self, version: _Optional[int] = ..., generated: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., models: _Optional[_Iterable[_Union[ModelRoute, _Mapping]]] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ...) -> None: ...

class WatchRoutesRequest(_message.Message):
    __slots__ = ("gateway_id",)
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    def __init__(self, gateway_id: _Optional[str] = ...) -> None: ...

class GatewayDeploymentStats(_message.Message):
    __slots__ = ("deployment_id", "in_flight", "requests_total", "errors_total")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    in_flight: int
    requests_total: int
    errors_total: int
    def __init__(self, deployment_id: _Optional[str] = ..., in_flight: _Optional[int] = ..., requests_total: _Optional[int] = ..., errors_total: _Optional[int] = ...) -> None: ...

class GatewayReport(_message.Message):
    __slots__ = ("gateway_id", "deployments")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    deployments: _containers.RepeatedCompositeFieldContainer[GatewayDeploymentStats]
    def __init__(self, gateway_id: _Optional[str] = ..., deployments: _Optional[_Iterable[_Union[GatewayDeploymentStats, _Mapping]]] = ...) -> None: ...

class GatewayReportAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyVersion(_message.Message):
    __slots__ = ("version", "name", "digest", "yaml_text", "applied_at", "applied_by", "comment", "active", "mode")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    YAML_TEXT_FIELD_NUMBER: _ClassVar[int]
    APPLIED_AT_FIELD_NUMBER: _ClassVar[int]
    APPLIED_BY_FIELD_NUMBER: _ClassVar[int]
    COMMENT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    version: int
    name: str
    digest: str
    yaml_text: str
    applied_at: _timestamp_pb2.Timestamp
    applied_by: str
    comment: str
    active: bool
    mode: str
    def __init__(self, version: _Optional[int] = ..., name: _Optional[str] = ..., digest: _Optional[str] = ..., yaml_text: _Optional[str] = ..., applied_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., applied_by: _Optional[str] = ..., comment: _Optional[str] = ..., active: _Optional[bool] = ..., mode: _Optional[str] = ...) -> None: ...

class ValidatePolicyRequest(_message.Message):
    __slots__ = ("yaml_text", "source", "strict")
    YAML_TEXT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    yaml_text: str
    source: str
    strict: bool
    def __init__(self, yaml_text: _Optional[str] = ..., source: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ValidatePolicyResponse(_message.Message):
    __slots__ = ("valid", "errors", "name", "digest", "warnings")
    VALID_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    errors: _containers.RepeatedScalarFieldContainer[str]
    name: str
    digest: str
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, valid: _Optional[bool] = ..., errors: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ..., digest: _Optional[str] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class ApplyPolicyRequest(_message.Message):
    __slots__ = ("yaml_text", "source", "applied_by", "comment", "restore_version", "strict")
    YAML_TEXT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_BY_FIELD_NUMBER: _ClassVar[int]
    COMMENT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    yaml_text: str
    source: str
    applied_by: str
    comment: str
    restore_version: int
    strict: bool
    def __init__(self, yaml_text: _Optional[str] = ..., source: _Optional[str] = ..., applied_by: _Optional[str] = ..., comment: _Optional[str] = ..., restore_version: _Optional[int] = ..., strict: _Optional[bool] = ...) -> None: ...

class ApplyPolicyResponse(_message.Message):
    __slots__ = ("policy", "changed", "warnings")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    policy: PolicyVersion
    changed: bool
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, policy: _Optional[_Union[PolicyVersion, _Mapping]] = ..., changed: _Optional[bool] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class PolicyHistoryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyHistoryResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[PolicyVersion]
    def __init__(self, versions: _Optional[_Iterable[_Union[PolicyVersion, _Mapping]]] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("id", "created_at", "model", "from_engine", "to_engine", "rule", "inputs", "expected", "alternatives", "policy_version", "mode", "status", "status_reason", "updated_at", "conditions", "reason", "trial_share")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FROM_ENGINE_FIELD_NUMBER: _ClassVar[int]
    TO_ENGINE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_REASON_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRIAL_SHARE_FIELD_NUMBER: _ClassVar[int]
    id: str
    created_at: _timestamp_pb2.Timestamp
    model: str
    from_engine: str
    to_engine: str
    rule: str
    inputs: _struct_pb2.Struct
    expected: _struct_pb2.Struct
    alternatives: _struct_pb2.ListValue
    policy_version: int
    mode: str
    status: str
    status_reason: str
    updated_at: _timestamp_pb2.Timestamp
    conditions: _containers.RepeatedCompositeFieldContainer[DecisionCondition]
    reason: str
    trial_share: float
    def __init__(self, id: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., model: _Optional[str] = ..., from_engine: _Optional[str] = ..., to_engine: _Optional[str] = ..., rule: _Optional[str] = ..., inputs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., expected: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., alternatives: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., policy_version: _Optional[int] = ..., mode: _Optional[str] = ..., status: _Optional[str] = ..., status_reason: _Optional[str] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., conditions: _Optional[_Iterable[_Union[DecisionCondition, _Mapping]]] = ..., reason: _Optional[str] = ..., trial_share: _Optional[float] = ...) -> None: ...

class DecisionCondition(_message.Message):
    __slots__ = ("rule", "signal", "operator", "threshold", "observed", "unit", "held", "group")
    RULE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    rule: str
    signal: str
    operator: str
    threshold: _struct_pb2.Value
    observed: _struct_pb2.Value
    unit: str
    held: bool
    group: str
    def __init__(self, rule: _Optional[str] = ..., signal: _Optional[str] = ..., operator: _Optional[str] = ..., threshold: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., observed: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., unit: _Optional[str] = ..., held: _Optional[bool] = ..., group: _Optional[str] = ...) -> None: ...

class ListDecisionsRequest(_message.Message):
    __slots__ = ("model", "status", "limit")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    model: str
    status: str
    limit: int
    def __init__(self, model: _Optional[str] = ..., status: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ListDecisionsResponse(_message.Message):
    __slots__ = ("decisions",)
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    def __init__(self, decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ...) -> None: ...

class GetDecisionRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ReviewDecisionRequest(_message.Message):
    __slots__ = ("id", "reason", "by")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    id: str
    reason: str
    by: str
    def __init__(self, id: _Optional[str] = ..., reason: _Optional[str] = ..., by: _Optional[str] = ...) -> None: ...

class SetPausedRequest(_message.Message):
    __slots__ = ("paused", "reason")
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    reason: str
    def __init__(self, paused: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class SetPausedResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...

class MigrationStep(_message.Message):
    __slots__ = ("at", "from_phase", "to_phase", "message", "figures")
    AT_FIELD_NUMBER: _ClassVar[int]
    FROM_PHASE_FIELD_NUMBER: _ClassVar[int]
    TO_PHASE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    at: _timestamp_pb2.Timestamp
    from_phase: str
    to_phase: str
    message: str
    figures: _struct_pb2.Struct
    def __init__(self, at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., from_phase: _Optional[str] = ..., to_phase: _Optional[str] = ..., message: _Optional[str] = ..., figures: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Migration(_message.Message):
    __slots__ = ("id", "decision_id", "model", "from_engine", "to_engine", "kind", "phase", "canary_step", "canary_steps", "reason", "status_message", "source_deployments", "target_deployments", "created_at", "updated_at", "finished_at", "steps", "target_revision", "trial_outcome")
    ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FROM_ENGINE_FIELD_NUMBER: _ClassVar[int]
    TO_ENGINE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CANARY_STEP_FIELD_NUMBER: _ClassVar[int]
    CANARY_STEPS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    TARGET_DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TARGET_REVISION_FIELD_NUMBER: _ClassVar[int]
    TRIAL_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    id: str
    decision_id: str
    model: str
    from_engine: str
    to_engine: str
    kind: str
    phase: str
    canary_step: int
    canary_steps: _containers.RepeatedScalarFieldContainer[float]
    reason: str
    status_message: str
    source_deployments: _containers.RepeatedScalarFieldContainer[str]
    target_deployments: _containers.RepeatedScalarFieldContainer[str]
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    steps: _containers.RepeatedCompositeFieldContainer[MigrationStep]
    target_revision: str
    trial_outcome: str
    def __init__(self, id: _Optional[str] = ..., decision_id: _Optional[str] = ..., model: _Optional[str] = ..., from_engine: _Optional[str] = ..., to_engine: _Optional[str] = ..., kind: _Optional[str] = ..., phase: _Optional[str] = ..., canary_step: _Optional[int] = ..., canary_steps: _Optional[_Iterable[float]] = ..., reason: _Optional[str] = ..., status_message: _Optional[str] = ..., source_deployments: _Optional[_Iterable[str]] = ..., target_deployments: _Optional[_Iterable[str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[MigrationStep, _Mapping]]] = ..., target_revision: _Optional[str] = ..., trial_outcome: _Optional[str] = ...) -> None: ...

class ListMigrationsRequest(_message.Message):
    __slots__ = ("active_only", "model")
    ACTIVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    active_only: bool
    model: str
    def __init__(self, active_only: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class ListMigrationsResponse(_message.Message):
    __slots__ = ("migrations",)
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    migrations: _containers.RepeatedCompositeFieldContainer[Migration]
    def __init__(self, migrations: _Optional[_Iterable[_Union[Migration, _Mapping]]] = ...) -> None: ...

class GetMigrationRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class AbortMigrationRequest(_message.Message):
    __slots__ = ("id", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    reason: str
    def __init__(self, id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PublishRevisionRequest(_message.Message):
    __slots__ = ("model", "revision", "source")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    source: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class PublishRevisionResponse(_message.Message):
    __slots__ = ("migration", "message")
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    migration: Migration
    message: str
    def __init__(self, migration: _Optional[_Union[Migration, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class GetCapacityRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetCapacityResponse(_message.Message):
    __slots__ = ("models_json", "sla_ttft_p99_s", "sla_itl_p99_s", "priors_json")
    MODELS_JSON_FIELD_NUMBER: _ClassVar[int]
    SLA_TTFT_P99_S_FIELD_NUMBER: _ClassVar[int]
    SLA_ITL_P99_S_FIELD_NUMBER: _ClassVar[int]
    PRIORS_JSON_FIELD_NUMBER: _ClassVar[int]
    models_json: _containers.RepeatedScalarFieldContainer[str]
    sla_ttft_p99_s: float
    sla_itl_p99_s: float
    priors_json: str
    def __init__(self, models_json: _Optional[_Iterable[str]] = ..., sla_ttft_p99_s: _Optional[float] = ..., sla_itl_p99_s: _Optional[float] = ..., priors_json: _Optional[str] = ...) -> None: ...

class GetRateHistoryRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetRateHistoryResponse(_message.Message):
    __slots__ = ("ts", "rps", "resolution_s")
    TS_FIELD_NUMBER: _ClassVar[int]
    RPS_FIELD_NUMBER: _ClassVar[int]
    RESOLUTION_S_FIELD_NUMBER: _ClassVar[int]
    ts: _containers.RepeatedScalarFieldContainer[float]
    rps: _containers.RepeatedScalarFieldContainer[float]
    resolution_s: float
    def __init__(self, ts: _Optional[_Iterable[float]] = ..., rps: _Optional[_Iterable[float]] = ..., resolution_s: _Optional[float] = ...) -> None: ...

class ControllerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControllerStatusResponse(_message.Message):
    __slots__ = ("controller_id", "address", "leader", "leader_id", "leader_address", "epoch", "lease_age_s", "lease_expires_in_s", "leader_for_s", "lease_ttl_s", "ha", "store", "error")
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    LEADER_FOR_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    HA_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    controller_id: str
    address: str
    leader: bool
    leader_id: str
    leader_address: str
    epoch: int
    lease_age_s: float
    lease_expires_in_s: float
    leader_for_s: float
    lease_ttl_s: float
    ha: bool
    store: str
    error: str
    def __init__(self, controller_id: _Optional[str] = ..., address: _Optional[str] = ..., leader: _Optional[bool] = ..., leader_id: _Optional[str] = ..., leader_address: _Optional[str] = ..., epoch: _Optional[int] = ..., lease_age_s: _Optional[float] = ..., lease_expires_in_s: _Optional[float] = ..., leader_for_s: _Optional[float] = ..., lease_ttl_s: _Optional[float] = ..., ha: _Optional[bool] = ..., store: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class EvaluateNowRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvaluateNowResponse(_message.Message):
    __slots__ = ("decisions", "message", "no_decision")
    class NoDecision(_message.Message):
        __slots__ = ("model", "reason", "detail", "until")
        MODEL_FIELD_NUMBER: _ClassVar[int]
        REASON_FIELD_NUMBER: _ClassVar[int]
        DETAIL_FIELD_NUMBER: _ClassVar[int]
        UNTIL_FIELD_NUMBER: _ClassVar[int]
        model: str
        reason: str
        detail: str
        until: _timestamp_pb2.Timestamp
        def __init__(self, model: _Optional[str] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NO_DECISION_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    message: str
    no_decision: _containers.RepeatedCompositeFieldContainer[EvaluateNowResponse.NoDecision]
    def __init__(self, decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., message: _Optional[str] = ..., no_decision: _Optional[_Iterable[_Union[EvaluateNowResponse.NoDecision, _Mapping]]] = ...) -> None: ...
