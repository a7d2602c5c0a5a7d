"""Image format v1: the byte layout, as pure functions (no I/O).

See docs/image-format.md for the specification.  Everything here turns
bytes into validated values or values into bytes, raising typed errors that
name the file, BO and offset involved.
"""
from __future__ import annotations

import re
import struct

import xxhash
from google.protobuf.message import DecodeError

from ..errors import (
    CorruptChunkError,
    CorruptManifestError,
    ForeignDataFileError,
    UnsupportedVersionError,
)
from ..pb import image_pb2 as pb
from ..units import ceil_div

# A bytes-like object the checksum and the decoders accept.
Bytes = bytes | bytearray | memoryview


def checksum(data: Bytes) -> int:
    """xxh3-64 of a bytes-like object (the image format's chunk and manifest checksum)."""
    return xxhash.xxh3_64_intdigest(data)


# xxh3-64 of the empty string: the checksum of a payload-less (hole) chunk.
EMPTY_CHECKSUM = checksum(b"")

FORMAT_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

MANIFEST_NAME = "manifest.vrdm"
MANIFEST_MAGIC = b"VRAMDMAN"
# magic, format version, reserved, body length, xxh3-64 of body
MANIFEST_PREFIX = struct.Struct("<8sIIQQ")
MAX_MANIFEST_BYTES = 1 << 30

DATA_MAGIC = b"VRAMDDAT"
# magic, format version, reserved, image id
DATA_HEADER = struct.Struct("<8sII16s")

RECORD_MAGIC = b"VRDC"
# magic, header length, xxh3-64 of the header bytes
RECORD_PREFIX = struct.Struct("<4sIQ")
MAX_CHUNK_HEADER = 256  # a ChunkHeader encodes to at most ~45 bytes

Codec = pb.Codec
CODEC_NAMES = {pb.CODEC_RAW: "raw", pb.CODEC_ZERO: "zero", pb.CODEC_ZSTD: "zstd"}


def data_file_name(image_id: bytes, gpu_id: int) -> str:
    return f"data-{image_id.hex()[:16]}-{gpu_id:08x}.vrd"


# The only names a manifest may give a data file: exactly what data_file_name produces.
# A plain name of this format cannot be ".", "..", a path, or any file vramd did not write
# under this pattern, so a reader never opens, and a dump never removes, anything else.
DATA_FILE_NAME = re.compile(r"data-[0-9a-f]{16}-[0-9a-f]{8}\.vrd")
# vramd's own temporaries: a dump's data files before commit, and its manifest before the rename.
DATA_FILE_TMP = re.compile(r"data-[0-9a-f]{16}-[0-9a-f]{8}\.vrd\.tmp")
MANIFEST_TMP = re.compile(r"\.manifest\.vrdm\.[0-9a-f]{32}\.tmp")


def is_data_file_name(name: str) -> bool:
    return DATA_FILE_NAME.fullmatch(name) is not None


def is_own_temporary(name: str) -> bool:
    """A name only a vramd dump creates, and only until its commit (see ImageWriter.sweep)."""
    return DATA_FILE_TMP.fullmatch(name) is not None or MANIFEST_TMP.fullmatch(name) is not None


def manifest_tmp_name(image_id: bytes) -> str:
    return f".{MANIFEST_NAME}.{image_id.hex()}.tmp"


# Chunk sizes a writer uses (EngineConfig.check): a multiple of 4 KiB, at most 1 GiB.
MIN_CHUNK = 4096
MAX_CHUNK = 1 << 30


# --- manifest --------------------------------------------------------------

def encode_manifest(manifest: pb.Manifest) -> bytes:
    body = manifest.SerializeToString()
    return MANIFEST_PREFIX.pack(MANIFEST_MAGIC, manifest.format_version, 0, len(body), checksum(body)) + body


def decode_manifest(blob: Bytes, name: str = MANIFEST_NAME) -> pb.Manifest:
    if len(blob) < MANIFEST_PREFIX.size:
        raise CorruptManifestError(f"{name}: {len(blob)} bytes is too short for a manifest")
    magic, version, _reserved, length, digest = MANIFEST_PREFIX.unpack_from(blob)
    if magic != MANIFEST_MAGIC:
        raise CorruptManifestError(f"{name}: not a vramd manifest (bad magic)")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(
            f"{name}: image format version {version} is not supported by this reader "
            f"(supported: {sorted(SUPPORTED_VERSIONS)})"
        )
    body = memoryview(blob)[MANIFEST_PREFIX.size:]
    if len(body) != length:
        raise CorruptManifestError(f"{name}: body is {len(body)} bytes, prefix says {length}")
    if checksum(body) != digest:
        raise CorruptManifestError(f"{name}: digest mismatch; the manifest is damaged")
    manifest = pb.Manifest()
    try:
        manifest.ParseFromString(bytes(body))
    except DecodeError as e:
        raise CorruptManifestError(f"{name}: undecodable body: {e}") from None
    if manifest.format_version != version:
        raise CorruptManifestError(f"{name}: body version {manifest.format_version} != prefix version {version}")
    _check_manifest(manifest, name)
    return manifest


def _check_manifest(m: pb.Manifest, name: str) -> None:
    if len(m.image_id) != 16:
        raise CorruptManifestError(f"{name}: image id must be 16 bytes")
    if not MIN_CHUNK <= m.chunk_size <= MAX_CHUNK or m.chunk_size % MIN_CHUNK:
        raise CorruptManifestError(f"{name}: chunk size {m.chunk_size} is not a multiple of 4 KiB of at most 1 GiB")
    names = set()
    for i, df in enumerate(m.files):
        # Never quoted: the name is the image's content, and the reply goes to a client.
        if not is_data_file_name(df.name):
            raise CorruptManifestError(
                f"{name}: files[{i}].name is not a data file name of this format (data-<16 hex>-<8 hex>.vrd)")
        if df.name in names:
            raise CorruptManifestError(f"{name}: files[{i}].name lists a data file twice")
        names.add(df.name)
    bound = None  # whether the BOs' records carry record_checksums (all of them or none)
    seen = set()
    for bo in m.bos:
        if bo.id in seen:
            raise CorruptManifestError(f"{name}: BO listed twice", bo_id=bo.id)
        seen.add(bo.id)
        if bo.size and bo.file_index >= len(m.files):
            raise CorruptManifestError(f"{name}: BO refers to data file #{bo.file_index}", bo_id=bo.id)
        if len(bo.record_offsets) != len(bo.record_lengths):
            raise CorruptManifestError(f"{name}: record offset/length lists differ", bo_id=bo.id)
        if len(bo.record_offsets) != chunk_count(bo.size, m.chunk_size):
            raise CorruptManifestError(
                f"{name}: {len(bo.record_offsets)} records for {bo.size} bytes at chunk size {m.chunk_size}",
                bo_id=bo.id,
            )
        if bo.record_offsets:
            has = len(bo.record_checksums) > 0
            if has and len(bo.record_checksums) != len(bo.record_offsets):
                raise CorruptManifestError(f"{name}: bos[].record_checksums does not list every record",
                                           bo_id=bo.id)
            if bound is not None and has != bound:
                raise CorruptManifestError(f"{name}: bos[].record_checksums given for some BOs and not others",
                                           bo_id=bo.id)
            bound = has
        elif bo.record_checksums:
            raise CorruptManifestError(f"{name}: bos[].record_checksums for a BO without records", bo_id=bo.id)


def chunk_count(size: int, chunk_size: int) -> int:
    return ceil_div(size, chunk_size)


# --- data files ------------------------------------------------------------

def encode_data_header(image_id: bytes) -> bytes:
    return DATA_HEADER.pack(DATA_MAGIC, FORMAT_VERSION, 0, image_id)


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


def record_head_length(peek: Bytes, *, bo_id: int, offset: int, where: str) -> int:
    """From the first bytes of a record, how many precede the payload (prefix + header)."""
    if len(peek) < RECORD_PREFIX.size:
        raise CorruptChunkError(f"{where}: record shorter than its prefix", bo_id=bo_id, offset=offset)
    magic, hlen, _ = RECORD_PREFIX.unpack_from(peek)
    hlen = int(hlen)
    if magic != RECORD_MAGIC:
        raise CorruptChunkError(f"{where}: bad record magic", bo_id=bo_id, offset=offset)
    if hlen > MAX_CHUNK_HEADER or RECORD_PREFIX.size + hlen > len(peek):
        raise CorruptChunkError(f"{where}: implausible header length {hlen}", bo_id=bo_id, offset=offset)
    return RECORD_PREFIX.size + hlen


def decode_record_head(buf: Bytes, *, bo_id: int, offset: int, where: str,
                       record_checksum: int | None = None) -> tuple[pb.ChunkHeader, int]:
    """Validate a record's prefix and header; returns (header, bytes before the payload).

    `bo_id`/`offset` are what the manifest says this record holds; a record
    that claims anything else is treated as corrupt.  `record_checksum` is the
    manifest's `record_checksums` entry for it (None for an image written
    before records were bound): the record's header checksum must equal it,
    so a record of another image (same BO, offset and length) is rejected.
    """
    def bad(what: str) -> CorruptChunkError:
        return CorruptChunkError(f"{where}: {what}", bo_id=bo_id, offset=offset)

    head_len = record_head_length(buf, bo_id=bo_id, offset=offset, where=where)
    _, hlen, hsum = RECORD_PREFIX.unpack_from(buf)
    raw = bytes(buf[RECORD_PREFIX.size:RECORD_PREFIX.size + hlen])
    if checksum(raw) != hsum:
        raise bad("chunk header checksum mismatch")
    if record_checksum is not None and hsum != record_checksum:
        raise bad("record is not the one this image's manifest recorded (record checksum mismatch)")
    header = pb.ChunkHeader()
    try:
        header.ParseFromString(raw)
    except DecodeError:
        raise bad("undecodable chunk header") from None
    if header.bo_id != bo_id or header.offset != offset:
        raise bad("record holds another chunk than the manifest expects here")
    if header.codec not in CODEC_NAMES:
        raise bad(f"unknown codec {header.codec}")
    if header.codec == pb.CODEC_ZERO and header.stored_length:
        raise bad("hole chunk with a payload")
    if header.codec == pb.CODEC_RAW and header.stored_length != header.raw_length:
        raise bad("raw chunk whose stored and raw lengths differ")
    return header, head_len
