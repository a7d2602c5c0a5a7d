"""The transform stage: turn staged BO bytes into a chunk record and back.

Runs in CPU worker threads.  Dump side: detect holes, optionally compress
(one independent zstd frame per chunk, kept only if it shrinks), checksum
the stored payload.  Restore side: validate the record, verify the payload
checksum *before* anything is used, decompress straight into staging.
zstd frames also carry zstd's own content checksum, so compressed chunks
are verified end to end.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import CorruptChunkError
from ..hostmem.batchcopy import xor_into
from ..hostmem.libc import is_zero_ptr
from ..hostmem.staging import StagingBuffer
from ..pb import image_pb2 as pb
from .compression import Chooser
from .compression import Compression as Compression  # the one compression value (image/compression.py)
from .compression import compression_name as compression_name
from .format import (
    DELTA_CODECS,
    EMPTY_CHECKSUM,
    HEAD_PEEK,
    PLANES_CODECS,
    RECORD_PREFIX,
    Bytes,
    Where,
    check_record_header,
    checksum,
    decode_record_head,
    encode_record_head,
    record_checksum,
    record_prefix,
    where_text,
)
from .format import content_hash as content_hash_of
from .planes import compress_planes, decompress_planes, unzstd_exact, zstd_frame_length
from .planes import zstd_compressor as _compressor
from .policy import AutoPolicy


@dataclass
class EncodedChunk:
    head: bytes      # record prefix + chunk header
    payload: Bytes   # possibly empty
    codec: pb.Codec

    @property
    def record_length(self) -> int:
        return len(self.head) + len(self.payload)

    @property
    def record_checksum(self) -> int:
        """What the manifest lists for this record in `record_checksums` (binds it to the image)."""
        return record_checksum(self.head)


def encode_chunk(bo_id: int, offset: int, buf: StagingBuffer, length: int, compression: Compression,
                 buf_offset: int = 0, chash: bytes | None = None, chooser: Chooser | None = None,
                 digest: int | None = None) -> EncodedChunk:
    """Build the record for `length` staged bytes at `buf_offset` in `buf`.

    `chash`: format v2, the bytes' content hash (the caller found them not all zero).
    `chooser`: bplanes and auto, the per-chunk choice (`Compression.chooser`).
    `digest`: the bytes' xxh3-64 where the caller has it (a raw record's payload checksum).
    """
    codec: pb.Codec
    payload: Bytes
    word = 0
    if chash is None and is_zero_ptr(buf.ptr + buf_offset, length):
        codec, payload = pb.CODEC_ZERO, b""
    else:
        codec, payload = pb.CODEC_RAW, buf.view[buf_offset:buf_offset + length]
        packed = None
        if compression.mode == "zstd":
            packed, kind = _compressor(compression.level).compress(payload), pb.CODEC_ZSTD
        elif chooser is not None:
            choice = chooser.decide(payload) if isinstance(chooser, AutoPolicy) else chooser(payload)
            c = choice.codec
            if c.kind != "raw":
                t0 = time.thread_time()
                if c.kind == "planes":
                    packed, kind, word = compress_planes(payload, c.word, c.level), pb.CODEC_PLANES, c.word
                else:
                    packed, kind = _compressor(c.level).compress(payload), pb.CODEC_ZSTD
                if isinstance(chooser, AutoPolicy):
                    chooser.observe_compress(c, length, len(packed), time.thread_time() - t0)
        if packed is not None and len(packed) < length:
            codec, payload = kind, packed
        else:
            word = 0
    if not payload:
        digest = EMPTY_CHECKSUM
    elif codec != pb.CODEC_RAW or digest is None:
        digest = checksum(payload)
    return EncodedChunk(record_head(bo_id, offset, length, codec, len(payload), digest, chash or b"",
                                    word_size=word), payload, codec)


def encode_delta(bo_id: int, offset: int, xored: memoryview, level: int, chash: bytes,
                 base_hash: bytes, word: int = 0) -> EncodedChunk:
    """The record of a chunk stored as a delta: `xored` is its bytes XOR its base chunk's.  `word` 2 or 4:
    the XOR as byte planes (CODEC_XOR_PLANES); 0: as it is (CODEC_XOR, what the first v2 writers wrote)."""
    level = max(level, 1)
    if word:
        payload, codec = compress_planes(xored, word, level), pb.CODEC_XOR_PLANES
    else:
        payload, codec = _compressor(level).compress(xored), pb.CODEC_XOR
    return EncodedChunk(record_head(bo_id, offset, len(xored), codec, len(payload), checksum(payload), chash,
                                    word_size=word, base_hash=base_hash), payload, codec)


def record_head(bo_id: int, offset: int, length: int, codec: pb.Codec, stored_length: int, digest: int,
                chash: bytes = b"", *, word_size: int = 0, base_hash: bytes = b"") -> bytes:
    """The head (prefix + chunk header) of a record whose payload's xxh3-64 is `digest` (computed elsewhere);
    `chash` (format v2): the content hash of its raw bytes."""
    header = pb.ChunkHeader(bo_id=bo_id, offset=offset, raw_length=length, stored_length=stored_length, codec=codec,
                            checksum=digest if stored_length else EMPTY_CHECKSUM, content_hash=chash,
                            word_size=word_size, base_hash=base_hash)
    return encode_record_head(header)


class DecodedChunk(NamedTuple):
    """Where the raw bytes of a restored chunk are: a buffer and an offset in it (a named tuple: one is made
    per record a restore reads)."""

    buf: StagingBuffer | None  # None for a hole: the caller supplies zeros
    codec: pb.Codec
    offset: int = 0  # where in `buf` the raw bytes start


def decode_chunk(bo_id: int, offset: int, raw_length: int, head: bytes, stored: StagingBuffer,
                 stored_length: int, out: StagingBuffer | None, *, where: Where, buf_offset: int = 0,
                 digest: int | None = None, record_checksum: int | None = None,
                 content_hash: bytes | None = None, base: memoryview | None = None,
                 check_content: bool = False) -> DecodedChunk:
    """Validate a record whose head is `head` and whose payload sits at `buf_offset` in `stored`.

    Returns where the raw bytes are: `stored` itself (RAW), `out` after
    decompressing into it at the same `buf_offset` (ZSTD), or no buffer for
    a hole.  The payload checksum is verified before anything else looks at
    the payload.  `digest`: the payload's xxh3-64 where the caller computed
    it already (vramd.hostmem.batchcopy hashes while it reads).
    `record_checksum`: the manifest's entry for this record, if the image
    binds its records (see decode_record_head).
    `content_hash` (format v2): the chunk table's hash of the record; with
    `check_content`, the decoded bytes' BLAKE3 must equal it (records of a
    parent image less trusted than the child: ImageReader._parents_trusted).  `base`: a delta record's base chunk,
    raw (the caller read and checked it).
    """
    header, head_len = decode_record_head(head, bo_id=bo_id, offset=offset, where=where,
                                          record_checksum=record_checksum, content_hash=content_hash)
    if head_len != len(head):
        raise CorruptChunkError(f"{where_text(where)}: record length disagrees with its header (head of "
                                f"{head_len} bytes in {len(head)})", bo_id=bo_id, offset=offset)
    return _decode_payload(header, bo_id, offset, raw_length, stored, buf_offset, stored_length, out, where,
                           digest, content_hash, base, check_content)


def decode_record(bo_id: int, offset: int, raw_length: int, stored: StagingBuffer, at: int, length: int,
                  out: StagingBuffer | None, *, where: Where, hashed: tuple[int, int] | None = None,
                  record_checksum: int | None = None, content_hash: bytes | None = None,
                  base: memoryview | None = None, check_content: bool = False) -> tuple[DecodedChunk, int]:
    """`decode_chunk` of a whole record of `length` bytes read into `stored` at `at` (its head, then its
    payload); also returns the head's length.  `hashed`: (where the payload starts in the record, its
    xxh3-64) as the read computed them (batchcopy's RECORD hashing), used where that start is the
    head's end.  This is how every reader of an image checks a record it read: once per record."""
    view = stored.view
    head_len, hsum = record_prefix(view[at:at + min(length, HEAD_PEEK)], bo_id=bo_id, offset=offset, where=where)
    stored_length = length - head_len
    if stored_length > raw_length:
        raise CorruptChunkError(f"{where_text(where)}: record of {length} bytes for a {raw_length}-byte chunk",
                                bo_id=bo_id, offset=offset)
    header = check_record_header(view[at + RECORD_PREFIX.size:at + head_len], hsum, bo_id=bo_id, offset=offset,
                                 where=where, record_checksum=record_checksum, content_hash=content_hash)
    digest = hashed[1] if hashed is not None and hashed[0] == head_len else None
    return _decode_payload(header, bo_id, offset, raw_length, stored, at + head_len, stored_length, out, where,
                           digest, content_hash, base, check_content), head_len


def _decode_payload(header: pb.ChunkHeader, bo_id: int, offset: int, raw_length: int, stored: StagingBuffer,
                    buf_offset: int, stored_length: int, out: StagingBuffer | None, where: Where,
                    digest: int | None, content_hash: bytes | None, base: memoryview | None,
                    check_content: bool) -> DecodedChunk:
    """The payload of a record whose header is checked: its length and checksum, then decoded."""
    def bad(what: str) -> CorruptChunkError:
        return CorruptChunkError(f"{where_text(where)}: {what}", bo_id=bo_id, offset=offset)

    codec, stored_in_header, raw_in_header = header.codec, header.stored_length, header.raw_length
    if stored_in_header != stored_length:
        raise bad(f"record length disagrees with its header (stored {stored_in_header}, "
                  f"manifest implies {stored_length})")
    if raw_in_header != raw_length:
        raise bad(f"chunk covers {raw_in_header} bytes, expected {raw_length}")
    if codec == pb.CODEC_ZERO:
        if header.checksum != EMPTY_CHECKSUM:
            raise bad("hole chunk checksum mismatch")
        return DecodedChunk(None, codec)
    payload = stored.view[buf_offset:buf_offset + stored_length]
    try:
        if (checksum(payload) if digest is None else digest) != header.checksum:
            raise bad("payload checksum mismatch; the stored bytes are damaged")
        if codec == pb.CODEC_RAW:
            result = DecodedChunk(stored, codec, buf_offset)
        else:
            if out is None:
                raise bad("compressed chunk in an image whose manifest says it is uncompressed")
            if codec in PLANES_CODECS:
                decompress_planes(payload, header.word_size, raw_length, out.view[buf_offset:buf_offset + raw_length],
                                  bad)
            else:
                _unzstd(payload, out.view, buf_offset, raw_length, bad)
            if codec in DELTA_CODECS:
                if base is None or len(base) != raw_length:
                    raise bad("delta record without its base chunk")
                xor_into(out.view[buf_offset:buf_offset + raw_length], base)
            result = DecodedChunk(out, codec, buf_offset)
    finally:
        payload.release()
    if content_hash is not None and check_content:
        assert result.buf is not None
        view = result.buf.view[result.offset:result.offset + raw_length]
        try:
            if content_hash_of(view) != content_hash:
                raise bad("decoded bytes do not match the chunk's content hash")
        finally:
            view.release()
    return result


def _unzstd(payload: memoryview, dest: memoryview, dest_offset: int, raw_length: int,
            bad: Callable[[str], CorruptChunkError]) -> None:
    # exactly one whole frame, its 4-byte checksum included (zstd itself accepts a frame cut short there)
    if zstd_frame_length(payload) != len(payload):
        raise bad("zstd frame is cut short or followed by other bytes")
    out = dest[dest_offset:dest_offset + raw_length]
    try:
        unzstd_exact(payload, out, raw_length, bad)
    finally:
        out.release()
