from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[Code]
    PROTOCOL_ERROR: _ClassVar[Code]
    PERMISSION_DENIED: _ClassVar[Code]
    NOT_FOUND: _ClassVar[Code]
    LIMIT_EXCEEDED: _ClassVar[Code]
    SHUTTING_DOWN: _ClassVar[Code]
    TIMEOUT: _ClassVar[Code]
    INTERNAL: _ClassVar[Code]
    UNSUPPORTED_PROTOCOL: _ClassVar[Code]
    JOB_ERROR: _ClassVar[Code]
    INVALID_REQUEST: _ClassVar[Code]
    CANCELLED: _ClassVar[Code]
    INCOMPLETE_RESTORE: _ClassVar[Code]
    BACKEND_ERROR: _ClassVar[Code]
    UNMAPPED_RANGE: _ClassVar[Code]
    TARGET_TOO_SMALL: _ClassVar[Code]
    BAD_DESCRIPTOR: _ClassVar[Code]
    BACKEND_UNAVAILABLE: _ClassVar[Code]
    IMAGE_ERROR: _ClassVar[Code]
    MANIFEST_MISSING: _ClassVar[Code]
    UNSUPPORTED_VERSION: _ClassVar[Code]
    CORRUPT_MANIFEST: _ClassVar[Code]
    CORRUPT_CHUNK: _ClassVar[Code]
    TRUNCATED_DATA: _ClassVar[Code]
    FOREIGN_DATA_FILE: _ClassVar[Code]
    NO_SPACE: _ClassVar[Code]
    READ_ONLY_FS: _ClassVar[Code]
    IO_ERROR: _ClassVar[Code]
    NOT_WRITABLE: _ClassVar[Code]
    PARENT_MISSING: _ClassVar[Code]
    PARENT_MISMATCH: _ClassVar[Code]
    TOPOLOGY_ERROR: _ClassVar[Code]
    TOPOLOGY_MISMATCH: _ClassVar[Code]
    VRAMD_ERROR: _ClassVar[Code]

class SessionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_KIND_UNSPECIFIED: _ClassVar[SessionKind]
    SESSION_DUMP: _ClassVar[SessionKind]
    SESSION_RESTORE: _ClassVar[SessionKind]
    SESSION_VERIFY: _ClassVar[SessionKind]

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_OPEN: _ClassVar[SessionState]
    SESSION_SEALED: _ClassVar[SessionState]
    SESSION_DONE: _ClassVar[SessionState]
    SESSION_FAILED: _ClassVar[SessionState]
    SESSION_CANCELLED: _ClassVar[SessionState]
    SESSION_CANCELLING: _ClassVar[SessionState]
OK: Code
PROTOCOL_ERROR: Code
PERMISSION_DENIED: Code
NOT_FOUND: Code
LIMIT_EXCEEDED: Code
SHUTTING_DOWN: Code
TIMEOUT: Code
INTERNAL: Code
UNSUPPORTED_PROTOCOL: Code
JOB_ERROR: Code
INVALID_REQUEST: Code
CANCELLED: Code
INCOMPLETE_RESTORE: Code
BACKEND_ERROR: Code
UNMAPPED_RANGE: Code
TARGET_TOO_SMALL: Code
BAD_DESCRIPTOR: Code
BACKEND_UNAVAILABLE: Code
IMAGE_ERROR: Code
MANIFEST_MISSING: Code
UNSUPPORTED_VERSION: Code
CORRUPT_MANIFEST: Code
CORRUPT_CHUNK: Code
TRUNCATED_DATA: Code
FOREIGN_DATA_FILE: Code
NO_SPACE: Code
READ_ONLY_FS: Code
IO_ERROR: Code
NOT_WRITABLE: Code
PARENT_MISSING: Code
PARENT_MISMATCH: Code
TOPOLOGY_ERROR: Code
TOPOLOGY_MISMATCH: Code
VRAMD_ERROR: Code
SESSION_KIND_UNSPECIFIED: SessionKind
SESSION_DUMP: SessionKind
SESSION_RESTORE: SessionKind
SESSION_VERIFY: SessionKind
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_OPEN: SessionState
SESSION_SEALED: SessionState
SESSION_DONE: SessionState
SESSION_FAILED: SessionState
SESSION_CANCELLED: SessionState
SESSION_CANCELLING: SessionState

class Error(_message.Message):
    __slots__ = ("code", "message", "bo_id", "offset")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BO_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    code: Code
    message: str
    bo_id: int
    offset: int
    def __init__(self, code: _Optional[_Union[Code, str]] = ..., message: _Optional[str] = ..., bo_id: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "hello", "open_session", "add_bos", "start", "get_progress", "wait", "cancel", "close_session", "get_status", "list_sessions", "attach_files")
    ID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSION_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    GET_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    CLOSE_SESSION_FIELD_NUMBER: _ClassVar[int]
    GET_STATUS_FIELD_NUMBER: _ClassVar[int]
    LIST_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FILES_FIELD_NUMBER: _ClassVar[int]
    id: int
    hello: Hello
    open_session: OpenSession
    add_bos: AddBos
    start: Start
    get_progress: GetProgress
    wait: Wait
    cancel: Cancel
    close_session: CloseSession
    get_status: GetStatus
    list_sessions: ListSessions
    attach_files: AttachFiles
    def __init__(self, id: _Optional[int] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., open_session: _Optional[_Union[OpenSession, _Mapping]] = ..., add_bos: _Optional[_Union[AddBos, _Mapping]] = ..., start: _Optional[_Union[Start, _Mapping]] = ..., get_progress: _Optional[_Union[GetProgress, _Mapping]] = ..., wait: _Optional[_Union[Wait, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., close_session: _Optional[_Union[CloseSession, _Mapping]] = ..., get_status: _Optional[_Union[GetStatus, _Mapping]] = ..., list_sessions: _Optional[_Union[ListSessions, _Mapping]] = ..., attach_files: _Optional[_Union[AttachFiles, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("versions", "client")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    client: str
    def __init__(self, versions: _Optional[_Iterable[int]] = ..., client: _Optional[str] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("kind", "compression", "chunk_size", "label", "allow_partial", "topology_checks", "parent_manifest_fd_indexes", "parent_hint", "no_dedup", "replace_parent", "manifest_fd_index", "hold_s", "supply_fd_index")
    class TopologyChecksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bool
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bool] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_CHECKS_FIELD_NUMBER: _ClassVar[int]
    PARENT_MANIFEST_FD_INDEXES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HINT_FIELD_NUMBER: _ClassVar[int]
    NO_DEDUP_FIELD_NUMBER: _ClassVar[int]
    REPLACE_PARENT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    SUPPLY_FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    kind: SessionKind
    compression: str
    chunk_size: int
    label: str
    allow_partial: bool
    topology_checks: _containers.ScalarMap[str, bool]
    parent_manifest_fd_indexes: _containers.RepeatedScalarFieldContainer[int]
    parent_hint: str
    no_dedup: bool
    replace_parent: bool
    manifest_fd_index: int
    hold_s: int
    supply_fd_index: int
    def __init__(self, kind: _Optional[_Union[SessionKind, str]] = ..., compression: _Optional[str] = ..., chunk_size: _Optional[int] = ..., label: _Optional[str] = ..., allow_partial: _Optional[bool] = ..., topology_checks: _Optional[_Mapping[str, bool]] = ..., parent_manifest_fd_indexes: _Optional[_Iterable[int]] = ..., parent_hint: _Optional[str] = ..., no_dedup: _Optional[bool] = ..., replace_parent: _Optional[bool] = ..., manifest_fd_index: _Optional[int] = ..., hold_s: _Optional[int] = ..., supply_fd_index: _Optional[int] = ...) -> None: ...

class FileRef(_message.Message):
    __slots__ = ("image", "name", "fd_index", "direct_fd_index", "gpu_id", "stripe")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_ID_FIELD_NUMBER: _ClassVar[int]
    STRIPE_FIELD_NUMBER: _ClassVar[int]
    image: int
    name: str
    fd_index: int
    direct_fd_index: int
    gpu_id: int
    stripe: int
    def __init__(self, image: _Optional[int] = ..., name: _Optional[str] = ..., fd_index: _Optional[int] = ..., direct_fd_index: _Optional[int] = ..., gpu_id: _Optional[int] = ..., stripe: _Optional[int] = ...) -> None: ...

class AttachFiles(_message.Message):
    __slots__ = ("token", "files")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    token: str
    files: _containers.RepeatedCompositeFieldContainer[FileRef]
    def __init__(self, token: _Optional[str] = ..., files: _Optional[_Iterable[_Union[FileRef, _Mapping]]] = ...) -> None: ...

class Bo(_message.Message):
    __slots__ = ("id", "gpu_id", "size", "alloc_flags", "va_addr", "name", "backend", "fd_index", "offset")
    ID_FIELD_NUMBER: _ClassVar[int]
    GPU_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ALLOC_FLAGS_FIELD_NUMBER: _ClassVar[int]
    VA_ADDR_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    id: int
    gpu_id: int
    size: int
    alloc_flags: int
    va_addr: int
    name: str
    backend: str
    fd_index: int
    offset: int
    def __init__(self, id: _Optional[int] = ..., gpu_id: _Optional[int] = ..., size: _Optional[int] = ..., alloc_flags: _Optional[int] = ..., va_addr: _Optional[int] = ..., name: _Optional[str] = ..., backend: _Optional[str] = ..., fd_index: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class AddBos(_message.Message):
    __slots__ = ("token", "bos")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BOS_FIELD_NUMBER: _ClassVar[int]
    token: str
    bos: _containers.RepeatedCompositeFieldContainer[Bo]
    def __init__(self, token: _Optional[str] = ..., bos: _Optional[_Iterable[_Union[Bo, _Mapping]]] = ...) -> None: ...

class Start(_message.Message):
    __slots__ = ("token", "manifest_fd_index")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    token: str
    manifest_fd_index: int
    def __init__(self, token: _Optional[str] = ..., manifest_fd_index: _Optional[int] = ...) -> None: ...

class GetProgress(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class Wait(_message.Message):
    __slots__ = ("token", "timeout_ms")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    token: str
    timeout_ms: int
    def __init__(self, token: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("token", "reason", "session_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    token: str
    reason: str
    session_id: int
    def __init__(self, token: _Optional[str] = ..., reason: _Optional[str] = ..., session_id: _Optional[int] = ...) -> None: ...

class CloseSession(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class GetStatus(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessions(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Response(_message.Message):
    __slots__ = ("id", "error", "hello", "session", "status", "sessions")
    ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    id: int
    error: Error
    hello: HelloReply
    session: SessionInfo
    status: StatusReply
    sessions: SessionList
    def __init__(self, id: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., hello: _Optional[_Union[HelloReply, _Mapping]] = ..., session: _Optional[_Union[SessionInfo, _Mapping]] = ..., status: _Optional[_Union[StatusReply, _Mapping]] = ..., sessions: _Optional[_Union[SessionList, _Mapping]] = ...) -> None: ...

class BackendInfo(_message.Message):
    __slots__ = ("name", "available", "reason", "can_read", "can_write", "asynchronous_dma", "preferred_chunk", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CAN_READ_FIELD_NUMBER: _ClassVar[int]
    CAN_WRITE_FIELD_NUMBER: _ClassVar[int]
    ASYNCHRONOUS_DMA_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_CHUNK_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    available: bool
    reason: str
    can_read: bool
    can_write: bool
    asynchronous_dma: bool
    preferred_chunk: int
    description: str
    def __init__(self, name: _Optional[str] = ..., available: _Optional[bool] = ..., reason: _Optional[str] = ..., can_read: _Optional[bool] = ..., can_write: _Optional[bool] = ..., asynchronous_dma: _Optional[bool] = ..., preferred_chunk: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_message_bytes", "max_fds_per_message", "max_bos_per_session", "max_sessions_per_uid", "max_fds_per_session", "max_chunks_per_session", "max_bos_per_uid", "max_fds_per_uid", "max_queued_requests", "max_connections_per_uid", "hello_timeout_ms")
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_FDS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_BOS_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_PER_UID_FIELD_NUMBER: _ClassVar[int]
    MAX_FDS_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNKS_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BOS_PER_UID_FIELD_NUMBER: _ClassVar[int]
    MAX_FDS_PER_UID_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONNECTIONS_PER_UID_FIELD_NUMBER: _ClassVar[int]
    HELLO_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    max_message_bytes: int
    max_fds_per_message: int
    max_bos_per_session: int
    max_sessions_per_uid: int
    max_fds_per_session: int
    max_chunks_per_session: int
    max_bos_per_uid: int
    max_fds_per_uid: int
    max_queued_requests: int
    max_connections_per_uid: int
    hello_timeout_ms: int
    def __init__(self, max_message_bytes: _Optional[int] = ..., max_fds_per_message: _Optional[int] = ..., max_bos_per_session: _Optional[int] = ..., max_sessions_per_uid: _Optional[int] = ..., max_fds_per_session: _Optional[int] = ..., max_chunks_per_session: _Optional[int] = ..., max_bos_per_uid: _Optional[int] = ..., max_fds_per_uid: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., max_connections_per_uid: _Optional[int] = ..., hello_timeout_ms: _Optional[int] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("version", "server", "backends", "gpu_ids", "limits", "allowed_gpu_ids", "supply_notes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPLY_NOTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    server: str
    backends: _containers.RepeatedCompositeFieldContainer[BackendInfo]
    gpu_ids: _containers.RepeatedScalarFieldContainer[int]
    limits: Limits
    allowed_gpu_ids: _containers.RepeatedScalarFieldContainer[int]
    supply_notes: bool
    def __init__(self, version: _Optional[int] = ..., server: _Optional[str] = ..., backends: _Optional[_Iterable[_Union[BackendInfo, _Mapping]]] = ..., gpu_ids: _Optional[_Iterable[int]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., allowed_gpu_ids: _Optional[_Iterable[int]] = ..., supply_notes: _Optional[bool] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("bos_total", "bos_done", "bytes_total", "bytes_done", "chunks_done", "elapsed_s")
    BOS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BOS_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DONE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    bos_total: int
    bos_done: int
    bytes_total: int
    bytes_done: int
    chunks_done: int
    elapsed_s: float
    def __init__(self, bos_total: _Optional[int] = ..., bos_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., bytes_done: _Optional[int] = ..., chunks_done: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class ImageSummary(_message.Message):
    __slots__ = ("bo_count", "bo_bytes", "stored_bytes", "zero_bytes", "chunk_size", "compression", "data_files")
    BO_COUNT_FIELD_NUMBER: _ClassVar[int]
    BO_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ZERO_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    DATA_FILES_FIELD_NUMBER: _ClassVar[int]
    bo_count: int
    bo_bytes: int
    stored_bytes: int
    zero_bytes: int
    chunk_size: int
    compression: str
    data_files: int
    def __init__(self, bo_count: _Optional[int] = ..., bo_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., zero_bytes: _Optional[int] = ..., chunk_size: _Optional[int] = ..., compression: _Optional[str] = ..., data_files: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "token", "kind", "state", "uid", "pid", "label", "progress", "error", "holders", "image", "target_pids", "rate_bytes_per_s", "age_s", "image_id", "files_needed", "data_files_per_gpu", "hold_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_PIDS_FIELD_NUMBER: _ClassVar[int]
    RATE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_NEEDED_FIELD_NUMBER: _ClassVar[int]
    DATA_FILES_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    token: str
    kind: SessionKind
    state: SessionState
    uid: int
    pid: int
    label: str
    progress: Progress
    error: Error
    holders: int
    image: ImageSummary
    target_pids: _containers.RepeatedScalarFieldContainer[int]
    rate_bytes_per_s: float
    age_s: float
    image_id: bytes
    files_needed: _containers.RepeatedCompositeFieldContainer[FileRef]
    data_files_per_gpu: int
    hold_s: int
    def __init__(self, session_id: _Optional[int] = ..., token: _Optional[str] = ..., kind: _Optional[_Union[SessionKind, str]] = ..., state: _Optional[_Union[SessionState, str]] = ..., uid: _Optional[int] = ..., pid: _Optional[int] = ..., label: _Optional[str] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., holders: _Optional[int] = ..., image: _Optional[_Union[ImageSummary, _Mapping]] = ..., target_pids: _Optional[_Iterable[int]] = ..., rate_bytes_per_s: _Optional[float] = ..., age_s: _Optional[float] = ..., image_id: _Optional[bytes] = ..., files_needed: _Optional[_Iterable[_Union[FileRef, _Mapping]]] = ..., data_files_per_gpu: _Optional[int] = ..., hold_s: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("server", "version", "uptime_s", "connections", "sessions", "staging_budget", "staging_in_use", "backends", "metrics", "draining")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STAGING_BUDGET_FIELD_NUMBER: _ClassVar[int]
    STAGING_IN_USE_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    server: str
    version: int
    uptime_s: float
    connections: int
    sessions: int
    staging_budget: int
    staging_in_use: int
    backends: _containers.RepeatedCompositeFieldContainer[BackendInfo]
    metrics: str
    draining: bool
    def __init__(self, server: _Optional[str] = ..., version: _Optional[int] = ..., uptime_s: _Optional[float] = ..., connections: _Optional[int] = ..., sessions: _Optional[int] = ..., staging_budget: _Optional[int] = ..., staging_in_use: _Optional[int] = ..., backends: _Optional[_Iterable[_Union[BackendInfo, _Mapping]]] = ..., metrics: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class SessionList(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...
