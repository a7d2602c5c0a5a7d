from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KfdDeviceEntry(_message.Message):
    __slots__ = ("node_id", "gpu_id", "drm_render_minor")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_ID_FIELD_NUMBER: _ClassVar[int]
    DRM_RENDER_MINOR_FIELD_NUMBER: _ClassVar[int]
    node_id: int
    gpu_id: int
    drm_render_minor: int
    def __init__(self, node_id: _Optional[int] = ..., gpu_id: _Optional[int] = ..., drm_render_minor: _Optional[int] = ...) -> None: ...

class KfdBoEntry(_message.Message):
    __slots__ = ("addr", "size", "offset", "alloc_flags", "gpu_id", "handle")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ALLOC_FLAGS_FIELD_NUMBER: _ClassVar[int]
    GPU_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    addr: int
    size: int
    offset: int
    alloc_flags: int
    gpu_id: int
    handle: int
    def __init__(self, addr: _Optional[int] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ..., alloc_flags: _Optional[int] = ..., gpu_id: _Optional[int] = ..., handle: _Optional[int] = ...) -> None: ...

class CriuKfd(_message.Message):
    __slots__ = ("pid", "num_of_gpus", "num_of_cpus", "device_entries", "num_of_bos", "bo_entries", "num_of_objects", "shared_mem_size", "shared_mem_magic", "priv_data")
    PID_FIELD_NUMBER: _ClassVar[int]
    NUM_OF_GPUS_FIELD_NUMBER: _ClassVar[int]
    NUM_OF_CPUS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_OF_BOS_FIELD_NUMBER: _ClassVar[int]
    BO_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_OF_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEM_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEM_MAGIC_FIELD_NUMBER: _ClassVar[int]
    PRIV_DATA_FIELD_NUMBER: _ClassVar[int]
    pid: int
    num_of_gpus: int
    num_of_cpus: int
    device_entries: _containers.RepeatedCompositeFieldContainer[KfdDeviceEntry]
    num_of_bos: int
    bo_entries: _containers.RepeatedCompositeFieldContainer[KfdBoEntry]
    num_of_objects: int
    shared_mem_size: int
    shared_mem_magic: int
    priv_data: bytes
    def __init__(self, pid: _Optional[int] = ..., num_of_gpus: _Optional[int] = ..., num_of_cpus: _Optional[int] = ..., device_entries: _Optional[_Iterable[_Union[KfdDeviceEntry, _Mapping]]] = ..., num_of_bos: _Optional[int] = ..., bo_entries: _Optional[_Iterable[_Union[KfdBoEntry, _Mapping]]] = ..., num_of_objects: _Optional[int] = ..., shared_mem_size: _Optional[int] = ..., shared_mem_magic: _Optional[int] = ..., priv_data: _Optional[bytes] = ...) -> None: ...

class DrmBoEntry(_message.Message):
    __slots__ = ("addr", "size", "offset", "alloc_flags", "alignment", "preferred_domains", "handle", "is_import", "num_of_vms")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ALLOC_FLAGS_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_DOMAINS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    IS_IMPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_OF_VMS_FIELD_NUMBER: _ClassVar[int]
    addr: int
    size: int
    offset: int
    alloc_flags: int
    alignment: int
    preferred_domains: int
    handle: int
    is_import: int
    num_of_vms: int
    def __init__(self, addr: _Optional[int] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ..., alloc_flags: _Optional[int] = ..., alignment: _Optional[int] = ..., preferred_domains: _Optional[int] = ..., handle: _Optional[int] = ..., is_import: _Optional[int] = ..., num_of_vms: _Optional[int] = ...) -> None: ...

class CriuRenderNode(_message.Message):
    __slots__ = ("gpu_id", "id", "drm_render_minor", "num_of_bos", "bo_entries")
    GPU_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    DRM_RENDER_MINOR_FIELD_NUMBER: _ClassVar[int]
    NUM_OF_BOS_FIELD_NUMBER: _ClassVar[int]
    BO_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    gpu_id: int
    id: int
    drm_render_minor: int
    num_of_bos: int
    bo_entries: _containers.RepeatedCompositeFieldContainer[DrmBoEntry]
    def __init__(self, gpu_id: _Optional[int] = ..., id: _Optional[int] = ..., drm_render_minor: _Optional[int] = ..., num_of_bos: _Optional[int] = ..., bo_entries: _Optional[_Iterable[_Union[DrmBoEntry, _Mapping]]] = ...) -> None: ...
