"""An image's manifest (formats v1 to v3): its framing, encoded and decoded, and every check a manifest
passes before a reader trusts it (pure functions, no I/O); where a chunk's record is.

See docs/image-format.md.  A manifest that fails a check raises CorruptManifestError naming what is wrong.
"""
from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Sequence
from typing import Any

from google.protobuf.message import DecodeError

from ..errors import CorruptManifestError, InternalError, UnsupportedVersionError
from ..pb import image_pb2 as pb
from .format import (
    HASH_LEN,
    MAX_CHUNK,
    MIN_CHUNK,
    RECORD_OVERHEAD,
    SUPPORTED_VERSIONS,
    Bytes,
    checksum,
    chunk_count,
)
from .names import DATA_FILE_NAME, MANIFEST_NAME

MANIFEST_MAGIC = b"VRAMDMAN"
# magic, format version, reserved, body length, xxh3-64 of body
MANIFEST_PREFIX = struct.Struct("<8sIIQQ")
MAX_MANIFEST_BYTES = 1 << 30


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
    bos = list(m.bos)
    if not v2_refs_plausible(m, t, bos):
        check_v2_refs(m, name, t, bos)  # the first wrong entry names itself
        raise InternalError(f"{name}: the quick manifest check failed and the full one found nothing")


def v2_refs_plausible(m: pb.Manifest, t: TableView | None = None, bos: list[pb.BoEntry] | None = None) -> bool:
    """Whether `check_v2_refs` finds nothing wrong with a v2 manifest's chunk table and its BOs' references
    into it, answered over whole columns at once (a restore checks the table of 10,000 small BOs before it
    reads a byte).  `t`, `bos`: the table and BO list, where the caller has them already."""
    t = TableView(m.chunks) if t is None else t
    bos = list(m.bos) if bos is None else bos
    return _table_plausible(t, m.chunk_size, len(m.parents), len(m.files)) and _bos_plausible(bos, t, m.chunk_size)


def check_v2_refs(m: pb.Manifest, name: str, t: TableView | None = None,
                  bos: list[pb.BoEntry] | None = None) -> None:
    """The checks of `v2_refs_plausible`, one entry at a time, in order: raise CorruptManifestError naming
    the first wrong chunk table entry or BO."""
    t = TableView(m.chunks) if t is None else t
    bos = list(m.bos) if bos is None else bos
    _table_errors(t, m.chunk_size, len(m.parents), len(m.files), name)
    _bo_errors(bos, t, m.chunk_size, name)


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


def bo_chunk_count(m: pb.Manifest, bo: pb.BoEntry) -> int:
    """How many chunks `bo` has in the manifest (the range of `chunk_record`'s `i`)."""
    return len(bo.chunk_refs) if m.format_version >= 2 else len(bo.record_offsets)


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
