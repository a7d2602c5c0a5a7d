"""The dump job's pipeline ends: BOs -> a new image's records (format v3: v2, a GPU's records in one or more
data files).  The job itself (its BOs, its parents, the manifest) is dump_job.py's.

Fill copies BO bytes into staging; transform finds each piece's fate (a
hole; bytes a record of this image or of a parent holds already, by their
BLAKE3 content hash: `image.chunks.ChunkIndex`; or a record of its own,
encoded by the image's codec, or as an XOR delta against the parent's chunk
where that is smaller); drain writes the new records; finish builds the
chunk table and writes the manifest (the client commits the image, in-process
too: vramd.inproc drives a session).  Where every piece of a batch is a CPU
copy, one copy thread does all three for the batch (`DumpEnds.run`): one
batchcopy call copies, scans for zeros and hashes (xxh3), then the content
hashes, the encoding and the writes, into the first of the GPU's data files
no other copy thread is writing (`ImageWriter.claim`).  A batch that is one
big raw piece is written with O_DIRECT where the file system allows it
(`DIRECT_MIN`): its
head sits in the slot's head page right before the payload, so the record
goes from staging to the disk with no CPU copy, at a page-aligned file
offset (the bytes before the head in that page, and after the payload up to
the next page, are zeros between records; the manifest lists each record's
offset and length, so readers never see them).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...backends import land_all
from ...errors import InternalError, JobError, VramdError
from ...hostmem.batchcopy import HASH, ZERO, copy_batch, xor_into
from ...hostmem.libc import ffi as libc_ffi
from ...hostmem.libc import is_zero_ptr, libc
from ...hostmem.staging import StagingBuffer
from ...image.chunks import PARENT, STORE, ChunkIndex, Entry
from ...image.codec import Compression, EncodedChunk, encode_chunk, encode_delta, record_head
from ...image.format import Bytes, content_hash, record_checksum
from ...image.policy import AutoPolicy
from ...image.reader import ImageReader
from ...image.writer import DataFileWriter, ImageWriter
from ...pb import image_pb2 as pb
from ...units import PAGE, round_up
from ..pipeline import HEAD_PAGE, ChunkTask, Clock, Pipeline, StageTimes, blame, settle
from .common import BoSpec, CopiedBo, landed, submit_batch

DIRECT_MIN = 256 << 10  # a piece this big, alone in its batch, is written with O_DIRECT where possible

HOLE = "hole"  # a piece's kind besides chunks.STORE / DUP / PARENT: all zero, no record

DEFAULT_MAX_CHAIN = 8  # parents an incremental image may have (EngineConfig.max_chain_depth)
DELTA_GIVE_UP = 4      # a BO whose chunks lost this many delta trials in a row stops trying
# A delta is kept only where it is smaller than the chunk's plain record by at least this fraction of the chunk's
# raw length.  Every restore pays for a delta with a second record read and decode (its base's): on the bench
# corpus (bench/README.md, image_size.py), deltas of Adam moments and gradients that saved 0.3-22 % made a 3-deep
# chain restore at 0.82-0.88 x its flattened copy.  Fine-tuned bf16 weights (deltas ~2 % of the chunk), fp32
# master weights and changed KV-cache slots (both saving a quarter to a half) keep theirs.
DELTA_MIN_SAVING = 0.25
# A delta is stored as byte planes of 4-byte words (CODEC_XOR_PLANES): where a changed number's high bytes (sign,
# exponent) did not change, its XOR's high planes are long zero runs.  On the bench corpus's changed fp32 master
# weights that is 19 % smaller than the XOR as it is (CODEC_XOR) and decodes 1.9 x as fast (zstd decodes long
# runs cheaply, and a word-interleaved XOR is a stream of short sequences); 4-byte planes also keep bf16 and fp16
# words' high bytes apart.
DELTA_WORD = 4


def dump_buffers(compression: Compression, *, incremental: bool) -> int:
    """Staging buffers a dump's batch takes a chunk.  zstd output is a fresh bytes object of at most
    chunk_size bytes: a second buffer reserves budget for it (it is never touched itself).  A delta trial
    reads the parent's chunk: two more (its record, its bytes)."""
    return 4 if incremental else compression.buffers_per_chunk


@dataclass
class Piece:
    """What became of one piece of a batch: a hole, a reference to a record stored elsewhere, or a record."""

    kind: str
    chash: bytes = b""
    enc: EncodedChunk | None = None  # STORE, three-stage path: the encoded record
    base: bytes = b""                # STORE as a delta: the base chunk's content hash
    at: int = 0                      # STORE, once written: the record's file offset, length and checksum,
    length: int = 0                  # and its payload's length
    rsum: int = 0
    payload: int = 0
    file: int = -1                   # and the index of the data file that holds it


@dataclass(eq=False)
class DumpBo(CopiedBo):
    """A BO being dumped: where its bytes come from, and what became of each chunk."""

    spec: BoSpec | None = None
    file: DataFileWriter | None = None
    # Per chunk, appended as they land (in any order): chunk index -> (record number in the image's
    # ChunkIndex, or -1: refers to a record by hash, -2: a hole; the content hash).  Empty until bytes
    # move, so a BO costs the same memory whatever size it declares.
    refs: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    alias_of: DumpBo | None = None  # the same dmabuf (inode, offset, size) as that BO: copied once, by it
    stored_bytes: int = 0
    zero_bytes: int = 0
    dedup_bytes: int = 0
    parent_bytes: int = 0
    delta_bytes: int = 0
    delta_misses: int = 0  # delta trials lost in a row (DELTA_GIVE_UP)
    compressed_records: int = 0

    def chunk_refs(self, nchunks: int) -> list[tuple[int, bytes]]:
        """Every chunk's (record number | -1 | -2, hash), in chunk order; every chunk must have landed once."""
        refs = (self.alias_of if self.alias_of is not None else self).refs
        try:
            if len(refs) == nchunks:  # and then every index below nchunks is there, or this raises KeyError
                return [refs[i] for i in range(nchunks)]
        except KeyError:
            pass
        raise JobError(f"internal error: {len(refs)} chunks landed of {nchunks}", bo_id=self.id)


class DumpEnds:
    def __init__(self, writer: ImageWriter, compression: Compression, chunk_size: int, direct: bool = True, *,
                 index: ChunkIndex | None = None, parent: ImageReader | None = None, workers: int = 1) -> None:
        self.writer = writer
        self.compression = compression
        self.chunk_size = chunk_size
        self.index = index if index is not None else ChunkIndex()
        self.parent = parent  # an incremental dump: chunks changed since the parent are tried as deltas
        self.buffers_per_chunk = dump_buffers(compression, incremental=parent is not None)
        self.direct = direct  # try O_DIRECT for big pieces (DataFileWriter.direct_fd: the writer's opening rules)
        self.chooser = compression.chooser(workers)  # bplanes / auto: each chunk's codec
        self.policy = self.chooser if isinstance(self.chooser, AutoPolicy) else None
        self.plain = compression.mode == "none" and parent is None  # records are the staged bytes as they are
        # Whether the job has stopped (failed or cancelled: Pipeline.stopped, set by DumpJob).  A batch looks
        # before each piece's encoding and before its write, so that once a job stops, a copy thread finishes
        # at most the piece it is encoding and writes nothing more (docs/engine.md, Cancelling).
        self.stopped: Callable[[], bool] = lambda: False

    # --- a whole batch in one copy thread (InlineEnds) ----------------------

    def inline(self, tasks: list[ChunkTask[DumpBo]]) -> bool:
        return all(t.bo.copier is not None for t in tasks)

    def run(self, tasks: list[ChunkTask[DumpBo]], bufs: list[StagingBuffer],
            times: StageTimes | None) -> list[Piece]:
        """Copy, scan and hash the batch (one batchcopy call), hash each non-zero piece's content, then write
        the records of the pieces no record holds yet (in this copy thread; an OSError of the data file is the
        writer's typed error naming it and the BO)."""
        buf = bufs[0]
        clock = Clock(times)
        copies = []
        for t in tasks:
            copier, handle = t.bo.copier, t.bo.handle
            assert copier is not None and handle is not None  # set by add(), dropped only when done
            copies.append(copier.plan(handle, t.offset, buf.address + t.buf_offset, t.length))
        clock.lap("python")
        outcomes, failed = copy_batch(copies, HASH | ZERO)
        clock.lap("copy")
        landed(tasks, outcomes, failed)
        self._check_going(tasks[0])
        pieces = [self._identify(t, buf, o.zero) for t, o in zip(tasks, outcomes)]
        clock.lap("hash")
        recs: list[tuple[ChunkTask[DumpBo], Piece, bytes]] = []
        for t, o, p in zip(tasks, outcomes, pieces):
            if p.kind == STORE:
                self._check_going(t)
                try:
                    if self.plain:
                        head = record_head(t.bo.id, t.offset, t.length, pb.CODEC_RAW, t.length, o.hash, p.chash)
                    else:
                        head = self._encode(t, bufs, p, o.hash).head
                        if p.enc is not None and p.enc.codec == pb.CODEC_RAW:
                            p.enc = None  # raw after all: written from staging as `none` writes it
                    recs.append((t, p, head))
                except VramdError:
                    raise
                except Exception as e:
                    blame(e, t)
                    raise
        clock.lap("encode")
        if recs:
            self._check_going(recs[0][0])
            gpu = tasks[0].bo.gpu_id
            assert all(t.bo.gpu_id == gpu for t in tasks)  # one lane = one GPU: its data files
            t0 = recs[0][0]
            direct = len(recs) == 1 and recs[0][1].enc is None and t0.length >= DIRECT_MIN and self.direct
            with self.writer.claim(gpu, direct=direct) as file:
                start = time.perf_counter()  # what the sink takes, not the wait for a file
                if direct and file.direct_fd() is not None:
                    self._write_direct(file, t0, buf, recs[0][2], recs[0][1])
                else:
                    self._write(file, buf, recs)
            if self.policy is not None:
                self.policy.observe_sink(sum(p.length for _t, p, _h in recs), time.perf_counter() - start)
            clock.lap("write")
        return pieces

    def _check_going(self, t: ChunkTask[DumpBo]) -> None:
        """Raise (the batch is dropped) if the job has stopped: no more encoding or writing for it."""
        if self.stopped():
            raise Pipeline.dropped(t)

    def _encode(self, t: ChunkTask[DumpBo], bufs: list[StagingBuffer], p: Piece,
                digest: int | None = None) -> EncodedChunk:
        """A piece that needs a record of its own: compressed by the image's choice, or a delta against the
        parent's chunk where that is smaller.  `digest`: the staged bytes' xxh3-64, where known."""
        p.enc = encode_chunk(t.bo.id, t.offset, bufs[0], t.length, self.compression, t.buf_offset, p.chash,
                             self.chooser, digest)
        if self.parent is not None:
            self._try_delta(t, bufs, p)
        return p.enc

    def _identify(self, t: ChunkTask[DumpBo], buf: StagingBuffer, zero: int) -> Piece:
        """A piece's bytes: a hole, or their content hash and whether a record holds them already."""
        if zero:
            return Piece(HOLE)
        view = buf.view[t.buf_offset:t.buf_offset + t.length]
        try:
            chash = content_hash(view)
        finally:
            view.release()
        return Piece(self.index.claim(chash), chash)

    def _write_direct(self, file: DataFileWriter, t: ChunkTask[DumpBo], buf: StagingBuffer, head: bytes,
                      p: Piece) -> None:
        """One record as one aligned O_DIRECT write: [zeros, head | payload, zeros] at a page-aligned offset."""
        slot, n, h = t.buf_offset, t.length, len(head)
        assert h <= HEAD_PAGE and slot >= HEAD_PAGE
        end = slot + round_up(n, PAGE)
        base = buf.address
        libc.memset(libc_ffi.cast("char *", base + slot - HEAD_PAGE), 0, HEAD_PAGE - h)
        buf.view[slot - h:slot] = head
        if end > slot + n:
            libc.memset(libc_ffi.cast("char *", base + slot + n), 0, end - slot - n)
        at = file.reserve(end - slot + HEAD_PAGE, PAGE)
        view = buf.view[slot - HEAD_PAGE:end]
        try:
            file.pwrite([view], at, bo_id=t.bo.id, bo_offset=t.offset, direct=True)
        finally:
            view.release()
        p.at, p.length, p.rsum, p.payload, p.file = at + HEAD_PAGE - h, h + n, record_checksum(head), n, file.index

    def _write(self, file: DataFileWriter, buf: StagingBuffer,
               recs: list[tuple[ChunkTask[DumpBo], Piece, bytes]]) -> None:
        """The batch's records back to back, one buffered pwritev (a payload: the encoded one, else the
        staged bytes)."""
        iov: list[Bytes] = []
        sizes = []
        for t, p, head in recs:
            iov.append(head)
            payload = p.enc.payload if p.enc is not None else buf.view[t.buf_offset:t.buf_offset + t.length]
            if len(payload):
                iov.append(payload)
            sizes.append(len(payload))
        at = file.reserve(sum(len(head) + n for (_t, _p, head), n in zip(recs, sizes)))
        try:
            file.pwrite(iov, at, bo_id=recs[0][0].bo.id, bo_offset=recs[0][0].offset)
        finally:
            for v in iov:
                if isinstance(v, memoryview):
                    v.release()
        for (_t, p, head), n in zip(recs, sizes):
            p.at, p.length, p.rsum, p.payload, p.file = at, len(head) + n, record_checksum(head), n, file.index
            at += p.length

    def landed(self, tasks: list[ChunkTask[DumpBo]], pieces: list[Piece]) -> None:
        """On the event loop, after `run` or `drain`: what became of each piece, into its BO."""
        for t, p in zip(tasks, pieces):
            bo = t.bo
            if p.kind == HOLE:
                bo.refs[t.index] = (-2, b"")
                bo.zero_bytes += t.length
                continue
            if p.kind != STORE:
                bo.refs[t.index] = (-1, p.chash)
                if p.kind == PARENT:
                    bo.parent_bytes += t.length
                else:
                    bo.dedup_bytes += t.length
                continue
            if p.file < 0:
                raise InternalError(f"a record of chunk {t.index} was stored in no data file", bo_id=bo.id,
                                    offset=t.offset)
            number = self.index.stored(Entry(0, p.file, p.at, p.length, p.rsum, t.length, p.chash, p.base))
            bo.refs[t.index] = (number, p.chash)
            bo.stored_bytes += p.payload
            if p.enc is not None and p.enc.codec != pb.CODEC_RAW:
                bo.compressed_records += 1
            if p.base:
                bo.delta_bytes += t.length

    # --- the three stages ----------------------------------------------------

    def bo_done(self, bo: DumpBo) -> None:
        bo.release()

    async def fill(self, tasks: list[ChunkTask[DumpBo]], bufs: list[StagingBuffer]) -> None:
        buf = bufs[0]
        copies = []
        for t in tasks:
            assert t.bo.backend is not None and t.bo.handle is not None  # set by add(), dropped only when done
            copies.append((t.bo.backend, (t.bo.handle, t.offset, buf, t.buf_offset, t.length)))
        await settle(submit_batch(copies))

    def transform(self, tasks: list[ChunkTask[DumpBo]], bufs: list[StagingBuffer], _filled: None) -> list[Piece]:
        buf = bufs[0]
        out = []
        for t in tasks:
            try:
                p = self._identify(t, buf, is_zero_ptr(buf.ptr + t.buf_offset, t.length))
                if p.kind == STORE:
                    self._check_going(t)
                    self._encode(t, bufs, p)
                out.append(p)
            except VramdError:
                raise
            except Exception as e:
                blame(e, t)
                raise
        return out

    def _sink_observer(self, nbytes: int) -> Callable[[asyncio.Future[None]], None]:
        """Tells auto how fast the sink took `nbytes` (queued in the writer thread: an upper bound of the
        write's own time, which is what the pipeline waits for)."""
        start = time.perf_counter()

        def done(f: asyncio.Future[None]) -> None:
            if self.policy is not None and not f.cancelled() and f.exception() is None:
                self.policy.observe_sink(nbytes, time.perf_counter() - start)
        return done

    def _try_delta(self, t: ChunkTask[DumpBo], bufs: list[StagingBuffer], p: Piece) -> None:
        """Store the piece as its XOR against the parent's chunk at the same BO offset, where that saves at
        least DELTA_MIN_SAVING of the chunk's length.

        The base is always a plain record (a delta's own base where the parent's chunk is a delta), so a
        restore reads at most two records for a chunk, however deep the chain."""
        parent, bo = self.parent, t.bo
        assert parent is not None and p.enc is not None
        entry = parent.bos.get(bo.id)
        if entry is None or entry.size != bo.size or bo.delta_misses >= DELTA_GIVE_UP:
            return
        loc = parent.locate(entry, t.index)
        if loc is None:
            return  # a hole in the parent: XOR against zeros is the chunk itself
        if loc.base is not None:
            loc = loc.base
        assert loc.chash is not None  # a v2 parent: every record has its hash
        at = t.buf_offset - HEAD_PAGE
        got = parent.read_raw(loc, bufs[2], bufs[3], at, t.length, bo_id=bo.id, offset=t.offset)
        assert got.buf is not None
        base = got.buf.view[got.offset:got.offset + t.length]
        new = bufs[0].view[t.buf_offset:t.buf_offset + t.length]
        try:
            xor_into(base, new)
            enc = encode_delta(bo.id, t.offset, base, self.compression.level, p.chash, loc.chash, DELTA_WORD)
        finally:
            base.release()
            new.release()
        if len(p.enc.payload) - len(enc.payload) >= DELTA_MIN_SAVING * t.length:
            p.enc, p.base = enc, loc.chash
            bo.delta_misses = 0
        else:
            bo.delta_misses += 1

    async def drain(self, tasks: list[ChunkTask[DumpBo]], bufs: list[StagingBuffer], pieces: list[Piece]) -> None:
        # A batch is one GPU lane, so its records all go to one of that GPU's data files (each in turn, each
        # written by a thread of its own): one reservation, one vectored write (at most 2 x MAX_BATCH iovecs).
        recs = [(t, p) for t, p in zip(tasks, pieces) if p.kind == STORE]
        write = None
        error: BaseException | None = None
        try:
            if recs:
                self._check_going(recs[0][0])
                gpu = recs[0][0].bo.gpu_id
                assert all(t.bo.gpu_id == gpu for t, _ in recs)  # one lane = one GPU
                file = self.writer.next_file(gpu)
                iov: list[Bytes] = []
                for _, p in recs:
                    assert p.enc is not None
                    iov.append(p.enc.head)
                    if p.enc.payload:
                        iov.append(p.enc.payload)
                off = file.reserve(sum(p.enc.record_length for _, p in recs if p.enc is not None))
                write = file.write(iov, off, bo_id=recs[0][0].bo.id, bo_offset=recs[0][0].offset)
                if self.policy is not None:
                    write.add_done_callback(self._sink_observer(sum(len(v) for v in iov)))
                for _, p in recs:
                    assert p.enc is not None
                    p.at, p.length, p.rsum = off, p.enc.record_length, p.enc.record_checksum
                    p.payload, p.file = len(p.enc.payload), file.index
                    off += p.length
        except BaseException as e:  # let the write already started land before reporting
            error = e
        await settle(land_all([write] if write is not None else [], error=error))
        self.landed(tasks, pieces)
