"""The dump job: BOs -> a new image.

Fill copies BO bytes into staging, transform encodes the chunk records,
drain writes them; finish commits the image.  Where every piece of a batch
is a CPU copy and the image is uncompressed, one copy thread does all three
for the batch (`DumpEnds.run`): one batchcopy call copies, scans for zeros
and hashes, then the records are written.  A batch that is one big piece is
written with O_DIRECT where the file system allows it (`DIRECT_MIN`): its
head sits in the slot's head page right before the payload, so the record
goes from staging to the disk with no CPU copy, at a page-aligned file
offset (the bytes before the head in that page, and after the payload up to
the next page, are zeros between records; the manifest lists each record's
offset and length, so readers never see them).
"""
from __future__ import annotations

import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from ...backends import Backend, Direction, OpenItem, land_all
from ...errors import InvalidRequestError, JobError, VramdError
from ...hostmem.batchcopy import HASH, ZERO, copy_batch
from ...hostmem.libc import ffi as libc_ffi
from ...hostmem.libc import libc
from ...hostmem.staging import StagingBuffer
from ...image.codec import Compression, EncodedChunk, encode_chunk, record_head
from ...image.format import Bytes, chunk_count, record_checksum
from ...image.writer import DataFileWriter, ImageWriter
from ...pb import image_pb2 as pb
from ...units import PAGE, round_up
from ..pipeline import HEAD_PAGE, ChunkTask, Clock, ProgressCallback, StageTimes, blame, settle
from .common import Ahead, BoSpec, CopiedBo, JobBase, JobContext, check_bo_range, landed, submit_batch

DIRECT_MIN = 256 << 10  # a piece this big, alone in its batch, is written with O_DIRECT where possible

# Where a piece's record went: (file offset, record length, all zero, record checksum).
Placed = tuple[int, int, bool, int]

SOURCE_KINDS = {"procmem": pb.SOURCE_PROCMEM, "mmap": pb.SOURCE_MMAP, "sdma": pb.SOURCE_SDMA}


@dataclass(eq=False)
class DumpBo(CopiedBo):
    """A BO being dumped: where its bytes come from, and where its records went."""

    spec: BoSpec | None = None
    file: DataFileWriter | None = None
    # The records written so far, appended as they land (in any order): chunk index, file
    # offset, length, record checksum.  Compact, and empty until bytes move, so a BO costs
    # the same memory whatever size it declares.
    rec_index: array.array[int] = field(default_factory=lambda: array.array("Q"))
    rec_offset: array.array[int] = field(default_factory=lambda: array.array("Q"))
    rec_length: array.array[int] = field(default_factory=lambda: array.array("I"))
    rec_checksum: array.array[int] = field(default_factory=lambda: array.array("Q"))
    stored_bytes: int = 0
    zero_bytes: int = 0

    def landed(self, index: int, offset: int, length: int, checksum: int) -> None:
        self.rec_index.append(index)
        self.rec_offset.append(offset)
        self.rec_length.append(length)
        self.rec_checksum.append(checksum)

    def records(self, nchunks: int) -> tuple[list[int], list[int], list[int]]:
        """(offsets, lengths, checksums) in chunk order; every chunk must have landed exactly once."""
        if nchunks == 1 and len(self.rec_index) == 1 and self.rec_index[0] == 0:  # a small BO: no sorting
            return [self.rec_offset[0]], [self.rec_length[0]], [self.rec_checksum[0]]
        if len(self.rec_index) != nchunks or sorted(self.rec_index) != list(range(nchunks)):
            raise JobError(f"internal error: {len(self.rec_index)} records landed for {nchunks} chunks",
                           bo_id=self.id)
        order = sorted(range(nchunks), key=self.rec_index.__getitem__)
        return ([self.rec_offset[i] for i in order], [self.rec_length[i] for i in order],
                [self.rec_checksum[i] for i in order])


class DumpEnds:
    def __init__(self, writer: ImageWriter, compression: Compression, chunk_size: int, direct: bool = True) -> None:
        self.writer = writer
        self.compression = compression
        self.chunk_size = chunk_size
        # zstd output is a fresh bytes object of at most chunk_size bytes; the
        # second buffer reserves budget for it (it is never touched itself).
        self.buffers_per_chunk = compression.buffers_per_chunk
        self.direct = direct  # try O_DIRECT for big pieces (DataFileWriter.direct_fd: the writer's opening rules)

    # --- a whole batch in one copy thread (InlineEnds) ----------------------

    def inline(self, tasks: list[ChunkTask[DumpBo]]) -> bool:
        return self.compression.codec == pb.CODEC_RAW and all(
            t.bo.backend is not None and t.bo.backend.cpu_copies for t in tasks)

    def run(self, tasks: list[ChunkTask[DumpBo]], bufs: list[StagingBuffer],
            times: StageTimes | None) -> list[Placed]:
        """Copy, scan and hash the batch (one batchcopy call), then write its records (in this copy thread;
        an OSError of the data file is the writer's typed error naming it and the BO).

        Returns (record offset, record length, all zero, record checksum) per piece.
        """
        buf = bufs[0]
        clock = Clock(times)
        copies = []
        for t in tasks:
            backend, handle = t.bo.backend, t.bo.handle
            assert backend is not None and handle is not None  # set by add(), dropped only when done
            copies.append(backend.plan(handle, t.offset, buf.address + t.buf_offset, t.length))
        clock.lap("python")
        outcomes, failed = copy_batch(copies, HASH | ZERO)
        clock.lap("copy")
        landed(tasks, outcomes, failed)
        heads = []
        for t, o in zip(tasks, outcomes):
            try:
                heads.append(record_head(t.bo.id, t.offset, t.length, pb.CODEC_ZERO if o.zero else pb.CODEC_RAW,
                                         0 if o.zero else t.length, o.hash))
            except Exception as e:
                blame(e, t)
                raise
        file = tasks[0].bo.file
        assert file is not None and all(t.bo.file is file for t in tasks)  # one lane = one GPU = one data file
        clock.lap("python")
        if len(tasks) == 1 and not outcomes[0].zero and tasks[0].length >= DIRECT_MIN and self.direct \
                and file.direct_fd() is not None:
            placed = [self._write_direct(file, tasks[0], buf, heads[0])]
        else:
            placed = self._write(file, tasks, buf, heads, [o.zero for o in outcomes])
        clock.lap("write")
        return placed

    def _write_direct(self, file: DataFileWriter, t: ChunkTask[DumpBo], buf: StagingBuffer,
                      head: bytes) -> Placed:
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
        return at + HEAD_PAGE - h, h + n, False, record_checksum(head)

    def _write(self, file: DataFileWriter, tasks: list[ChunkTask[DumpBo]], buf: StagingBuffer, heads: list[bytes],
               zero: list[bool]) -> list[Placed]:
        """The batch's records back to back, one buffered pwritev."""
        iov: list[Bytes] = []
        lengths = []
        for t, head, z in zip(tasks, heads, zero):
            iov.append(head)
            if not z:
                iov.append(buf.view[t.buf_offset:t.buf_offset + t.length])
            lengths.append(len(head) + (0 if z else t.length))
        at = file.reserve(sum(lengths))
        try:
            file.pwrite(iov, at, bo_id=tasks[0].bo.id, bo_offset=tasks[0].offset)
        finally:
            for v in iov:
                if isinstance(v, memoryview):
                    v.release()
        placed = []
        for n, z, head in zip(lengths, zero, heads):
            placed.append((at, n, z, record_checksum(head)))
            at += n
        return placed

    def landed(self, tasks: list[ChunkTask[DumpBo]], placed: list[Placed]) -> None:
        """On the event loop, after `run`: the records into the BOs' compact arrays (as the drain does)."""
        for t, (at, n, z, rsum) in zip(tasks, placed):
            bo = t.bo
            bo.landed(t.index, at, n, rsum)
            if z:
                bo.zero_bytes += t.length
            else:
                bo.stored_bytes += t.length

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

    def transform(self, tasks: list[ChunkTask[DumpBo]], bufs: list[StagingBuffer], _filled: None) -> list[EncodedChunk]:
        buf, compression = bufs[0], self.compression
        out = []
        for t in tasks:
            try:
                out.append(encode_chunk(t.bo.id, t.offset, buf, t.length, compression, t.buf_offset))
            except VramdError:
                raise
            except Exception as e:
                blame(e, t)
                raise
        return out

    async def drain(self, tasks: list[ChunkTask[DumpBo]], bufs: list[StagingBuffer],
                    encs: list[EncodedChunk]) -> None:
        # A batch is one GPU lane, so its records all go to that GPU's data file:
        # one reservation, one vectored write (at most 2 x MAX_BATCH iovecs).
        by_file: dict[DataFileWriter, list[tuple[ChunkTask[DumpBo], EncodedChunk]]] = {}
        for t, enc in zip(tasks, encs):
            assert t.bo.file is not None  # every BO with bytes has a data file
            by_file.setdefault(t.bo.file, []).append((t, enc))
        writes = []
        error: BaseException | None = None
        try:
            for file, pieces in by_file.items():
                iov: list[Bytes] = []
                for _, enc in pieces:
                    iov.append(enc.head)
                    if enc.payload:
                        iov.append(enc.payload)
                off = file.reserve(sum(enc.record_length for _, enc in pieces))
                writes.append(file.write(iov, off, bo_id=pieces[0][0].bo.id, bo_offset=pieces[0][0].offset))
                for t, enc in pieces:
                    bo = t.bo
                    bo.landed(t.index, off, enc.record_length, enc.record_checksum)
                    off += enc.record_length
                    bo.stored_bytes += len(enc.payload)
                    if enc.codec == pb.CODEC_ZERO:
                        bo.zero_bytes += t.length
        except BaseException as e:  # let the writes already started land before reporting
            error = e
        await settle(land_all(writes, error=error))


class DumpJob(JobBase[DumpBo]):
    direction = Direction.READ

    def __init__(self, ctx: JobContext, dir_fd: int, *, chunk_size: int, compression: Compression,
                 on_progress: ProgressCallback | None = None) -> None:
        self.writer = ImageWriter(dir_fd, chunk_size=chunk_size, compression=compression.to_pb())
        self.chunk_size = chunk_size
        self.topology_json = b""  # the machine's KFD topology, saved in the manifest
        self.ends = DumpEnds(self.writer, compression, chunk_size)
        super().__init__(ctx, self.ends, on_progress)

    def _validate(self, specs: Sequence[BoSpec]) -> tuple[list[tuple[Backend, OpenItem]], VramdError | None]:
        """The checks that need no syscall, in BO order: what to open for the BOs before the first
        that fails, and its error (reads the job's state only: also run in a worker thread, open_ahead)."""
        valid: list[tuple[Backend, OpenItem]] = []
        seen: set[int] = set()
        try:
            for spec in specs:
                if spec.id in self.bos or spec.id in seen:
                    raise InvalidRequestError("BO id given twice", bo_id=spec.id)
                seen.add(spec.id)
                check_bo_range(spec.id, spec.size, spec.ref, self.ctx.max_bo_bytes)
                valid.append((self._backend(spec.ref.kind, spec.id), (spec.id, spec.ref, spec.size, spec.gpu_id)))
        except VramdError as e:
            return valid, e
        return valid, None

    def add(self, specs: Iterable[BoSpec], ahead: Ahead | None = None) -> None:
        """Validate and queue BOs; a bad BO fails the whole dump (an image is all or nothing).

        `ahead`: BOs opened by `open_ahead` in a worker thread; those used are taken from it."""
        todo = list(specs)
        try:
            valid, error = self._validate(todo)  # raised once the BOs before it are open: the first error wins
            for spec, (backend, _), handle in zip(todo, valid, self._open_all(valid, ahead)):
                bo = self.bos[spec.id] = DumpBo(spec.id, spec.gpu_id, spec.size, backend, handle,
                                                chunks_left=chunk_count(spec.size, self.chunk_size), spec=spec)
                bo.file = self.writer.data_file(spec.gpu_id) if spec.size else None
            if error is not None:
                raise error
            for spec in todo:
                bo = self.bos[spec.id]
                self.pipeline.add(bo.gpu_id, self._chunks(bo), bo.size)
        except VramdError as e:
            self._fail(e)
            raise

    def _chunks(self, bo: DumpBo) -> Iterator[ChunkTask[DumpBo]]:
        for i, off in enumerate(range(0, bo.size, self.chunk_size)):
            yield ChunkTask(bo, i, off, min(self.chunk_size, bo.size - off))

    async def finish(self) -> pb.Manifest:
        """Wait for every chunk, then commit the image; returns the manifest."""
        try:
            await self.pipeline.wait()
            return await self.writer.commit(self._entries(), self._totals(), self.topology_json)
        finally:
            self._release_all()
            await settle(self.writer.aclose())

    def _entries(self) -> list[pb.BoEntry]:
        out = []
        for bo in self.bos.values():
            s = bo.spec
            assert s is not None
            offsets, lengths, checksums = bo.records(chunk_count(s.size, self.chunk_size))
            out.append(pb.BoEntry(
                id=s.id, gpu_id=s.gpu_id, size=s.size, alloc_flags=s.alloc_flags, va_addr=s.va_addr,
                source=SOURCE_KINDS.get(s.ref.kind, pb.SOURCE_UNSPECIFIED), source_offset=s.ref.offset,
                name=s.name, file_index=bo.file.index if bo.file else 0,
                record_offsets=offsets, record_lengths=lengths, record_checksums=checksums,
                stored_bytes=bo.stored_bytes, zero_bytes=bo.zero_bytes,
            ))
        return out

    def _totals(self) -> pb.Totals:
        bos = self.bos.values()
        return pb.Totals(bo_count=len(self.bos), bo_bytes=sum(b.size for b in bos),
                         stored_bytes=sum(b.stored_bytes for b in bos), zero_bytes=sum(b.zero_bytes for b in bos),
                         chunk_count=sum(len(b.rec_index) for b in bos))
