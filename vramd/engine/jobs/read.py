"""What restore and verify share: reading an image's records into staging and checking them.

Both are the same pipeline: fill reads records into staging, transform
checks and decodes them; only the drain differs (restore.py, verify.py).

Each chunk's record is found through the image's manifest (`ImageReader.locate`:
a v1 record list, or v2's chunk table, possibly in a parent's data file; a v2
hole has no record and is zeros).  A delta record's base is read and decoded
first, into two more staging buffers.

For an image with no compressed record and no delta (its parents' included)
whose targets are all CPU copies, one copy thread
does a whole batch (`ImageReadEnds.run`): one batchcopy call reads each
record whole into its slot (the head into the slot's head page) and hashes
its payload as it arrives, the heads are checked against the manifest and the
hashes, and only then are the bytes copied into the BOs.  A record written
page-aligned by an O_DIRECT dump, alone in its batch, is read with O_DIRECT
where the file system allows it and the page cache does not hold it: no
CPU copy on the way in.  Because such a read waits on the device, the copy
thread declines that batch and it takes the three stages: an io thread reads
and checks it the same way, and the backend's threads copy it out, so that
as many reads wait on the device at once as batches are in flight.
"""
from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import cast

from ...errors import CorruptChunkError, InternalError, TruncatedDataError, VramdError
from ...hostmem.batchcopy import END_OF_FILE, HASH, RECORD, WHOLE, Copy, Outcome, copy_batch
from ...hostmem.libc import cached_pages, memory_file
from ...hostmem.staging import StagingBuffer, StagingPool
from ...image.codec import DecodedChunk, decode_chunk, decode_record
from ...image.fileio import image_os_error
from ...image.format import HEAD_PEEK, record_head_length
from ...image.reader import ImageReader, Loc
from ...pb import image_pb2 as pb
from ...units import PAGE, round_up
from ..pipeline import DECLINED, HEAD_PAGE, ChunkTask, Clock, StageTimes, blame, settle
from .common import CopiedBo
from .dump import DIRECT_MIN


@dataclass(eq=False)
class ImageBo(CopiedBo):
    """A BO of the image being read; `entry` is its manifest entry (where its records are)."""

    entry: pb.BoEntry | None = None

    @property
    def manifest_entry(self) -> pb.BoEntry:
        assert self.entry is not None  # set at creation for every image BO
        return self.entry


HOLE = DecodedChunk(None, pb.CODEC_ZERO)  # a format v2 hole: no record, zeros


def _loc(t: ChunkTask[ImageBo]) -> Loc:
    assert t.loc is not None  # only pieces with a record are read
    return t.loc


def _in_page_cache(fd: int, offset: int, length: int) -> bool:
    """Whether the page cache holds every page of the record (hostmem.libc.cached_pages: asked without
    reading anything).  A cached record is read through the cache: O_DIRECT would read it from the disk
    again (measured: a restore of a just-written image 3x slower).  Where the kernel cannot tell: no."""
    have = cached_pages(fd, offset, length)
    return have is not None and have >= (offset % PAGE + length + PAGE - 1) // PAGE


def buffers_to_read(reader: ImageReader) -> int:
    """Staging buffers a batch of this image needs: the records; a second to decompress into where any
    record of the chain may be compressed; two more to read a delta's base chunk."""
    if reader.has_deltas:
        return 4
    images = [reader.manifest, *reader.parents]
    return 2 if any(_compressed(m) for m in images) else 1


def _compressed(m: pb.Manifest) -> bool:
    """Whether any record of the image may be compressed: v2 counts them; v1 says what it asked for."""
    if m.format_version >= 2:
        return m.totals.compressed_records > 0
    return m.compression.codec not in (pb.CODEC_RAW, pb.CODEC_UNSPECIFIED)


class ImageReadEnds(ABC):
    """Fill and transform of every job that reads an image: records into staging, then checked and decoded.

    Restore and verify differ only in their drain (into the BOs, or nowhere)."""

    def __init__(self, reader: ImageReader, pool: StagingPool, io: Executor) -> None:
        m = reader.manifest
        self.reader = reader
        self.pool = pool
        self.io = io
        self.chunk_size = m.chunk_size
        self.buffers_per_chunk = buffers_to_read(reader)
        self._names = reader.names
        self.direct = True  # try O_DIRECT for big page-aligned records (the reader opens and closes those fds)
        self._memory: dict[int, bool] = {}  # data file slot -> whether it is memory (tmpfs: hostmem.libc.memory_file)

    # --- a whole batch in one copy thread (InlineEnds) ----------------------

    def inline(self, tasks: list[ChunkTask[ImageBo]]) -> bool:
        return self.buffers_per_chunk == 1 and all(t.bo.backend is None or t.bo.copier is not None for t in tasks)

    def run(self, tasks: list[ChunkTask[ImageBo]], bufs: list[StagingBuffer], times: StageTimes | None) -> object:
        """Read, check and copy out the batch here, unless it is one record that `_read_plan` would read with
        O_DIRECT from a device, not from the page cache (`_direct_read`).  The copy thread declines that one,
        and the three stages take it: an io thread reads and checks it (fill), the backend's threads copy it
        out (drain), so that as many records are read at once as batches are in flight, not only as many as
        there are copy threads, each of which would wait for its read before its copy-out.  Any other batch
        stays here: read and copied out by one thread, it costs less (bench/README.md)."""
        directs = None
        if len(tasks) == 1 and tasks[0].loc is not None:
            directs = [self._direct_read(tasks[0])]  # probed once: `_read_checked` reads with this answer
            if directs[0] is not None and directs[0][1]:
                return DECLINED
        clock = Clock(times)
        decoded = self._read_checked(tasks, bufs[0], clock, directs)
        self._copy_out(tasks, decoded, clock)
        return None

    def _direct_read(self, t: ChunkTask[ImageBo]) -> tuple[int, bool] | None:
        """(the O_DIRECT twin of the data file to read `t`'s record with, whether that read waits on a device),
        or None: read it through the page cache.  O_DIRECT for a big record, its pages within the slot and
        the file, where the file system took O_DIRECT and the page cache does not hold it (probed in the
        calling thread, never on the event loop; a tmpfs file is memory, read either way without waiting)."""
        fi, rec, n = _loc(t).slot, t.record_offset, t.record_length
        skip = rec % PAGE
        if not self.direct or n < DIRECT_MIN or skip + n > HEAD_PAGE + round_up(t.length, PAGE):
            return None
        d = self.reader.direct_fd(fi)
        if d is None or rec - skip + round_up(skip + n, PAGE) > d[1]:
            return None
        fd = self.reader.fds[fi]
        memory = self._memory.get(fi)
        if memory is None:
            memory = self._memory[fi] = memory_file(fd)
        if memory:
            return d[0], False
        return None if _in_page_cache(fd, rec, n) else (d[0], True)

    def landed(self, tasks: list[ChunkTask[ImageBo]], product: None) -> None:
        return None

    def _read_plan(self, t: ChunkTask[ImageBo], buf: StagingBuffer, direct: tuple[int, bool] | None) -> Copy:
        """Read the record whole into the piece's slot, from its head page on (O_DIRECT where `direct`, what
        `_direct_read` said of it, names the O_DIRECT file)."""
        fi = _loc(t).slot
        if self.reader.fds[fi] < 0:  # never: the session takes no work before every file is attached
            raise InternalError(f"{self._names[fi]} is read before it was attached (slots {self.reader.fds})")
        rec, n, room = t.record_offset, t.record_length, HEAD_PAGE + round_up(t.length, PAGE)
        if n > room:  # the manifest checks keep it out; the read must never pass the slot's end regardless
            raise CorruptChunkError(f"{self._where(t)}: record of {n} bytes for a {t.length}-byte chunk",
                                    bo_id=t.bo.id, offset=t.offset)
        at = buf.address + t.buf_offset - HEAD_PAGE
        if direct is not None:
            skip = rec % PAGE
            return Copy(direct[0], rec - skip, -1, at, round_up(skip + n, PAGE), skip, n)
        return Copy(self.reader.fds[fi], rec, -1, at, n, 0, n)

    def _read_checked(self, tasks: list[ChunkTask[ImageBo]], buf: StagingBuffer, clock: Clock,
                      directs: list[tuple[int, bool] | None] | None = None) -> list[DecodedChunk]:
        """Read every record of the batch whole and check it.  `directs`: `_direct_read` of each record,
        where the caller probed them already (else probed here)."""
        recs = [t for t in tasks if t.loc is not None]  # a format v2 hole has no record to read
        if directs is None:
            directs = [self._direct_read(t) for t in recs]
        copies = [self._read_plan(t, buf, d) for t, d in zip(recs, directs, strict=True)]
        clock.lap("python")
        # a record read from a device: in one request, not 256 KiB ones the thread would wait for one by one
        whole = WHOLE if len(directs) == 1 and directs[0] is not None and directs[0][1] else 0
        outcomes, failed = copy_batch(copies, HASH | RECORD | whole)
        clock.lap("read")
        if failed >= 0:
            self._read_failed(recs[failed], copies[failed], outcomes[failed])
        decoded = []
        read = iter(zip(copies, outcomes))
        for t in tasks:
            if t.loc is None:
                decoded.append(HOLE)
                continue
            c, o = next(read)
            try:
                decoded.append(self._check(t, buf, c, o))
            except VramdError:
                raise
            except Exception as e:
                blame(e, t)
                raise
        clock.lap("python")
        return decoded

    def _read_failed(self, t: ChunkTask[ImageBo], c: Copy, o: Outcome) -> None:
        fi = _loc(t).slot
        if o.err == END_OF_FILE:
            raise TruncatedDataError(
                f"data file {self._names[fi]} ends inside a chunk record at {c.src + o.done:#x}",
                bo_id=t.bo.id, offset=t.offset)
        raise image_os_error(OSError(o.err, os.strerror(o.err)), f"cannot read data file {self._names[fi]} at "
                             f"{c.src + o.done:#x}", bo_id=t.bo.id, offset=t.offset)

    def _check(self, t: ChunkTask[ImageBo], buf: StagingBuffer, c: Copy, o: Outcome) -> DecodedChunk:
        """The record read into the slot: its head checked, its payload's hash compared (decode_record)."""
        loc = _loc(t)
        return decode_record(t.bo.id, t.offset, t.length, buf, t.buf_offset - HEAD_PAGE + c.rec_at, c.rec_len, None,
                             where=lambda: self._where(t), hashed=(o.payload_at - c.rec_at, o.hash),
                             record_checksum=loc.record_checksum, content_hash=loc.chash, check_content=loc.foreign)[0]

    def _copy_out(self, tasks: list[ChunkTask[ImageBo]], decoded: list[DecodedChunk], clock: Clock) -> None:
        """Restore: the checked bytes into the BOs (verify: nowhere)."""

    def bo_done(self, bo: ImageBo) -> None:
        bo.release()

    # --- the three stages ----------------------------------------------------

    async def fill(self, tasks: list[ChunkTask[ImageBo]],
                   bufs: list[StagingBuffer]) -> list[bytes] | list[DecodedChunk]:
        """In an io thread: an image of raw records only has each record read whole and checked as
        `run` does (O_DIRECT where it is cold; `transform` then has nothing left to do); otherwise the
        records' payloads go to their slots and their heads are returned for `transform`."""
        loop = asyncio.get_running_loop()
        if self.buffers_per_chunk == 1:
            return await settle(loop.run_in_executor(self.io, self._read_checked, tasks, bufs[0], Clock(None)))
        return await settle(loop.run_in_executor(self.io, self._read_records, tasks, bufs[-1]))

    def _where(self, task: ChunkTask[ImageBo]) -> str:
        return f"{self._names[_loc(task).slot]} @ {task.record_offset:#x}"

    def _read_records(self, tasks: list[ChunkTask[ImageBo]], stored: StagingBuffer) -> list[bytes]:
        """Read a batch's records (in an io thread): payloads to their slots; returns their heads.

        A record's head is peeked into a small scratch buffer, so its payload
        lands at the piece's page-aligned slot (for a whole chunk: offset 0).
        Where the next record follows in the same file (a dump writes a
        batch's records back to back), the rest of this record's payload and
        the next record's peek are read by one preadv: one syscall a record.
        """
        scratch = memoryview(bytearray(HEAD_PEEK))  # this call's own
        view, heads = stored.view, []
        try:
            peeked = False  # the scratch already holds tasks[i]'s peek
            for i, t in enumerate(tasks):
                if t.loc is None:  # a format v2 hole: no record
                    heads.append(b"")
                    continue
                fi, bo_id = t.loc.slot, t.bo.id
                rec_off, rec_len, slot = t.record_offset, t.record_length, t.buf_offset
                peek_len = min(rec_len, HEAD_PEEK)
                if not peeked:
                    self._read(t, [scratch[:peek_len]], rec_off)
                where = self._where(t)
                head_len = record_head_length(scratch[:peek_len], bo_id=bo_id, offset=t.offset, where=where)
                stored_len = rec_len - head_len
                if stored_len > t.length:
                    raise CorruptChunkError(f"{where}: record of {rec_len} bytes for a {t.length}-byte chunk",
                                            bo_id=bo_id, offset=t.offset)
                heads.append(bytes(scratch[:head_len]))
                in_peek = peek_len - head_len
                view[slot:slot + in_peek] = scratch[head_len:peek_len]
                views = [view[slot + in_peek:slot + stored_len]] if stored_len > in_peek else []
                nxt = tasks[i + 1] if i + 1 < len(tasks) else None
                then = None
                if nxt is not None and nxt.loc is not None and nxt.record_offset == rec_off + rec_len \
                        and nxt.loc.slot == fi:
                    then = (nxt, scratch[:min(nxt.record_length, HEAD_PEEK)])
                peeked = then is not None
                try:
                    if then is not None:
                        self._read(t, views, rec_off + peek_len, then=then)
                    elif views:
                        self._read(t, views, rec_off + peek_len)
                finally:
                    for v in views:
                        v.release()
        finally:
            scratch.release()
        return heads

    def _read(self, task: ChunkTask[ImageBo], views: list[memoryview], offset: int,
              then: tuple[ChunkTask[ImageBo], memoryview] | None = None) -> None:
        """Fill `views` (bytes of `task`'s record), then optionally `then` = (next task, view of its
        peek), from consecutive file bytes at `offset`; a short read names the record it cuts."""
        want = sum(len(v) for v in views)
        fi = _loc(task).slot
        extra = [then[1]] if then is not None else []
        try:
            got = self.reader.readv(fi, [*views, *extra], offset)
        except OSError as e:
            raise image_os_error(e, f"cannot read data file {self._names[fi]} at {offset:#x}",
                                 bo_id=task.bo.id, offset=task.offset) from None
        if got < want + sum(len(v) for v in extra):
            cut = task if got < want or then is None else then[0]
            raise TruncatedDataError(
                f"data file {self._names[fi]} ends inside a chunk record at {offset + got:#x}",
                bo_id=cut.bo.id, offset=cut.offset)

    @abstractmethod
    async def drain(self, tasks: list[ChunkTask[ImageBo]], bufs: list[StagingBuffer],
                    decoded: list[DecodedChunk]) -> None:
        """Where the decoded chunks go: restore.py (into the BOs), verify.py (nowhere)."""

    def transform(self, tasks: list[ChunkTask[ImageBo]], bufs: list[StagingBuffer],
                  filled: list[bytes] | list[DecodedChunk]) -> list[DecodedChunk]:
        if self.buffers_per_chunk == 1:  # read whole and checked by `fill`
            return cast(list[DecodedChunk], filled)
        heads = cast(list[bytes], filled)
        stored, out = bufs[-1], (bufs[0] if len(bufs) > 1 else None)
        decoded = []
        for t, head in zip(tasks, heads):
            loc = t.loc
            if loc is None:
                decoded.append(HOLE)
                continue
            try:
                base = None
                if loc.base is not None:  # a delta: its base chunk first, into the two scratch buffers
                    got = self.reader.read_raw(loc.base, bufs[1], bufs[2], t.buf_offset - HEAD_PAGE, t.length,
                                               bo_id=t.bo.id, offset=t.offset)
                    assert got.buf is not None
                    base = got.buf.view[got.offset:got.offset + t.length]
                try:
                    decoded.append(decode_chunk(t.bo.id, t.offset, t.length, head, stored,
                                                t.record_length - len(head), out, where=self._where(t),
                                                buf_offset=t.buf_offset, record_checksum=loc.record_checksum,
                                                content_hash=loc.chash, base=base, check_content=loc.foreign))
                finally:
                    if base is not None:
                        base.release()
            except VramdError:
                raise
            except Exception as e:
                blame(e, t)
                raise
        return decoded
