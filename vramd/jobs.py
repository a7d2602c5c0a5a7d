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
from .backends.base import CopyItem, land_all
from .codec import Compression, DecodedChunk, EncodedChunk, decode_chunk, encode_chunk
from .errors import (
    BackendUnavailableError,
    CorruptChunkError,
    IncompleteRestoreError,
    InvalidRequestError,
    TruncatedDataError,
    VramdError,
)
from .image import ImageReader, ImageWriter
from .imageformat import HEAD_PEEK, record_head_length
from .pb import image_pb2 as pb
from .pipeline import ChunkTask, Pipeline, Progress, blame, settle
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


def submit_batch(copies: list[tuple[Backend, CopyItem]]) -> asyncio.Future:
    """A batch's backend copies: one `submit_many` per backend; one future, done when all have landed.

    A batch's pieces share a GPU lane but may reach their BOs through
    different backends (procmem and mmap BOs of one GPU in one job).
    """
    groups: dict[Backend, list[CopyItem]] = {}
    for backend, item in copies:
        group = groups.get(backend)
        if group is None:
            group = groups[backend] = []
        group.append(item)
    if len(groups) == 1:
        (backend, items), = groups.items()
        return backend.submit_many(items)
    futs = []
    try:
        for backend, items in groups.items():
            futs.append(backend.submit_many(items))
    except BaseException as e:  # let what was started land before reporting
        return land_all(futs, error=e)
    return land_all(futs)


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
        self._usable: dict[str, Backend] = {}
        self._checked: dict = {}  # fds validated once per job (see check_fd)
        self.pipeline = Pipeline(ends, ctx.pool, ctx.cpu, workers_per_gpu=ctx.workers_per_gpu,
                                 on_progress=on_progress)

    @property
    def progress(self) -> Progress:
        return self.pipeline.progress

    def _backend(self, kind: str, bo_id: int) -> Backend:
        backend = self._usable.get(kind)  # checked once per kind and job, not per BO
        if backend is not None:
            return backend
        backend = self.ctx.backends.get(kind)
        if backend is None:
            raise BackendUnavailableError(
                f"backend {kind!r} is not available (have: {', '.join(sorted(self.ctx.backends))})", bo_id=bo_id)
        caps = backend.capabilities()
        if not (caps.can_read if self.direction is Direction.READ else caps.can_write):
            raise BackendUnavailableError(f"backend {kind!r} cannot {self.direction.value}", bo_id=bo_id)
        self._usable[kind] = backend
        return backend

    def cancel(self, reason: str = "job cancelled") -> None:
        self.pipeline.cancel(reason)

    def precheck(self, refs: Iterable[tuple[int, BoRef]]) -> None:
        """Validate the fds of BOs about to be added, filling the job's memo.

        Thread-safe and meant for a worker thread: `add` then finds every fd
        checked and makes no syscall for it on the event loop.  Failures are
        not raised here; `add` meets them again and reports them with the BO.
        """
        for bo_id, ref in refs:
            backend = self.ctx.backends.get(ref.kind)
            if backend is None:
                continue
            try:
                backend.check(ref.fd, self.direction, bo_id=bo_id, checked=self._checked)
            except VramdError:
                pass

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

    async def fill(self, tasks: list[ChunkTask], bufs: list[StagingBuffer]) -> None:
        buf = bufs[0]
        await settle(submit_batch([(t.bo.backend, (t.bo.handle, t.offset, buf, t.buf_offset, t.length))
                                   for t in tasks]))

    def transform(self, tasks: list[ChunkTask], bufs: list[StagingBuffer], _filled) -> list[EncodedChunk]:
        buf, compression = bufs[0], self.compression
        out = []
        for t in tasks:
            try:
                out.append(encode_chunk(t.bo.id, t.offset, buf, t.length, compression, t.buf_offset))
            except VramdError:
                raise
            except Exception as e:
                raise blame(e, t)
        return out

    async def drain(self, tasks: list[ChunkTask], bufs: list[StagingBuffer], encs: list[EncodedChunk]) -> None:
        # A batch is one GPU lane, so its records all go to that GPU's data file:
        # one reservation, one vectored write (at most 2 x MAX_BATCH iovecs).
        by_file: dict[object, list] = {}
        for t, enc in zip(tasks, encs):
            group = by_file.get(t.bo.file)
            if group is None:
                group = by_file[t.bo.file] = []
            group.append((t, enc))
        writes, error = [], None
        try:
            for file, pieces in by_file.items():
                iov = []
                for _, enc in pieces:
                    iov.append(enc.head)
                    if enc.payload:
                        iov.append(enc.payload)
                off = file.reserve(sum(enc.record_length for _, enc in pieces))
                writes.append(file.write(iov, off))
                for t, enc in pieces:
                    bo = t.bo
                    bo.records[t.index] = (off, enc.record_length)
                    off += enc.record_length
                    bo.stored_bytes += len(enc.payload)
                    if enc.codec == pb.CODEC_ZERO:
                        bo.zero_bytes += t.length
        except BaseException as e:  # let the writes already started land before reporting
            error = e
        await settle(land_all(writes, error=error))


class DumpJob(_Job):
    direction = Direction.READ

    def __init__(self, ctx: JobContext, dir_fd: int, *, chunk_size: int, compression: Compression,
                 on_progress=None):
        self.writer = ImageWriter(dir_fd, chunk_size=chunk_size, compression=compression.to_pb())
        self.chunk_size = chunk_size
        self.topology_json = b""  # the machine's KFD topology, saved in the manifest
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
                handle = backend.open(spec.id, spec.ref, spec.size, spec.gpu_id, Direction.READ, checked=self._checked)
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
            return await self.writer.commit(self._entries(), self._totals(), self.topology_json)
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
        self._names = [f.name for f in m.files]

    bo_done = staticmethod(release_bo)

    async def fill(self, tasks: list[ChunkTask], bufs: list[StagingBuffer]) -> list[bytes]:
        loop = asyncio.get_running_loop()
        return await settle(loop.run_in_executor(self.io, self._read_records, tasks, bufs[-1]))

    def _where(self, task: ChunkTask) -> str:
        return f"{self._names[task.bo.entry.file_index]} @ {task.record_offset:#x}"

    def _read_records(self, tasks: list[ChunkTask], stored: StagingBuffer) -> list[bytes]:
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
                fi, bo_id = t.bo.entry.file_index, t.bo.id
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
                peeked = nxt is not None and nxt.record_offset == rec_off + rec_len and nxt.bo.entry.file_index == fi
                try:
                    if peeked:
                        self._read(t, views, rec_off + peek_len, then=(nxt, scratch[:min(nxt.record_length, HEAD_PEEK)]))
                    elif views:
                        self._read(t, views, rec_off + peek_len)
                finally:
                    for v in views:
                        v.release()
        finally:
            scratch.release()
        return heads

    def _read(self, task: ChunkTask, views: list, offset: int, then: tuple | None = None) -> None:
        """Fill `views` (bytes of `task`'s record), then optionally `then` = (next task, view of its
        peek), from consecutive file bytes at `offset`; a short read names the record it cuts."""
        want = sum(len(v) for v in views)
        fi = task.bo.entry.file_index
        if then is not None:
            views = views + [then[1]]
        got = self.reader.readv(fi, views, offset)
        if got < want + (len(then[1]) if then is not None else 0):
            cut = task if got < want else then[0]
            raise TruncatedDataError(
                f"data file {self._names[fi]} ends inside a chunk record at {offset + got:#x}",
                bo_id=cut.bo.id, offset=cut.offset)

    def transform(self, tasks: list[ChunkTask], bufs: list[StagingBuffer], heads: list[bytes]) -> list[DecodedChunk]:
        stored, out = bufs[-1], (bufs[0] if len(bufs) > 1 else None)
        decoded = []
        for t, head in zip(tasks, heads):
            try:
                decoded.append(decode_chunk(t.bo.id, t.offset, t.length, head, stored, t.record_length - len(head),
                                            out, where=self._where(t), buf_offset=t.buf_offset))
            except VramdError:
                raise
            except Exception as e:
                raise blame(e, t)
        return decoded

    async def drain(self, tasks: list[ChunkTask], bufs: list[StagingBuffer], decoded: list[DecodedChunk]) -> None:
        if self.verify_only:
            return
        copies = []
        for t, d in zip(tasks, decoded):
            if d.buf is not None:
                item = (t.bo.handle, t.offset, d.buf, d.offset, t.length)
            else:  # a hole: zeros from the pool's read-only zero mapping
                item = (t.bo.handle, t.offset, self.pool.zeros(self.chunk_size), 0, t.length)
            copies.append((t.bo.backend, item))
        await settle(submit_batch(copies))


class RestoreJob(_Job):
    direction = Direction.WRITE

    def __init__(self, ctx: JobContext, reader: ImageReader, *, verify_only: bool = False, on_progress=None,
                 gpu_map: dict[int, int] | None = None):
        self.reader = reader
        self.gpu_map = gpu_map or {}  # image gpu_id -> present gpu_id (from the topologies)
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
                gpu = self.gpu_map.get(entry.gpu_id, entry.gpu_id) if t.gpu_id is None else t.gpu_id
                backend = self._backend(t.ref.kind, t.bo_id)
                handle = backend.open(t.bo_id, t.ref, entry.size, gpu, Direction.WRITE, checked=self._checked)
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
