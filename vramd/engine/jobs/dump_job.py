"""The dump job: BOs -> a new image.  Its BOs (checked, opened, their dmabufs given twice copied once), its
parents (an incremental dump), and at its end the manifest's BO entries, chunk table and totals; what becomes
of each batch of chunks (holes, references, records and their writes) is dump.py's `DumpEnds`.
"""
from __future__ import annotations

import asyncio
import posixpath
import weakref
from collections.abc import Hashable, Iterable, Iterator, Sequence

from ...backends import Backend, BackendKind, BoHandle, BoRef, Direction, OpenItem
from ...errors import InvalidRequestError, LimitExceededError, VramdError
from ...image.chunks import ChunkIndex
from ...image.compression import Compression
from ...image.fileio import check_attached, check_direct
from ...image.format import chunk_count
from ...image.names import data_file_name, manifest_tmp_name
from ...image.reader import ImageReader
from ...image.writer import DataFileWriter, ImageWriter
from ...pb import image_pb2 as pb
from ...pb import rpc_pb2 as rpc
from ..pipeline import ChunkTask, ProgressCallback, settle
from .common import OFF_T_MAX, Ahead, BoSpec, JobBase, JobContext, check_bo_range
from .dump import DEFAULT_MAX_CHAIN, DumpBo, DumpEnds
from .interface import Intake

SOURCE_KINDS: dict[str, pb.SourceKind] = {BackendKind.PROCMEM: pb.SOURCE_PROCMEM, BackendKind.MMAP: pb.SOURCE_MMAP,
                                          BackendKind.SDMA: pb.SOURCE_SDMA}


class DumpJob(JobBase[DumpBo, BoSpec]):
    direction = Direction.READ

    def __init__(self, ctx: JobContext, writer: ImageWriter, *, compression: Compression,
                 on_progress: ProgressCallback | None = None, parent: ImageReader | None = None,
                 parent_hint: str = "", dedup: bool = True, max_chain: int = DEFAULT_MAX_CHAIN) -> None:
        """`writer`: the new image's files (the client creates and attaches them, in-process too).
        `parent`: an incremental dump's parent image, opened with its own parents (the job closes it)."""
        self.parents: list[pb.ParentRef] = []
        self.index = ChunkIndex(dedup=dedup)
        self.writer = writer
        try:
            if parent is not None:
                self._chain(parent, parent_hint, max_chain)
            self.parent = parent
            self.chunk_size = writer.chunk_size
            self.topology_json = b""  # the machine's KFD topology, saved in the manifest
            self._buffers: dict[Hashable, DumpBo] = {}  # Backend.identity -> its BO: one dmabuf given twice copied once
            self.ends = DumpEnds(self.writer, compression, writer.chunk_size, index=self.index, parent=parent,
                                 workers=ctx.compress_workers)
            super().__init__(ctx, self.ends, on_progress)
            # through a weak reference: the pipeline holds the ends, and a bound method would make a cycle that
            # keeps the job's chunk index until the cyclic GC runs
            pipeline = weakref.ref(self.pipeline)
            self.ends.stopped = lambda: (p := pipeline()) is None or p.stopped()
        except BaseException:
            writer.close()
            if parent is not None:
                parent.close()
            raise

    def inflight(self, ctx: JobContext) -> int:
        """At most dump_inflight_per_gpu: more only keep more copy threads busy for no gain (EngineConfig)."""
        return ctx.dump_workers_per_gpu or ctx.workers_per_gpu

    def _chain(self, parent: ImageReader, hint: str, max_chain: int) -> None:
        """The child's parents: the parent, then the parent's own, each with where it lies from the child."""
        m = parent.manifest
        if m.format_version < 2:
            raise InvalidRequestError("the parent image is format v1: it has no content hashes to refer to")
        if len(m.parents) + 1 > max_chain:
            raise LimitExceededError(f"the parent's chain is {len(m.parents) + 1} images deep; at most {max_chain} "
                                     "are allowed (max_chain_depth): write a full image, or flatten the parent "
                                     "(vramctl flatten)")
        if posixpath.isabs(hint):
            raise InvalidRequestError("the parent hint must be a path relative to the image directory")
        self.parents = [pb.ParentRef(image_id=m.image_id, manifest_hash=parent.manifest_hash,
                                     relative_path=posixpath.normpath(hint) if hint else "")]
        for ref in m.parents:
            rel = posixpath.normpath(posixpath.join(hint, ref.relative_path)) if hint and ref.relative_path else ""
            self.parents.append(pb.ParentRef(image_id=ref.image_id, manifest_hash=ref.manifest_hash,
                                             relative_path=rel))
        if parent.chunk_entries is not None:  # found off the event loop (Engine.open_parent)
            self.index.adopt(parent.chunk_entries)
        else:
            self.index.add_parent(m, 1)

    # --- what a session sees (interface.Job) ----------------------------------

    @property
    def data_files_per_gpu(self) -> int:
        return self.writer.stripes

    @property
    def manifest_name(self) -> str:
        return manifest_tmp_name(self.writer.image_id)

    def files_needed(self) -> list[tuple[int, str]]:
        """The parents' data files the client must still attach (a dump's parent is image #1)."""
        return [(k + 1, name) for k, name in self.parent.needed()] if self.parent is not None else []

    @property
    def ready(self) -> bool:
        return self.parent is None or self.parent.ready

    async def attach_file(self, image: int, name: str, fd: int, direct: int | None) -> None:
        """A parent's data file (`image` k >= 1: the k-th parent; 0 is this dump's own, named by its gpu_id)."""
        if self.parent is None:
            raise InvalidRequestError(f"{name!r} is not a file this session needs (a dump without a parent needs "
                                      "only its own data files, each with its gpu_id)")
        if image < 1:
            raise InvalidRequestError(f"{name!r}: a dump's own data file names its gpu_id")
        await self.parent.attach(image - 1, name, fd, direct)

    def attach_data_file(self, image: int, name: str, gpu: int, stripe: int, fd: int,
                         direct: int | None) -> DataFileWriter:
        """The dump's data file for one GPU (one of its data_files_per_gpu: `stripe`): created by the client
        under the name the image id gives it.  Attached, not yet written into (`publish_data_files`)."""
        writer = self.writer
        writer.check_stripe(gpu, stripe)
        want = data_file_name(writer.image_id, gpu, stripe)
        if image != 0 or name != want:
            what = f"data file {stripe} of gpu_id {gpu:#x}" if stripe else f"data file of gpu_id {gpu:#x}"
            raise InvalidRequestError(f"the {what} must be {want} (the client creates it as {want}.tmp); got "
                                      f"{name!r} of image #{image}")
        check_attached(fd, want + ".tmp", write=True)
        if direct is not None:
            check_direct(direct, fd, want + ".tmp", write=True)
        return writer.attach(gpu, fd, direct, stripe, publish=False)

    def publish_data_files(self, files: Sequence[DataFileWriter]) -> None:
        self.writer.publish(files)

    def detach_data_files(self, files: Sequence[DataFileWriter]) -> None:
        self.writer.detach(files)

    def intake(self, gpu_ids: frozenset[int]) -> Intake[BoSpec]:
        return Intake(self, self.bo_spec, gpu_ids, self.chunk_size)

    @staticmethod
    def bo_spec(bo: rpc.Bo, ref: BoRef) -> BoSpec:
        # an unset gpu_id reads as 0, the default GPU of a dump (positional: this runs once per BO)
        return BoSpec(bo.id, bo.size, ref, bo.gpu_id, bo.alloc_flags, bo.va_addr, bo.name)

    @staticmethod
    def bo_gpu(bo: rpc.Bo) -> int:
        return bo.gpu_id  # an unset gpu_id: 0, the dump's default GPU

    def bo_chunks(self, bo: rpc.Bo) -> int:
        """The chunks a BO makes; its GPU's first data file (stripe 0) must be attached before it."""
        size = bo.size
        if not size:
            return 0
        if (bo.gpu_id, 0) not in self.writer.files:
            raise InvalidRequestError(f"no data file is attached for gpu_id {bo.gpu_id:#x} (AttachFiles it before "
                                      "its first BO)", bo_id=bo.id)
        return -(-size // self.chunk_size)

    def seal(self, manifest_fd: int | None) -> None:
        """Start: the manifest's file (`manifest_name`, created by the client), checked, written at the end."""
        if manifest_fd is None:
            raise InvalidRequestError("a dump's Start names the manifest's file (manifest_fd_index: "
                                      f"{self.manifest_name}, created by the client)")
        check_attached(manifest_fd, self.manifest_name, write=True)
        self.writer.manifest_fd = manifest_fd

    # --- the BOs --------------------------------------------------------------

    def _validate(self, specs: Sequence[BoSpec]) -> tuple[list[tuple[Backend, OpenItem]], VramdError | None]:
        """The checks that need no syscall, in BO order: what to open for the BOs before the first
        that fails, and its error (reads the job's state only: also run in a worker thread, open_ahead)."""
        valid: list[tuple[Backend, OpenItem]] = []
        seen: set[int] = set()
        bos, limit = self.bos, self.ctx.max_bo_bytes  # (this runs once per BO: locals only)
        kinds: dict[str, Backend] = {}
        try:
            for spec in specs:
                bo_id, size, ref = spec.id, spec.size, spec.ref
                if bo_id in bos or bo_id in seen:
                    raise InvalidRequestError("BO id given twice", bo_id=bo_id)
                seen.add(bo_id)
                if not (0 <= size <= limit and 0 <= ref.offset <= OFF_T_MAX - size):
                    check_bo_range(bo_id, size, ref, limit)  # raises what is wrong
                backend = kinds.get(ref.kind) or kinds.setdefault(ref.kind, self._backend(ref.kind, bo_id))
                valid.append((backend, (bo_id, ref, size, spec.gpu_id)))
        except VramdError as e:
            return valid, e
        return valid, None

    def add(self, specs: Iterable[BoSpec], ahead: Ahead | None = None) -> None:
        """Validate and queue BOs; a bad BO fails the whole dump (an image is all or nothing).

        `ahead`: BOs opened by `open_ahead` in a worker thread; those used are taken from it."""
        todo = list(specs)
        queue = []
        try:
            valid, error = self._validated(todo, ahead)  # raised once the BOs before it are open: the first error wins
            for spec, (backend, _), handle in zip(todo, valid, self._open_all(valid, ahead)):
                key, same = self._same_buffer(spec, backend, handle)
                if same is not None:  # the BO another process (or this one) passed already: its chunks serve
                    backend.release(handle)
                    bo = DumpBo(spec.id, spec.gpu_id, spec.size, None, None, spec=spec, alias_of=same)
                else:
                    bo = DumpBo(spec.id, spec.gpu_id, spec.size, backend, handle,
                                chunks_left=chunk_count(spec.size, self.chunk_size), spec=spec)
                    bo.file = self.writer.data_file(spec.gpu_id) if spec.size else None
                    if key is not None:
                        self._buffers[key] = bo
                self.bos[spec.id] = bo
                queue.append(bo)
            if error is not None:
                raise error
            for bo in queue:
                if bo.alias_of is not None:
                    self.pipeline.add_covered(bo.size)
                else:
                    self.pipeline.add(bo.gpu_id, self._chunks(bo), bo.size)
        except VramdError as e:
            self._fail(e)
            raise

    def _same_buffer(self, spec: BoSpec, backend: Backend,
                     handle: BoHandle) -> tuple[Hashable | None, DumpBo | None]:
        """A buffer given before in this dump, as its backend names it (`Backend.identity`: on a kernel's
        dmabuf, the same inode, offset and size; through SDMA, the same imported buffer): (its identity, the
        BO first given with it, or None)."""
        if not spec.size:
            return None, None
        key = backend.identity(handle)
        return key, None if key is None else self._buffers.get(key)

    def _opens_ahead(self, backend: Backend) -> bool:
        """Also the backends whose identity is found off the event loop (SDMA: the imported buffer)."""
        return backend.prepares_identity or backend.cpu_copier() is not None

    def _prepare(self, opened: Sequence[tuple[Backend, BoHandle]]) -> None:
        groups: dict[Backend, list[BoHandle]] = {}
        for backend, handle in opened:
            if backend.prepares_identity:
                groups.setdefault(backend, []).append(handle)
        for backend, handles in groups.items():
            backend.prepare_identity(handles)

    def _chunks(self, bo: DumpBo) -> Iterator[ChunkTask[DumpBo]]:
        for i, off in enumerate(range(0, bo.size, self.chunk_size)):
            yield ChunkTask(bo, i, off, min(self.chunk_size, bo.size - off))

    async def finish(self) -> pb.Manifest:
        """Wait for every chunk, then write the manifest (`writer.commit`; the client then commits the image,
        in-process too: vramd.inproc); returns the manifest."""
        try:
            await self.pipeline.wait()
            # CPU work that grows with the BOs: off the event loop (other clients are answered meanwhile)
            entries, table, totals = await asyncio.get_running_loop().run_in_executor(self.ctx.cpu, self._entries)
            if self.pipeline.error is not None:  # cancelled after the last copy landed: no manifest is written
                raise self.pipeline.error
            return await self.writer.commit(entries, totals, self.topology_json, chunks=table, parents=self.parents)
        finally:
            self._release_all()
            if self.parent is not None:
                self.parent.close()
            await settle(self.writer.aclose())

    def _entries(self) -> tuple[pb.Manifest, pb.ChunkTable, pb.Totals]:
        """The manifest's BO entries (in a manifest holding only them: ImageWriter.commit), chunk table and
        totals (CPU work that grows with the BOs: a worker thread's, never the event loop's: summing 49,152
        entries' fields there held it ~80 ms).  The totals are summed from the job's own numbers, not read
        back from the protobuf entries.  Each entry is made in place, with the fields most BOs leave at zero
        set only where they are not: 10,000 small BOs took ~35 ms with every field given to a new message."""
        bos = list(self.bos.values())
        table, refs = self.index.table([bo.chunk_refs(chunk_count(bo.size, self.chunk_size)) for bo in bos])
        out = pb.Manifest()
        add = out.bos.add
        rows = []  # per BO: size, stored, zero, dedup, parent and delta bytes
        for bo, chunk_refs in zip(bos, refs):
            s = bo.spec
            assert s is not None
            src = bo.alias_of or bo
            alias = bo.alias_of is not None
            values = (s.size, 0 if alias else bo.stored_bytes, src.zero_bytes,
                      s.size - src.zero_bytes - src.parent_bytes if alias else bo.dedup_bytes, src.parent_bytes,
                      0 if alias else bo.delta_bytes)
            e = add(id=s.id, size=s.size, source=SOURCE_KINDS.get(s.ref.kind, pb.SOURCE_UNSPECIFIED),
                    source_offset=s.ref.offset, chunk_refs=chunk_refs, stored_bytes=values[1])
            if s.gpu_id:
                e.gpu_id = s.gpu_id
            if s.alloc_flags:
                e.alloc_flags = s.alloc_flags
            if s.va_addr:
                e.va_addr = s.va_addr
            if s.name:
                e.name = s.name
            if src.file is not None and src.file.index:
                e.file_index = src.file.index
            if values[2]:
                e.zero_bytes = values[2]
            if values[3]:
                e.dedup_bytes = values[3]
            if values[4]:
                e.parent_bytes = values[4]
            if values[5]:
                e.delta_bytes = values[5]
            rows.append(values)
        sums = [sum(col) for col in zip(*rows)] if rows else [0] * 6
        totals = pb.Totals(compressed_records=sum(bo.compressed_records for bo in bos), bo_count=len(bos),
                           bo_bytes=sums[0], stored_bytes=sums[1], zero_bytes=sums[2],
                           chunk_count=sum(len(r) for r in refs),
                           dedup_bytes=sums[3], parent_bytes=sums[4], delta_bytes=sums[5],
                           record_count=list(table.image).count(0))
        return out, table, totals
