import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EnrolStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENROL_STATUS_UNSPECIFIED: _ClassVar[EnrolStatus]
    ENROL_STATUS_ISSUED: _ClassVar[EnrolStatus]
    ENROL_STATUS_PENDING: _ClassVar[EnrolStatus]

class EnrolmentState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENROLMENT_STATE_UNSPECIFIED: _ClassVar[EnrolmentState]
    ENROLMENT_STATE_PENDING: _ClassVar[EnrolmentState]
    ENROLMENT_STATE_APPROVED: _ClassVar[EnrolmentState]
    ENROLMENT_STATE_REVOKED: _ClassVar[EnrolmentState]
    ENROLMENT_STATE_RESET: _ClassVar[EnrolmentState]
ENROL_STATUS_UNSPECIFIED: EnrolStatus
ENROL_STATUS_ISSUED: EnrolStatus
ENROL_STATUS_PENDING: EnrolStatus
ENROLMENT_STATE_UNSPECIFIED: EnrolmentState
ENROLMENT_STATE_PENDING: EnrolmentState
ENROLMENT_STATE_APPROVED: EnrolmentState
ENROLMENT_STATE_REVOKED: EnrolmentState
ENROLMENT_STATE_RESET: EnrolmentState

class EnrolRequest(_message.Message):
    __slots__ = ("bootstrap_token", "csr_pem")
    BOOTSTRAP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    bootstrap_token: str
    csr_pem: bytes
    def __init__(self, bootstrap_token: _Optional[str] = ..., csr_pem: _Optional[bytes] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("csr_pem",)
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    csr_pem: bytes
    def __init__(self, csr_pem: _Optional[bytes] = ...) -> None: ...

class EnrolResponse(_message.Message):
    __slots__ = ("status", "certificate_pem", "message", "retry_after_s", "not_after")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_FIELD_NUMBER: _ClassVar[int]
    status: EnrolStatus
    certificate_pem: bytes
    message: str
    retry_after_s: float
    not_after: _timestamp_pb2.Timestamp
    def __init__(self, status: _Optional[_Union[EnrolStatus, str]] = ..., certificate_pem: _Optional[bytes] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., not_after: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class BootstrapToken(_message.Message):
    __slots__ = ("token_id", "host_pattern", "expires", "one_time", "auto_approve", "description", "created", "uses", "revoked", "used_by")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_PATTERN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_FIELD_NUMBER: _ClassVar[int]
    ONE_TIME_FIELD_NUMBER: _ClassVar[int]
    AUTO_APPROVE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    USED_BY_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    host_pattern: str
    expires: _timestamp_pb2.Timestamp
    one_time: bool
    auto_approve: bool
    description: str
    created: _timestamp_pb2.Timestamp
    uses: int
    revoked: bool
    used_by: str
    def __init__(self, token_id: _Optional[str] = ..., host_pattern: _Optional[str] = ..., expires: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., one_time: _Optional[bool] = ..., auto_approve: _Optional[bool] = ..., description: _Optional[str] = ..., created: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., uses: _Optional[int] = ..., revoked: _Optional[bool] = ..., used_by: _Optional[str] = ...) -> None: ...

class CreateBootstrapTokenRequest(_message.Message):
    __slots__ = ("host_pattern", "ttl_s", "one_time", "auto_approve", "description")
    HOST_PATTERN_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ONE_TIME_FIELD_NUMBER: _ClassVar[int]
    AUTO_APPROVE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    host_pattern: str
    ttl_s: float
    one_time: bool
    auto_approve: bool
    description: str
    def __init__(self, host_pattern: _Optional[str] = ..., ttl_s: _Optional[float] = ..., one_time: _Optional[bool] = ..., auto_approve: _Optional[bool] = ..., description: _Optional[str] = ...) -> None: ...

class CreateBootstrapTokenResponse(_message.Message):
    __slots__ = ("token", "secret_token")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SECRET_TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: BootstrapToken
    secret_token: str
    def __init__(self, token: _Optional[_Union[BootstrapToken, _Mapping]] = ..., secret_token: _Optional[str] = ...) -> None: ...

class ListBootstrapTokensRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBootstrapTokensResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[BootstrapToken]
    def __init__(self, tokens: _Optional[_Iterable[_Union[BootstrapToken, _Mapping]]] = ...) -> None: ...

class RevokeBootstrapTokenRequest(_message.Message):
    __slots__ = ("token_id",)
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    def __init__(self, token_id: _Optional[str] = ...) -> None: ...

class HostEnrolment(_message.Message):
    __slots__ = ("host_id", "state", "token_id", "requested", "changed", "cert_not_after", "key_fingerprint", "note")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    CERT_NOT_AFTER_FIELD_NUMBER: _ClassVar[int]
    KEY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    state: EnrolmentState
    token_id: str
    requested: _timestamp_pb2.Timestamp
    changed: _timestamp_pb2.Timestamp
    cert_not_after: _timestamp_pb2.Timestamp
    key_fingerprint: str
    note: str
    def __init__(self, host_id: _Optional[str] = ..., state: _Optional[_Union[EnrolmentState, str]] = ..., token_id: _Optional[str] = ..., requested: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., changed: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., cert_not_after: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., key_fingerprint: _Optional[str] = ..., note: _Optional[str] = ...) -> None: ...

class ListEnrolmentsRequest(_message.Message):
    __slots__ = ("pending_only",)
    PENDING_ONLY_FIELD_NUMBER: _ClassVar[int]
    pending_only: bool
    def __init__(self, pending_only: _Optional[bool] = ...) -> None: ...

class ListEnrolmentsResponse(_message.Message):
    __slots__ = ("hosts",)
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[HostEnrolment]
    def __init__(self, hosts: _Optional[_Iterable[_Union[HostEnrolment, _Mapping]]] = ...) -> None: ...

class HostActionRequest(_message.Message):
    __slots__ = ("host_id", "reason")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    reason: str
    def __init__(self, host_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
