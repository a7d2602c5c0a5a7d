"""Image formats v1 and v2: the byte layout, as pure functions (no I/O).

See docs/image-format.md for the specification.  Everything here turns
bytes into validated values or values into bytes, raising typed errors that
name the file, BO and offset involved.
"""
from __future__ import annotations

import itertools
import operator
import re
import struct
from collections.abc import Callable, Sequence
from typing import Any

import blake3
import xxhash
from google.protobuf.message import DecodeError

from ..errors import (
    CorruptChunkError,
    CorruptManifestError,
    ForeignDataFileError,
    InternalError,
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

HASH_LEN = 32  # BLAKE3-256: a chunk's identity in format v2 (dedup, parents)


def content_hash(data: Bytes) -> bytes:
    """BLAKE3-256 of a chunk's raw bytes (format v2's chunk identity; see docs/image-format.md)."""
    # blake3 releases the GIL on large inputs, so copy threads hash in parallel.
    return blake3.blake3(data).digest()


FORMAT_VERSION = 3  # what this writer writes
SUPPORTED_VERSIONS = frozenset({1, 2, 3})
MAX_STRIPES = 16  # data files a GPU's records may be spread over (format v3: stripes 0-15, one hex digit)

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
MAX_CHUNK_HEADER = 256  # a ChunkHeader encodes to at most ~45 bytes (v2: ~120)
RECORD_OVERHEAD = RECORD_PREFIX.size + MAX_CHUNK_HEADER  # a record is at most this plus its raw bytes

Codec = pb.Codec
CODEC_NAMES = {pb.CODEC_RAW: "raw", pb.CODEC_ZERO: "zero", pb.CODEC_ZSTD: "zstd", pb.CODEC_PLANES: "bplanes",
               pb.CODEC_XOR: "xor", pb.CODEC_XOR_PLANES: "xor-planes"}
V1_CODECS = frozenset({pb.CODEC_RAW, pb.CODEC_ZERO, pb.CODEC_ZSTD})
DELTA_CODECS = frozenset({pb.CODEC_XOR, pb.CODEC_XOR_PLANES})  # a record that is the XOR of its bytes and a base's
PLANES_CODECS = frozenset({pb.CODEC_PLANES, pb.CODEC_XOR_PLANES})  # a record whose frame holds byte planes


def data_file_name(image_id: bytes, gpu_id: int, stripe: int = 0) -> str:
    """A data file's name: the GPU's first (stripe 0) as every version names it; format v3's further
    stripes of the same GPU with the stripe number after it."""
    if not 0 <= stripe < MAX_STRIPES:
        raise ValueError(f"stripe {stripe} is not below {MAX_STRIPES}")
    tail = f"-{stripe:x}" if stripe else ""
    return f"data-{image_id.hex()[:16]}-{gpu_id:08x}{tail}.vrd"


# The only names a manifest may give a data file: exactly what data_file_name produces.
# A plain name of this format cannot be ".", "..", a path, or any file vramd did not write
# under this pattern, so a reader never opens, and a dump never removes, anything else.
DATA_FILE_NAME = re.compile(r"data-[0-9a-f]{16}-[0-9a-f]{8}(-[1-9a-f])?\.vrd")
# vramd's own temporaries: a dump's data files before commit, and its manifest before the rename.
DATA_FILE_TMP = re.compile(r"data-[0-9a-f]{16}-[0-9a-f]{8}(-[1-9a-f])?\.vrd\.tmp")
MANIFEST_TMP = re.compile(r"\.manifest\.vrdm\.[0-9a-f]{32}\.tmp")


# A child image's mark in each directory of its parent chain (format v2): `.child.<child image id, 32 hex>`.
# An image with marks is needed by incremental images; a dump does not replace it unless told to.
CHILD_MARK = re.compile(r"\.child\.[0-9a-f]{32}")


def child_mark_name(image_id: bytes) -> str:
    return f".child.{image_id.hex()}"


# A mark's content names its child: the child's image id and the child's directory, relative to the directory
# the mark is in and absolute, so that `vramctl rm` of the child removes only its own marks and `vramctl gc` of
# the parent can tell a stale mark (its child gone, or holding another image) from a live one: the relative
# path finds a child moved along with its parent, the absolute one a child whose parent moved alone.  Marks
# made before this content existed are empty: they name no child.
CHILD_MARK_HEAD = b"vramd child mark 1\n"
MAX_CHILD_MARK_BYTES = 16384


def child_mark_content(image_id: bytes, relative: bytes, absolute: bytes) -> bytes:
    """What a mark holds, four lines: its head, `image <32 hex>`, `path <the child's directory, relative to
    the mark's>`, `abs <the child's directory>` (a path holding a newline is not recorded: empty)."""
    rel = b"" if b"\n" in relative else relative
    ab = b"" if b"\n" in absolute else absolute
    return CHILD_MARK_HEAD + b"image " + image_id.hex().encode() + b"\npath " + rel + b"\nabs " + ab + b"\n"


def parse_child_mark(data: bytes) -> tuple[bytes, list[bytes]] | None:
    """A mark's image id and the paths it records for its child (the relative one first; empty ones left
    out), or None where it is not one this format makes (an empty, older mark too)."""
    lines = data.split(b"\n")
    if len(lines) != 5 or lines[0] + b"\n" != CHILD_MARK_HEAD or lines[4] or b"\0" in data:
        return None
    image, rel, ab = lines[1:4]
    if not (image.startswith(b"image ") and rel.startswith(b"path ") and ab.startswith(b"abs ")):
        return None
    hexid = image[6:]
    if not re.fullmatch(rb"[0-9a-f]{32}", hexid):
        return None
    return bytes.fromhex(hexid.decode()), [p for p in (rel[5:], ab[4:]) if p]


# The directory's lock (image/local.py, lock_directory): a regular file of the directory's owner, mode 0600,
# that exists while a dump, an rm or a gc holds it (and after a crash: then it is harmless).
LOCK_NAME = ".lock"


def is_data_file_name(name: str) -> bool:
    return DATA_FILE_NAME.fullmatch(name) is not None


def is_own_temporary(name: str) -> bool:
    """A name only a vramd dump creates, and only until its commit (see image/local.py, sweep_temporaries)."""
    return DATA_FILE_TMP.fullmatch(name) is not None or MANIFEST_TMP.fullmatch(name) is not None


def manifest_tmp_name(image_id: bytes) -> str:
    return f".{MANIFEST_NAME}.{image_id.hex()}.tmp"


# Chunk sizes a writer uses (EngineConfig.check): a multiple of 4 KiB, at most 1 GiB.
MIN_CHUNK = 4096
MAX_CHUNK = 1 << 30


# --- manifest --------------------------------------------------------------

# Building a big manifest off the event loop still takes the GIL for as long as one protobuf call runs:
# setting 49,152 BO entries in one call held it ~100 ms, stalling every other client's answer.  Lists go
# into protobuf fields in slices of this many items; the GIL changes hands between the calls.
FILL_SLICE = 2048


def fill(field: Any, items: Sequence[Any]) -> None:
    """`field.extend(items)` (a repeated protobuf field), a slice per call."""
    for i in range(0, len(items), FILL_SLICE):
        field.extend(items[i:i + FILL_SLICE])


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
        match = DATA_FILE_NAME.fullmatch(df.name)
        if match is None or (match[1] and m.format_version < 3):
            raise CorruptManifestError(
                f"{name}: files[{i}].name is not a data file name of this format (data-<16 hex>-<8 hex>.vrd"
                + (", or data-<16 hex>-<8 hex>-<stripe 1-f>.vrd)" if m.format_version >= 3 else ")"))
        if df.name in names:
            raise CorruptManifestError(f"{name}: files[{i}].name lists a data file twice")
        names.add(df.name)
    if m.format_version >= 2:
        _check_v2(m, name)
        return
    if m.HasField("chunks") or m.parents:
        raise CorruptManifestError(f"{name}: a format v1 manifest with a v2 chunk table or parents")
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
        for i, length in enumerate(bo.record_lengths):
            if length > RECORD_OVERHEAD + min(m.chunk_size, bo.size - i * m.chunk_size):
                raise CorruptManifestError(f"{name}: record of chunk {i} is longer than any record of its chunk",
                                           bo_id=bo.id)
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


def _check_v2(m: pb.Manifest, name: str) -> None:
    """A v2 manifest: BOs reach their records through the chunk table; parents name whole images."""
    t = TableView(m.chunks)
    n = len(t.image)
    if len(t.hashes) != HASH_LEN * n or any(
            len(lst) != n for lst in (t.file_index, t.offset, t.length, t.record_checksum, t.raw_length, t.base)):
        raise CorruptManifestError(f"{name}: chunk table lists differ in length")
    ids = {m.image_id}
    for i, p in enumerate(m.parents):
        if len(p.image_id) != 16 or len(p.manifest_hash) != HASH_LEN:
            raise CorruptManifestError(f"{name}: parents[{i}] has a malformed image id or manifest hash")
        if p.image_id in ids:
            raise CorruptManifestError(f"{name}: parents[{i}] repeats an image of the chain (a parent chain loop)")
        ids.add(p.image_id)
    nparents, nfiles = len(m.parents), len(m.files)
    bos = list(m.bos)
    if not (_table_plausible(t, m.chunk_size, nparents, nfiles) and _bos_plausible(bos, t, m.chunk_size)):
        # the same checks one entry at a time, in order: the first wrong one names itself
        _table_errors(t, m.chunk_size, nparents, nfiles, name)
        _bo_errors(bos, t, m.chunk_size, name)
        raise InternalError(f"{name}: the quick manifest check failed and the full one found nothing")


def _table_plausible(t: TableView, chunk_size: int, nparents: int, nfiles: int) -> bool:
    """`_table_errors` finds nothing (the same checks, each over a whole column at once: a restore
    checks the table of 10,000 small BOs before it reads a byte)."""
    n = len(t)
    if not n:
        return True
    if max(t.image) > nparents or min(t.raw_length) <= 0 or max(t.raw_length) > chunk_size:
        return False
    if max(map(operator.sub, t.length, t.raw_length)) > RECORD_OVERHEAD:
        return False
    if max(itertools.compress(t.file_index, map(operator.not_, t.image)), default=-1) >= nfiles:
        return False
    for i in itertools.compress(range(n), t.base):  # the deltas only
        base = t.base[i]
        if base > n or base - 1 == i or t.base[base - 1] or t.raw_length[base - 1] != t.raw_length[i]:
            return False
    return True


def _bos_plausible(bos: list[pb.BoEntry], t: TableView, chunk_size: int) -> bool:
    """`_bo_errors` finds nothing (the per-BO part, with each BO's fields read once)."""
    n, raw_length = len(t), t.raw_length
    ids: set[int] = set()
    for bo in bos:
        bo_id, size, refs = bo.id, bo.size, bo.chunk_refs
        if bo_id in ids or bo.record_offsets or bo.record_lengths or bo.record_checksums:
            return False
        ids.add(bo_id)
        whole, tail = divmod(size, chunk_size)
        if len(refs) != whole + (tail > 0):
            return False
        for c, ref in enumerate(refs):
            if ref > n or (ref and raw_length[ref - 1] != (chunk_size if c < whole else tail)):
                return False
    return True


def _table_errors(t: TableView, chunk_size: int, nparents: int, nfiles: int, name: str) -> None:
    """Raise the first wrong entry of a v2 chunk table."""
    n = len(t)
    for i in range(n):
        img, base = t.image[i], t.base[i]
        if img > nparents:
            raise CorruptManifestError(f"{name}: chunks[{i}] refers to parent #{img}; the image lists {nparents}")
        if img == 0 and t.file_index[i] >= nfiles:
            raise CorruptManifestError(f"{name}: chunks[{i}] refers to data file #{t.file_index[i]}")
        if not 0 < t.raw_length[i] <= chunk_size:
            raise CorruptManifestError(f"{name}: chunks[{i}] holds {t.raw_length[i]} bytes at chunk size "
                                       f"{chunk_size}")
        if t.length[i] > RECORD_OVERHEAD + t.raw_length[i]:  # a reader reads the whole record into the slot
            raise CorruptManifestError(f"{name}: chunks[{i}] is a record longer than any of its bytes")
        if base and (base > n or base - 1 == i or t.base[base - 1]):
            raise CorruptManifestError(f"{name}: chunks[{i}] has a base that is missing, itself or a delta")
        if base and t.raw_length[base - 1] != t.raw_length[i]:
            raise CorruptManifestError(f"{name}: chunks[{i}] and its base differ in length")


def _bo_errors(bos: list[pb.BoEntry], t: TableView, chunk_size: int, name: str) -> None:
    """Raise the first wrong BO entry of a v2 manifest."""
    n = len(t)
    seen = set()
    for bo in bos:
        if bo.id in seen:
            raise CorruptManifestError(f"{name}: BO listed twice", bo_id=bo.id)
        seen.add(bo.id)
        if bo.record_offsets or bo.record_lengths or bo.record_checksums:
            raise CorruptManifestError(f"{name}: a format v2 BO with v1 record lists", bo_id=bo.id)
        nchunks = chunk_count(bo.size, chunk_size)
        if len(bo.chunk_refs) != nchunks:
            raise CorruptManifestError(
                f"{name}: {len(bo.chunk_refs)} chunk refs for {bo.size} bytes at chunk size {chunk_size}",
                bo_id=bo.id)
        for c, ref in enumerate(bo.chunk_refs):
            if ref > n:
                raise CorruptManifestError(f"{name}: chunk {c} refers to chunk table entry #{ref - 1}; the table "
                                           f"has {n}", bo_id=bo.id)
            if ref:
                want = min(chunk_size, bo.size - c * chunk_size)
                if t.raw_length[ref - 1] != want:
                    raise CorruptManifestError(f"{name}: chunk {c} ({want} bytes) refers to a record of "
                                               f"{t.raw_length[ref - 1]} bytes", bo_id=bo.id)


class TableView:
    """A v2 chunk table read once into plain lists (each access to a protobuf field builds a new object:
    the hashes blob alone is 32 bytes per entry, copied on every read of `hashes`)."""

    def __init__(self, table: pb.ChunkTable) -> None:
        self.hashes = bytes(table.hashes)
        self.image, self.file_index = list(table.image), list(table.file_index)
        self.offset, self.length = list(table.offset), list(table.length)
        self.record_checksum, self.raw_length = list(table.record_checksum), list(table.raw_length)
        self.base = list(table.base)

    def __len__(self) -> int:
        return len(self.image)

    def hash(self, i: int) -> bytes:
        """Entry `i`'s content hash."""
        return self.hashes[i * HASH_LEN:(i + 1) * HASH_LEN]


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


# --- where a chunk's record is (either version) -----------------------------

def chunk_record(m: pb.Manifest, bo: pb.BoEntry, i: int) -> tuple[int, int, int, int | None] | None:
    """Chunk `i` of `bo`'s record in this image's own data files: (file index, offset, length, record
    checksum or None); None where the image holds no record of its own for it (a v2 hole, or a chunk
    referring to a parent's record).  A v1 hole has a record (a header without payload)."""
    if m.format_version < 2:
        bound = bo.record_checksums
        return bo.file_index, bo.record_offsets[i], bo.record_lengths[i], bound[i] if bound else None
    ref = bo.chunk_refs[i]
    if not ref or m.chunks.image[ref - 1]:
        return None
    t = m.chunks
    return t.file_index[ref - 1], t.offset[ref - 1], t.length[ref - 1], t.record_checksum[ref - 1]
