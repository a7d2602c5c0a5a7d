"""`vramctl flatten`: an incremental image copied into a self-contained one (no parents needed).

Every record the image's chunk table lists is read from wherever it lies
(the image or a parent), checked as a restore checks it (record binding,
payload checksum, a parent's decoded bytes against their content hash), and
written into the new image: a plain record byte for byte (its header and
checksum stay valid), a delta decoded against its base and stored whole
(zstd where that is smaller).  Entries no BO refers to (the bases of deltas)
are dropped; the others keep their order.  Memory: four chunk
buffers, whatever the image's size.  Offline: runs in the calling process
(file I/O in a worker thread), never in the daemon; through fds only, like
the rest of vramd.image (the files: vramd.imagedir.flatten).
"""
from __future__ import annotations

import asyncio
import mmap
from collections.abc import Sequence

from ..errors import InvalidRequestError
from ..hostmem.staging import StagingBuffer
from ..pb import image_pb2 as pb
from ..units import PAGE
from .codec import Compression, encode_chunk
from .format import Bytes
from .manifest import TableView
from .reader import ImageReader
from .writer import DataFileWriter, ImageWriter

FLATTENED_DELTAS = Compression("zstd", 3)  # how a delta, decoded against its base, is stored again


def check_flattenable(reader: ImageReader) -> None:
    """INVALID_REQUEST for an image with no parents to fold in (format v1)."""
    if reader.manifest.format_version < 2:
        raise InvalidRequestError("a format v1 image has no parents: it is self-contained already")


def flat_compression(reader: ImageReader) -> pb.Compression:
    """What the flat image's manifest says of its records: the image's compression, except that deltas are
    stored again as zstd where it says "none" (a reader of such an image has no buffer to decompress into)."""
    comp = reader.manifest.compression
    if reader.has_deltas and comp.codec == pb.CODEC_RAW and not comp.automatic:
        return FLATTENED_DELTAS.to_pb()
    return comp


def flat_gpus(reader: ImageReader) -> list[int]:
    """The GPUs the flat image has a data file for (one each), in the order its records first need them."""
    m = reader.manifest
    t = TableView(m.chunks)
    images = [m, *reader.parents]
    out: dict[int, None] = {}
    for i in sorted(_first_holders(m)):
        out.setdefault(images[t.image[i]].files[t.file_index[i]].gpu_id)
    return list(out)


async def flatten_into(reader: ImageReader, writer: ImageWriter) -> pb.Manifest:
    """Copy the image `reader` reads into `writer`: a new image whose data files (one for each of `flat_gpus`)
    are attached and whose manifest file is set, written through those fds only; the caller commits it
    (vramd.imagedir.flatten does both ends: the files opened and created with its rights)."""
    check_flattenable(reader)
    m = reader.manifest
    holders = _first_holders(m)  # the entries BOs refer to, and the first chunk needing each
    table, payloads, compressed = await asyncio.get_running_loop().run_in_executor(None, _copy, reader, writer,
                                                                                    holders)
    file_of = {f.gpu_id: f.index for f in writer.files.values()}
    bos = _bos(m, table, payloads, holders, file_of)
    totals = _totals(bos.bos, payloads)
    totals.compressed_records = compressed
    return await writer.commit(bos, totals, m.topology_json, chunks=table)


def _copy(reader: ImageReader, writer: ImageWriter,
          holder: dict[int, tuple[int, int]]) -> tuple[pb.ChunkTable, list[int], int]:
    """In a worker thread: every table entry's record into the new image; the new table, payload bytes each,
    how many records are compressed."""
    m = reader.manifest
    t = TableView(m.chunks)
    unit = PAGE + m.chunk_size + PAGE  # a record (head + payload) at offset PAGE, with room
    bufs = [StagingBuffer(unit, mmap.mmap(-1, unit)) for _ in range(4)]
    images = [m, *reader.parents]
    out = pb.ChunkTable()
    hashes = bytearray()
    payloads: list[int] = []
    compressed = 0  # holder: entry -> (bo id, offset) of the first chunk that needs it: errors name it
    compression = FLATTENED_DELTAS
    try:
        for i in sorted(holder):  # the entries BOs refer to (a delta's base only serves to decode it)
            hashes += t.hash(i)
            bo_id, bo_off = holder.get(i, (0, 0))
            loc = reader.locate_entry(i)
            raw_len = t.raw_length[i]
            gpu = images[t.image[i]].files[t.file_index[i]].gpu_id
            dst = writer.data_file(gpu)
            if loc.base is None:  # checked as a restore checks it, then copied byte for byte
                dec, head_len = reader.read_record(loc, bufs[0], bufs[1], PAGE, raw_len, bo_id=bo_id, offset=bo_off)
                compressed += dec.codec != pb.CODEC_RAW
                record = bufs[0].view[PAGE:PAGE + loc.length]
                try:
                    at = _put(dst, [record], loc.length, bo_id, bo_off)
                finally:
                    record.release()
                rsum, length, payload = loc.record_checksum, loc.length, loc.length - head_len
            else:  # a delta: decoded against its base, stored whole
                got = reader.read_raw(loc.base, bufs[2], bufs[3], PAGE, raw_len, bo_id=bo_id, offset=bo_off)
                assert got.buf is not None
                base = got.buf.view[got.offset:got.offset + raw_len]
                try:
                    dec, _ = reader.read_record(loc, bufs[0], bufs[1], PAGE, raw_len, bo_id=bo_id, offset=bo_off,
                                                base=base)
                finally:
                    base.release()
                assert dec.buf is not None
                enc = encode_chunk(bo_id, bo_off, dec.buf, raw_len, compression, dec.offset, loc.chash)
                rsum, length, payload = enc.record_checksum, enc.record_length, len(enc.payload)
                try:
                    at = _put(dst, [enc.head, enc.payload], length, bo_id, bo_off)
                finally:
                    if isinstance(enc.payload, memoryview):  # stored raw: a view of the buffer to unmap
                        enc.payload.release()
                compressed += enc.codec != pb.CODEC_RAW
            out.image.append(0)
            out.file_index.append(dst.index)
            out.offset.append(at)
            out.length.append(length)
            assert rsum is not None  # v2 records are always bound
            out.record_checksum.append(rsum)
            out.raw_length.append(raw_len)
            out.base.append(0)
            payloads.append(payload)
    finally:
        for b in bufs:
            b.unmap()
    out.hashes = bytes(hashes)
    return out, payloads, compressed


def _put(dst: DataFileWriter, iov: Sequence[Bytes], length: int, bo_id: int, bo_off: int) -> int:
    at = dst.reserve(length)
    dst.pwrite(iov, at, bo_id=bo_id, bo_offset=bo_off)
    return at


def _first_holders(m: pb.Manifest) -> dict[int, tuple[int, int]]:
    out: dict[int, tuple[int, int]] = {}
    for bo in m.bos:
        for c, ref in enumerate(bo.chunk_refs):
            if ref:
                out.setdefault(ref - 1, (bo.id, c * m.chunk_size))
    return out


def _bos(m: pb.Manifest, table: pb.ChunkTable, payloads: list[int], holders: dict[int, tuple[int, int]],
         file_of: dict[int, int]) -> pb.Manifest:
    """The BOs as they were, referring to the new table (its entries: the old ones BOs refer to, in order),
    their byte counts as the new image holds them (nothing from parents); in a manifest holding only them
    (what ImageWriter.commit takes)."""
    new = {old: i for i, old in enumerate(sorted(holders))}
    seen: set[int] = set()
    out = pb.Manifest()
    for bo in m.bos:
        e = out.bos.add()
        e.CopyFrom(bo)
        e.stored_bytes = e.dedup_bytes = e.parent_bytes = e.delta_bytes = 0
        e.file_index = file_of.get(bo.gpu_id, 0)  # the new image's data file of the BO's GPU
        del e.chunk_refs[:]
        for ref in bo.chunk_refs:
            if not ref:
                e.chunk_refs.append(0)
                continue
            i = new[ref - 1]
            e.chunk_refs.append(i + 1)
            if i in seen:
                e.dedup_bytes += table.raw_length[i]
            else:
                seen.add(i)
                e.stored_bytes += payloads[i]
    return out


def _totals(bos: Sequence[pb.BoEntry], payloads: list[int]) -> pb.Totals:
    return pb.Totals(bo_count=len(bos), bo_bytes=sum(b.size for b in bos), stored_bytes=sum(payloads),
                     zero_bytes=sum(b.zero_bytes for b in bos), chunk_count=sum(len(b.chunk_refs) for b in bos),
                     dedup_bytes=sum(b.dedup_bytes for b in bos), record_count=len(payloads))
