"""Dump, restore and verify jobs: the pipeline's two directions (plus a dry one).

A job is created, given BOs (all at once or in batches, as an RPC session
receives them), then finished: `finish()` is the barrier that waits for
every chunk and, for a dump, commits the image.  A job that fails or is
cancelled leaves no committed image and no temporaries behind.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field

from .backends import Backend, BoHandle, BoRef, Direction
from .codec import Compression, decode_chunk, encode_chunk
from .errors import (
    BackendUnavailableError,
    CorruptChunkError,
    IncompleteRestoreError,
    InvalidRequestError,
    VramdError,
)
from .image import ImageReader, ImageWriter
from .imageformat import HEAD_PEEK, record_head_length
from .pb import image_pb2 as pb
from .pipeline import ChunkTask, Pipeline, Progress, settle
from .staging import StagingBuffer, StagingPool

SOURCE_KINDS = {"procmem": pb.SOURCE_PROCMEM, "mmap": pb.SOURCE_MMAP, "sdma": pb.SOURCE_SDMA}


@dataclass(frozen=True)
class BoSpec:
    """A BO to dump: its identity, size, and where its bytes are read."""

    id: int
    size: int
    ref: BoRef
    gpu_id: int = 0
    alloc_flags: int = 0
    va_addr: int = 0
    name: str = ""


@dataclass(frozen=True)
class RestoreTarget:
    """Where a BO of the image goes back to."""

    bo_id: int
    ref: BoRef
    gpu_id: int | None = None  # pool to run in; default: the BO's gpu_id in the image


@dataclass(eq=False)
class _Bo:
    id: int
    gpu_id: int
    size: int
    backend: Backend | None
    handle: BoHandle | None
    chunks_left: int = 0
    # dump
    spec: BoSpec | None = None
    file: object | None = None
    records: list = field(default_factory=list)
    stored_bytes: int = 0
    zero_bytes: int = 0
    # restore
    entry: pb.BoEntry | None = None


def release_bo(bo: _Bo) -> None:
    """The BO's last chunk has landed (or the job ended): let the backend drop it."""
    if bo.handle is not None and bo.backend is not None:
        bo.backend.release(bo.handle)
        bo.handle = None


@dataclass
class JobContext:
    """What jobs share from the engine."""

    pool: StagingPool
    backends: dict[str, Backend]
    cpu: Executor
    io: Executor
    workers_per_gpu: int


class _Job:
    direction: Direction

    def __init__(self, ctx: JobContext, ends, on_progress=None):
        self.ctx = ctx
        self.bos: dict[int, _Bo] = {}
        self.pipeline = Pipeline(ends, ctx.pool, ctx.cpu, workers_per_gpu=ctx.workers_per_gpu,
                                 on_progress=on_progress)

    @property
    def progress(self) -> Progress:
        return self.pipeline.progress

    def _backend(self, kind: str, bo_id: int) -> Backend:
        backend = self.ctx.backends.get(kind)
        if backend is None:
            raise BackendUnavailableError(
                f"backend {kind!r} is not available (have: {', '.join(sorted(self.ctx.backends))})", bo_id=bo_id)
        caps = backend.capabilities()
        if not (caps.can_read if self.direction is Direction.READ else caps.can_write):
            raise BackendUnavailableError(f"backend {kind!r} cannot {self.direction.value}", bo_id=bo_id)
        return backend

    def cancel(self, reason: str = "job cancelled") -> None:
        self.pipeline.cancel(reason)

    def _fail(self, exc: VramdError) -> VramdError:
        self.pipeline.fail(exc)
        return exc

    def _release_all(self) -> None:
        for bo in self.bos.values():
            release_bo(bo)


# --- dump ------------------------------------------------------------------

class DumpEnds:
    def __init__(self, writer: ImageWriter, compression: Compression, chunk_size: int):
        self.writer = writer
        self.compression = compression
        self.chunk_size = chunk_size
        # zstd output is a fresh bytes object of at most chunk_size bytes; the
        # second buffer reserves budget for it (it is never touched itself).
        self.buffers_per_chunk = compression.buffers_per_chunk

    bo_done = staticmethod(release_bo)

    async def fill(self, task: ChunkTask, bufs: list[StagingBuffer]) -> None:
        bo = task.bo
        await settle(bo.backend.submit(bo.handle, task.offset, bufs[0], 0, task.length))

    def transform(self, task, bufs, _filled):
        return encode_chunk(task.bo.id, task.offset, bufs[0], task.length, self.compression)

    async def drain(self, task, bufs, enc) -> None:
        bo = task.bo
        off = bo.file.reserve(enc.record_length)
        await settle(bo.file.write([enc.head, enc.payload], off))
        bo.records[task.index] = (off, enc.record_length)
        bo.stored_bytes += len(enc.payload)
        if enc.codec == pb.CODEC_ZERO:
            bo.zero_bytes += task.length


class DumpJob(_Job):
    direction = Direction.READ

    def __init__(self, ctx: JobContext, dir_fd: int, *, chunk_size: int, compression: Compression,
                 on_progress=None):
        self.writer = ImageWriter(dir_fd, chunk_size=chunk_size, compression=compression.to_pb())
        self.chunk_size = chunk_size
        super().__init__(ctx, DumpEnds(self.writer, compression, chunk_size), on_progress)

    def add(self, specs: Iterable[BoSpec]) -> None:
        """Validate and queue BOs; a bad BO fails the whole dump (an image is all or nothing)."""
        specs = list(specs)
        try:
            for spec in specs:
                if spec.id in self.bos:
                    raise InvalidRequestError("BO id given twice", bo_id=spec.id)
                if spec.size < 0:
                    raise InvalidRequestError("negative BO size", bo_id=spec.id)
                backend = self._backend(spec.ref.kind, spec.id)
                handle = backend.open(spec.id, spec.ref, spec.size, spec.gpu_id, Direction.READ)
                nchunks = -(-spec.size // self.chunk_size)
                bo = self.bos[spec.id] = _Bo(spec.id, spec.gpu_id, spec.size, backend, handle,
                                             chunks_left=nchunks, spec=spec, records=[None] * nchunks)
                bo.file = self.writer.data_file(spec.gpu_id) if spec.size else None
            for spec in specs:
                bo = self.bos[spec.id]
                self.pipeline.add(bo.gpu_id, self._chunks(bo), bo.size)
        except VramdError as e:
            raise self._fail(e)

    def _chunks(self, bo: _Bo) -> Iterator[ChunkTask]:
        for i, off in enumerate(range(0, bo.size, self.chunk_size)):
            yield ChunkTask(bo, i, off, min(self.chunk_size, bo.size - off))

    async def finish(self) -> pb.Manifest:
        """Wait for every chunk, then commit the image; returns the manifest."""
        try:
            await self.pipeline.wait()
            return await self.writer.commit(self._entries(), self._totals())
        finally:
            self._release_all()
            self.writer.close()

    def _entries(self) -> list[pb.BoEntry]:
        out = []
        for bo in self.bos.values():
            s = bo.spec
            out.append(pb.BoEntry(
                id=s.id, gpu_id=s.gpu_id, size=s.size, alloc_flags=s.alloc_flags, va_addr=s.va_addr,
                source=SOURCE_KINDS.get(s.ref.kind, pb.SOURCE_UNSPECIFIED), source_offset=s.ref.offset,
                name=s.name, file_index=bo.file.index if bo.file else 0,
                record_offsets=[r[0] for r in bo.records], record_lengths=[r[1] for r in bo.records],
                stored_bytes=bo.stored_bytes, zero_bytes=bo.zero_bytes,
            ))
        return out

    def _totals(self) -> pb.Totals:
        bos = self.bos.values()
        return pb.Totals(bo_count=len(self.bos), bo_bytes=sum(b.size for b in bos),
                         stored_bytes=sum(b.stored_bytes for b in bos), zero_bytes=sum(b.zero_bytes for b in bos),
                         chunk_count=sum(len(b.records) for b in bos))


# --- restore and verify ----------------------------------------------------

class RestoreEnds:
    def __init__(self, reader: ImageReader, pool: StagingPool, io: Executor, *, verify_only: bool = False):
        m = reader.manifest
        self.reader = reader
        self.pool = pool
        self.io = io
        self.chunk_size = m.chunk_size
        self.buffers_per_chunk = 2 if m.compression.codec == pb.CODEC_ZSTD else 1
        self.verify_only = verify_only

    bo_done = staticmethod(release_bo)

    async def fill(self, task: ChunkTask, bufs: list[StagingBuffer]) -> bytes:
        loop = asyncio.get_running_loop()
        return await settle(loop.run_in_executor(self.io, self._read_record, task, bufs[-1]))

    def _where(self, task: ChunkTask) -> str:
        return f"{self.reader.manifest.files[task.bo.entry.file_index].name} @ {task.record_offset:#x}"

    def _read_record(self, task: ChunkTask, stored: StagingBuffer) -> bytes:
        """Read one record: its head into the headroom, its payload to offset 0 (page-aligned)."""
        fi, bo_id = task.bo.entry.file_index, task.bo.id
        rec_off, rec_len = task.record_offset, task.record_length
        peek_len = min(rec_len, HEAD_PEEK)
        tail = stored.view[stored.size - HEAD_PEEK:stored.size - HEAD_PEEK + peek_len]
        try:
            self.reader.read(fi, tail, rec_off, bo_id=bo_id, bo_offset=task.offset)
            where = self._where(task)
            head_len = record_head_length(tail, bo_id=bo_id, offset=task.offset, where=where)
            stored_len = rec_len - head_len
            if stored_len > task.length:
                raise CorruptChunkError(f"{where}: record of {rec_len} bytes for a {task.length}-byte chunk",
                                        bo_id=bo_id, offset=task.offset)
            head = bytes(tail[:head_len])
            in_peek = peek_len - head_len
            stored.view[:in_peek] = tail[head_len:peek_len]
        finally:
            tail.release()
        if stored_len > in_peek:
            rest = stored.view[in_peek:stored_len]
            try:
                self.reader.read(fi, rest, rec_off + peek_len, bo_id=bo_id, bo_offset=task.offset)
            finally:
                rest.release()
        return head

    def transform(self, task, bufs, head):
        return decode_chunk(task.bo.id, task.offset, task.length, head, bufs[-1], task.record_length - len(head),
                            bufs[0] if len(bufs) > 1 else None, where=self._where(task))

    async def drain(self, task, bufs, decoded) -> None:
        if self.verify_only:
            return
        bo = task.bo
        src = decoded.buf if decoded.buf is not None else self.pool.zeros(self.chunk_size)
        await settle(bo.backend.submit(bo.handle, task.offset, src, 0, task.length))


class RestoreJob(_Job):
    direction = Direction.WRITE

    def __init__(self, ctx: JobContext, reader: ImageReader, *, verify_only: bool = False, on_progress=None):
        self.reader = reader
        self.verify_only = verify_only
        super().__init__(ctx, RestoreEnds(reader, ctx.pool, ctx.io, verify_only=verify_only), on_progress)

    @property
    def manifest(self) -> pb.Manifest:
        return self.reader.manifest

    def add(self, targets: Iterable[RestoreTarget]) -> None:
        """Validate targets and start copying into them at once (the offload)."""
        targets = list(targets)
        try:
            for t in targets:
                entry = self.reader.bos.get(t.bo_id)
                if entry is None:
                    raise InvalidRequestError("the image has no such BO", bo_id=t.bo_id)
                if t.bo_id in self.bos:
                    raise InvalidRequestError("BO targeted twice", bo_id=t.bo_id)
                gpu = entry.gpu_id if t.gpu_id is None else t.gpu_id
                backend = self._backend(t.ref.kind, t.bo_id)
                handle = backend.open(t.bo_id, t.ref, entry.size, gpu, Direction.WRITE)
                self.bos[t.bo_id] = _Bo(t.bo_id, gpu, entry.size, backend, handle,
                                        chunks_left=len(entry.record_offsets), entry=entry)
            for t in targets:
                self._queue(self.bos[t.bo_id])
        except VramdError as e:
            raise self._fail(e)

    def add_all_for_verify(self) -> None:
        for entry in self.manifest.bos:
            bo = self.bos[entry.id] = _Bo(entry.id, entry.gpu_id, entry.size, None, None,
                                          chunks_left=len(entry.record_offsets), entry=entry)
            self._queue(bo)

    def _queue(self, bo: _Bo) -> None:
        self.pipeline.add(bo.gpu_id, self._chunks(bo), bo.size)

    def _chunks(self, bo: _Bo) -> Iterator[ChunkTask]:
        e, cs = bo.entry, self.manifest.chunk_size
        for i, (off, ln) in enumerate(zip(e.record_offsets, e.record_lengths)):
            yield ChunkTask(bo, i, i * cs, min(cs, e.size - i * cs), off, ln)

    async def finish(self, *, allow_partial: bool = False) -> Progress:
        """The barrier: wait until every queued BO is restored (or the first error)."""
        try:
            progress = await self.pipeline.wait()
            missing = [bo.id for bo in self.manifest.bos if bo.id not in self.bos]
            if missing and not allow_partial:
                raise IncompleteRestoreError(
                    f"{len(missing)} BO(s) of the image were given no target (first: {missing[0]})",
                    bo_id=missing[0])
            return progress
        finally:
            self._release_all()
            self.reader.close()
