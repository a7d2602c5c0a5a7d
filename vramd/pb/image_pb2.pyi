from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_RAW: _ClassVar[Codec]
    CODEC_ZERO: _ClassVar[Codec]
    CODEC_ZSTD: _ClassVar[Codec]
    CODEC_PLANES: _ClassVar[Codec]
    CODEC_XOR: _ClassVar[Codec]
    CODEC_XOR_PLANES: _ClassVar[Codec]

class SourceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_UNSPECIFIED: _ClassVar[SourceKind]
    SOURCE_PROCMEM: _ClassVar[SourceKind]
    SOURCE_MMAP: _ClassVar[SourceKind]
    SOURCE_SDMA: _ClassVar[SourceKind]
CODEC_UNSPECIFIED: Codec
CODEC_RAW: Codec
CODEC_ZERO: Codec
CODEC_ZSTD: Codec
CODEC_PLANES: Codec
CODEC_XOR: Codec
CODEC_XOR_PLANES: Codec
SOURCE_UNSPECIFIED: SourceKind
SOURCE_PROCMEM: SourceKind
SOURCE_MMAP: SourceKind
SOURCE_SDMA: SourceKind

class ChunkHeader(_message.Message):
    __slots__ = ("bo_id", "offset", "raw_length", "stored_length", "codec", "checksum", "content_hash", "word_size", "base_hash")
    BO_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    RAW_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STORED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    WORD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BASE_HASH_FIELD_NUMBER: _ClassVar[int]
    bo_id: int
    offset: int
    raw_length: int
    stored_length: int
    codec: Codec
    checksum: int
    content_hash: bytes
    word_size: int
    base_hash: bytes
    def __init__(self, bo_id: _Optional[int] = ..., offset: _Optional[int] = ..., raw_length: _Optional[int] = ..., stored_length: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., checksum: _Optional[int] = ..., content_hash: _Optional[bytes] = ..., word_size: _Optional[int] = ..., base_hash: _Optional[bytes] = ...) -> None: ...

class DataFile(_message.Message):
    __slots__ = ("name", "gpu_id", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    gpu_id: int
    length: int
    def __init__(self, name: _Optional[str] = ..., gpu_id: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class BoEntry(_message.Message):
    __slots__ = ("id", "gpu_id", "size", "alloc_flags", "va_addr", "source", "source_offset", "name", "file_index", "record_offsets", "record_lengths", "stored_bytes", "zero_bytes", "record_checksums", "chunk_refs", "dedup_bytes", "parent_bytes", "delta_bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    GPU_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ALLOC_FLAGS_FIELD_NUMBER: _ClassVar[int]
    VA_ADDR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    RECORD_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    RECORD_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ZERO_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECORD_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_REFS_FIELD_NUMBER: _ClassVar[int]
    DEDUP_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    id: int
    gpu_id: int
    size: int
    alloc_flags: int
    va_addr: int
    source: SourceKind
    source_offset: int
    name: str
    file_index: int
    record_offsets: _containers.RepeatedScalarFieldContainer[int]
    record_lengths: _containers.RepeatedScalarFieldContainer[int]
    stored_bytes: int
    zero_bytes: int
    record_checksums: _containers.RepeatedScalarFieldContainer[int]
    chunk_refs: _containers.RepeatedScalarFieldContainer[int]
    dedup_bytes: int
    parent_bytes: int
    delta_bytes: int
    def __init__(self, id: _Optional[int] = ..., gpu_id: _Optional[int] = ..., size: _Optional[int] = ..., alloc_flags: _Optional[int] = ..., va_addr: _Optional[int] = ..., source: _Optional[_Union[SourceKind, str]] = ..., source_offset: _Optional[int] = ..., name: _Optional[str] = ..., file_index: _Optional[int] = ..., record_offsets: _Optional[_Iterable[int]] = ..., record_lengths: _Optional[_Iterable[int]] = ..., stored_bytes: _Optional[int] = ..., zero_bytes: _Optional[int] = ..., record_checksums: _Optional[_Iterable[int]] = ..., chunk_refs: _Optional[_Iterable[int]] = ..., dedup_bytes: _Optional[int] = ..., parent_bytes: _Optional[int] = ..., delta_bytes: _Optional[int] = ...) -> None: ...

class Compression(_message.Message):
    __slots__ = ("codec", "level", "automatic")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    AUTOMATIC_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    level: int
    automatic: bool
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., level: _Optional[int] = ..., automatic: _Optional[bool] = ...) -> None: ...

class Totals(_message.Message):
    __slots__ = ("bo_count", "bo_bytes", "stored_bytes", "zero_bytes", "chunk_count", "dedup_bytes", "parent_bytes", "delta_bytes", "record_count", "compressed_records")
    BO_COUNT_FIELD_NUMBER: _ClassVar[int]
    BO_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ZERO_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEDUP_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECORD_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    bo_count: int
    bo_bytes: int
    stored_bytes: int
    zero_bytes: int
    chunk_count: int
    dedup_bytes: int
    parent_bytes: int
    delta_bytes: int
    record_count: int
    compressed_records: int
    def __init__(self, bo_count: _Optional[int] = ..., bo_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., zero_bytes: _Optional[int] = ..., chunk_count: _Optional[int] = ..., dedup_bytes: _Optional[int] = ..., parent_bytes: _Optional[int] = ..., delta_bytes: _Optional[int] = ..., record_count: _Optional[int] = ..., compressed_records: _Optional[int] = ...) -> None: ...

class ChunkTable(_message.Message):
    __slots__ = ("hashes", "image", "file_index", "offset", "length", "record_checksum", "raw_length", "base")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    RECORD_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RAW_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    hashes: bytes
    image: _containers.RepeatedScalarFieldContainer[int]
    file_index: _containers.RepeatedScalarFieldContainer[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    length: _containers.RepeatedScalarFieldContainer[int]
    record_checksum: _containers.RepeatedScalarFieldContainer[int]
    raw_length: _containers.RepeatedScalarFieldContainer[int]
    base: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hashes: _Optional[bytes] = ..., image: _Optional[_Iterable[int]] = ..., file_index: _Optional[_Iterable[int]] = ..., offset: _Optional[_Iterable[int]] = ..., length: _Optional[_Iterable[int]] = ..., record_checksum: _Optional[_Iterable[int]] = ..., raw_length: _Optional[_Iterable[int]] = ..., base: _Optional[_Iterable[int]] = ...) -> None: ...

class ParentRef(_message.Message):
    __slots__ = ("image_id", "manifest_hash", "relative_path")
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_PATH_FIELD_NUMBER: _ClassVar[int]
    image_id: bytes
    manifest_hash: bytes
    relative_path: str
    def __init__(self, image_id: _Optional[bytes] = ..., manifest_hash: _Optional[bytes] = ..., relative_path: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("format_version", "image_id", "writer", "created_unix_ns", "chunk_size", "compression", "files", "bos", "totals", "topology_json", "chunks", "parents")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    BOS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_JSON_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    image_id: bytes
    writer: str
    created_unix_ns: int
    chunk_size: int
    compression: Compression
    files: _containers.RepeatedCompositeFieldContainer[DataFile]
    bos: _containers.RepeatedCompositeFieldContainer[BoEntry]
    totals: Totals
    topology_json: bytes
    chunks: ChunkTable
    parents: _containers.RepeatedCompositeFieldContainer[ParentRef]
    def __init__(self, format_version: _Optional[int] = ..., image_id: _Optional[bytes] = ..., writer: _Optional[str] = ..., created_unix_ns: _Optional[int] = ..., chunk_size: _Optional[int] = ..., compression: _Optional[_Union[Compression, _Mapping]] = ..., files: _Optional[_Iterable[_Union[DataFile, _Mapping]]] = ..., bos: _Optional[_Iterable[_Union[BoEntry, _Mapping]]] = ..., totals: _Optional[_Union[Totals, _Mapping]] = ..., topology_json: _Optional[bytes] = ..., chunks: _Optional[_Union[ChunkTable, _Mapping]] = ..., parents: _Optional[_Iterable[_Union[ParentRef, _Mapping]]] = ...) -> None: ...
