"""The dump job: BOs -> a new image.

Fill copies BO bytes into staging, transform encodes the chunk records,
drain writes them; finish commits the image.
"""
from __future__ import annotations

import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ...backends import Direction, land_all
from ...errors import InvalidRequestError, JobError, VramdError
from ...hostmem.staging import StagingBuffer
from ...image.codec import Compression, EncodedChunk, encode_chunk
from ...image.format import Bytes, chunk_count
from ...image.writer import DataFileWriter, ImageWriter
from ...pb import image_pb2 as pb
from ..pipeline import ChunkTask, ProgressCallback, blame, settle
from .common import BoSpec, CopiedBo, JobBase, JobContext, check_bo_range, submit_batch

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
        if len(self.rec_index) != nchunks or sorted(self.rec_index) != list(range(nchunks)):
            raise JobError(f"internal error: {len(self.rec_index)} records landed for {nchunks} chunks",
                           bo_id=self.id)
        order = sorted(range(nchunks), key=self.rec_index.__getitem__)
        return ([self.rec_offset[i] for i in order], [self.rec_length[i] for i in order],
                [self.rec_checksum[i] for i in order])


class DumpEnds:
    def __init__(self, writer: ImageWriter, compression: Compression, chunk_size: int) -> None:
        self.writer = writer
        self.compression = compression
        self.chunk_size = chunk_size
        # zstd output is a fresh bytes object of at most chunk_size bytes; the
        # second buffer reserves budget for it (it is never touched itself).
        self.buffers_per_chunk = compression.buffers_per_chunk

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
        super().__init__(ctx, DumpEnds(self.writer, compression, chunk_size), on_progress)

    def add(self, specs: Iterable[BoSpec]) -> None:
        """Validate and queue BOs; a bad BO fails the whole dump (an image is all or nothing)."""
        todo = list(specs)
        try:
            for spec in todo:
                if spec.id in self.bos:
                    raise InvalidRequestError("BO id given twice", bo_id=spec.id)
                check_bo_range(spec.id, spec.size, spec.ref, self.ctx.max_bo_bytes)
                backend = self._backend(spec.ref.kind, spec.id)
                handle = backend.open(spec.id, spec.ref, spec.size, spec.gpu_id, Direction.READ, checked=self._checked)
                bo = self.bos[spec.id] = DumpBo(spec.id, spec.gpu_id, spec.size, backend, handle,
                                                chunks_left=chunk_count(spec.size, self.chunk_size), spec=spec)
                bo.file = self.writer.data_file(spec.gpu_id) if spec.size else None
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
