"""Image formats v1 to v3: the byte layout of data files and chunk records, as pure functions (no I/O).

See docs/image-format.md for the specification.  Everything here turns
bytes into validated values or values into bytes, raising typed errors that
name the file, BO and offset involved.  The manifest's framing and checks
are in manifest.py, the names of an image directory's files in names.py.
"""
from __future__ import annotations

import struct
from collections.abc import Callable

import blake3
import xxhash
from google.protobuf.message import DecodeError

from ..errors import CorruptChunkError, ForeignDataFileError, UnsupportedVersionError
from ..pb import image_pb2 as pb
from ..units import ceil_div

# A bytes-like object the checksum and the decoders accept.
Bytes = bytes | bytearray | memoryview


def checksum(data: Bytes) -> int:
    """xxh3-64 of a bytes-like object (the image format's chunk and manifest checksum)."""
    return xxhash.xxh3_64_intdigest(data)


# xxh3-64 of the empty string: the checksum of a payload-less (hole) chunk.
EMPTY_CHECKSUM = checksum(b"")

HASH_LEN = 32  # BLAKE3-256: a chunk's identity in format v2 (dedup, parents)


def content_hash(data: Bytes) -> bytes:
    """BLAKE3-256 of a chunk's raw bytes (format v2's chunk identity; see docs/image-format.md)."""
    # blake3 releases the GIL on large inputs, so copy threads hash in parallel.
    return blake3.blake3(data).digest()


FORMAT_VERSION = 3  # what this writer writes
SUPPORTED_VERSIONS = frozenset({1, 2, 3})
MAX_STRIPES = 16  # data files a GPU's records may be spread over (format v3: stripes 0-15, one hex digit)

DATA_MAGIC = b"VRAMDDAT"
# magic, format version, reserved, image id
DATA_HEADER = struct.Struct("<8sII16s")

RECORD_MAGIC = b"VRDC"
# magic, header length, xxh3-64 of the header bytes
RECORD_PREFIX = struct.Struct("<4sIQ")
MAX_CHUNK_HEADER = 256  # a ChunkHeader encodes to at most ~45 bytes (v2: ~120)
RECORD_OVERHEAD = RECORD_PREFIX.size + MAX_CHUNK_HEADER  # a record is at most this plus its raw bytes

Codec = pb.Codec
CODEC_NAMES = {pb.CODEC_RAW: "raw", pb.CODEC_ZERO: "zero", pb.CODEC_ZSTD: "zstd", pb.CODEC_PLANES: "bplanes",
               pb.CODEC_XOR: "xor", pb.CODEC_XOR_PLANES: "xor-planes"}
V1_CODECS = frozenset({pb.CODEC_RAW, pb.CODEC_ZERO, pb.CODEC_ZSTD})
DELTA_CODECS = frozenset({pb.CODEC_XOR, pb.CODEC_XOR_PLANES})  # a record that is the XOR of its bytes and a base's
PLANES_CODECS = frozenset({pb.CODEC_PLANES, pb.CODEC_XOR_PLANES})  # a record whose frame holds byte planes


# Chunk sizes a writer uses (EngineConfig.check): a multiple of 4 KiB, at most 1 GiB.
MIN_CHUNK = 4096
MAX_CHUNK = 1 << 30


def chunk_count(size: int, chunk_size: int) -> int:
    return ceil_div(size, chunk_size)


# --- data files ------------------------------------------------------------

def encode_data_header(image_id: bytes, version: int = FORMAT_VERSION) -> bytes:
    return DATA_HEADER.pack(DATA_MAGIC, version, 0, image_id)


def check_data_header(blob: bytes, image_id: bytes, name: str) -> None:
    if len(blob) < DATA_HEADER.size:
        raise ForeignDataFileError(f"{name}: too short for a data file header")
    magic, version, _reserved, file_image_id = DATA_HEADER.unpack_from(blob)
    # The messages name the file, never its bytes: a client may not be allowed to read it.
    if magic != DATA_MAGIC:
        raise ForeignDataFileError(f"{name}: not a vramd data file (bad magic)")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(f"{name}: data file format version {version} is not supported")
    if file_image_id != image_id:
        raise ForeignDataFileError(f"{name}: belongs to another image, not to this manifest's")


# --- chunk records ---------------------------------------------------------

def encode_record_head(header: pb.ChunkHeader) -> bytes:
    """Prefix + serialized ChunkHeader; the payload follows it in the file."""
    hdr = header.SerializeToString()
    return RECORD_PREFIX.pack(RECORD_MAGIC, len(hdr), checksum(hdr)) + hdr


def record_checksum(head: Bytes) -> int:
    """The header checksum in a record's prefix: what the manifest's record_checksums lists for it."""
    value: int = RECORD_PREFIX.unpack_from(head)[2]
    return value


HEAD_PEEK = 512  # bytes read first: always covers prefix + header


Where = str | Callable[[], str]
"""How an error names a record: a string, or a function that makes it (only on the error path: a restore
checks 10,000 small records without formatting one name)."""


def where_text(where: Where) -> str:
    return where if isinstance(where, str) else where()


def record_prefix(peek: Bytes, *, bo_id: int, offset: int, where: Where) -> tuple[int, int]:
    """A record's first bytes: (bytes before its payload, its header checksum); what is wrong with them is
    the record's CorruptChunkError."""
    def bad(what: str) -> CorruptChunkError:
        return CorruptChunkError(f"{where_text(where)}: {what}", bo_id=bo_id, offset=offset)

    if len(peek) < RECORD_PREFIX.size:
        raise bad("record shorter than its prefix")
    magic, hlen, hsum = RECORD_PREFIX.unpack_from(peek)
    if magic != RECORD_MAGIC:
        raise bad("bad record magic")
    if hlen > MAX_CHUNK_HEADER or RECORD_PREFIX.size + hlen > len(peek):
        raise bad(f"implausible header length {hlen}")
    return RECORD_PREFIX.size + hlen, hsum


def record_head_length(peek: Bytes, *, bo_id: int, offset: int, where: Where) -> int:
    """From the first bytes of a record, how many precede the payload (prefix + header)."""
    return record_prefix(peek, bo_id=bo_id, offset=offset, where=where)[0]


def decode_record_head(buf: Bytes, *, bo_id: int, offset: int, where: Where,
                       record_checksum: int | None = None,
                       content_hash: bytes | None = None) -> tuple[pb.ChunkHeader, int]:
    """Validate a record's prefix and header; returns (header, bytes before the payload).

    `bo_id`/`offset` are what the manifest says this record holds; a record
    that claims anything else is treated as corrupt.  `record_checksum` is the
    manifest's `record_checksums` entry for it (None for an image written
    before records were bound): the record's header checksum must equal it,
    so a record of another image (same BO, offset and length) is rejected.
    `content_hash`: format v2, the chunk table's hash for the record; the
    header must carry it (and then its BO id and offset, which name the
    chunk that stored it first, are not compared: dedup shares records).
    """
    head_len, hsum = record_prefix(buf, bo_id=bo_id, offset=offset, where=where)
    return check_record_header(buf[RECORD_PREFIX.size:head_len], hsum, bo_id=bo_id, offset=offset, where=where,
                               record_checksum=record_checksum, content_hash=content_hash), head_len


def check_record_header(raw: Bytes, hsum: int, *, bo_id: int, offset: int, where: Where,
                        record_checksum: int | None, content_hash: bytes | None) -> pb.ChunkHeader:
    """A record's serialized header `raw`, whose prefix gave its checksum `hsum`: checked and decoded
    (decode_record_head, after the prefix; this runs once per record a restore reads)."""
    def bad(what: str) -> CorruptChunkError:
        return CorruptChunkError(f"{where_text(where)}: {what}", bo_id=bo_id, offset=offset)

    if checksum(raw) != hsum:
        raise bad("chunk header checksum mismatch")
    if record_checksum is not None and hsum != record_checksum:
        raise bad("record is not the one this image's manifest recorded (record checksum mismatch)")
    header = pb.ChunkHeader()
    try:
        header.ParseFromString(bytes(raw))
    except DecodeError:
        raise bad("undecodable chunk header") from None
    codec = header.codec  # each field read once: a protobuf field read costs more than a local's
    if content_hash is None:
        if header.bo_id != bo_id or header.offset != offset:
            raise bad("record holds another chunk than the manifest expects here")
        if codec not in V1_CODECS:
            raise bad(f"unknown codec {codec}")
    else:
        if header.content_hash != content_hash:
            raise bad("record holds another chunk than the manifest expects here (content hash)")
        if codec not in CODEC_NAMES or codec == pb.CODEC_ZERO:
            raise bad(f"codec {codec} is not one a format v2 record has")
        if codec in PLANES_CODECS and header.word_size not in (2, 4):
            raise bad(f"byte-plane record with word size {header.word_size}")
        if (codec in DELTA_CODECS) != bool(header.base_hash):
            raise bad("a delta record without a base, or a base for a record that is no delta")
    if codec == pb.CODEC_ZERO and header.stored_length:
        raise bad("hole chunk with a payload")
    if codec == pb.CODEC_RAW and header.stored_length != header.raw_length:
        raise bad("raw chunk whose stored and raw lengths differ")
    return header
