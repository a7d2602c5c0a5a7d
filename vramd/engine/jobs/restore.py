"""The restore job: image -> BOs.  Copying starts as soon as targets are added (the offload)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...backends import Backend, BoRef, CopyItem, OpenItem
from ...backends.base import holding
from ...errors import IncompleteRestoreError, InvalidRequestError, VramdError
from ...hostmem.batchcopy import copy_batch
from ...hostmem.staging import StagingBuffer
from ...image.codec import DecodedChunk
from ...image.format import chunk_count
from ...image.reader import ImageReader
from ...pb import rpc_pb2 as rpc
from ..pipeline import ChunkTask, Clock, ProgressCallback, settle
from .common import OFF_T_MAX, Ahead, JobContext, RestoreTarget, check_bo_range, landed, submit_batch
from .image_job import ImageJob
from .interface import Intake
from .read import ImageBo, ImageReadEnds


class RestoreEnds(ImageReadEnds):
    """Drain: copy each decoded chunk into its BO (holes from the pool's zero mapping)."""

    def _copy_out(self, tasks: list[ChunkTask[ImageBo]], decoded: list[DecodedChunk], clock: Clock) -> None:
        copies, locks = [], []
        for t, d in zip(tasks, decoded):
            copier, handle = t.bo.copier, t.bo.handle
            assert copier is not None and handle is not None  # set by add(), dropped only when done
            src = d.buf.address + d.offset if d.buf is not None else self.pool.zeros(self.chunk_size).address
            copies.append(copier.plan(handle, t.offset, src, t.length))
            locks.append(copier.write_lock(handle))
        clock.lap("python")
        with holding(locks):
            outcomes, failed = copy_batch(copies)
        clock.lap("out")
        landed(tasks, outcomes, failed)

    async def drain(self, tasks: list[ChunkTask[ImageBo]], bufs: list[StagingBuffer],
                    decoded: list[DecodedChunk]) -> None:
        copies: list[tuple[Backend, CopyItem]] = []
        for t, d in zip(tasks, decoded):
            assert t.bo.backend is not None and t.bo.handle is not None  # set by add(), dropped only when done
            if d.buf is not None:
                item = (t.bo.handle, t.offset, d.buf, d.offset, t.length)
            else:  # a hole: zeros from the pool's read-only zero mapping
                item = (t.bo.handle, t.offset, self.pool.zeros(self.chunk_size), 0, t.length)
            copies.append((t.bo.backend, item))
        await settle(submit_batch(copies))


class RestoreJob(ImageJob):
    def __init__(self, ctx: JobContext, reader: ImageReader, *, on_progress: ProgressCallback | None = None,
                 gpu_map: dict[int, int] | None = None, allow_partial: bool = False) -> None:
        self.gpu_map = gpu_map or {}  # image gpu_id -> present gpu_id (from the topologies)
        self.allow_partial = allow_partial  # BOs of the image may be left without a target
        super().__init__(ctx, reader, RestoreEnds(reader, ctx.pool, ctx.io), on_progress)

    # --- what a session sees (interface.Job) ----------------------------------

    def intake(self, gpu_ids: frozenset[int]) -> Intake[RestoreTarget]:
        return Intake(self, self.bo_target, gpu_ids)

    @staticmethod
    def bo_target(bo: rpc.Bo, ref: BoRef) -> RestoreTarget:
        return RestoreTarget(bo.id, ref, gpu_id=bo.gpu_id if bo.HasField("gpu_id") else None)

    def bo_gpu(self, bo: rpc.Bo) -> int | None:
        """Where a target runs: its gpu_id, else the image's BO's, mapped onto this machine's GPUs; None: the image
        has no such BO (`add` reports it)."""
        if bo.HasField("gpu_id"):
            return bo.gpu_id
        entry = self.reader.bos.get(bo.id)
        return None if entry is None else self.gpu_map.get(entry.gpu_id, entry.gpu_id)

    @staticmethod
    def bo_chunks(bo: rpc.Bo) -> int:
        return 0  # a restore stores no chunk

    # --- the BOs --------------------------------------------------------------

    def _validate(self, targets: Sequence[RestoreTarget]) -> tuple[list[tuple[Backend, OpenItem]], VramdError | None]:
        """The checks that need no syscall, in BO order: what to open for the BOs before the first
        that fails, and its error (reads the job's state only: also run in a worker thread, open_ahead)."""
        valid: list[tuple[Backend, OpenItem]] = []
        seen: set[int] = set()
        entries, bos, limit, gpu_map = self.reader.bos, self.bos, self.ctx.max_bo_bytes, self.gpu_map
        kinds: dict[str, Backend] = {}
        try:
            for bo_id, ref, gpu in targets:  # (this runs once per BO: locals only)
                entry = entries.get(bo_id)
                if entry is None:
                    raise InvalidRequestError("the image has no such BO", bo_id=bo_id)
                if bo_id in bos or bo_id in seen:
                    raise InvalidRequestError("BO targeted twice", bo_id=bo_id)
                seen.add(bo_id)
                size = entry.size
                if not (size <= limit and 0 <= ref.offset <= OFF_T_MAX - size):
                    check_bo_range(bo_id, size, ref, limit)  # raises what is wrong
                if gpu is None:
                    gpu = entry.gpu_id
                    gpu = gpu_map.get(gpu, gpu)
                backend = kinds.get(ref.kind) or kinds.setdefault(ref.kind, self._backend(ref.kind, bo_id))
                valid.append((backend, (bo_id, ref, size, gpu)))
        except VramdError as e:
            return valid, e
        return valid, None

    def add(self, targets: Iterable[RestoreTarget], ahead: Ahead | None = None) -> None:
        """Validate targets and start copying into them at once (the offload).

        `ahead`: BOs opened by `open_ahead` in a worker thread; those used are taken from it."""
        todo = list(targets)
        try:
            valid, error = self._validated(todo, ahead)  # raised once the BOs before it are open: the first error wins
            entries, cs = self.reader.bos, self.ends.chunk_size
            for (backend, (bo_id, _, size, gpu)), handle in zip(valid, self._open_all(valid, ahead)):
                self.bos[bo_id] = ImageBo(bo_id, gpu, size, backend, handle, chunks_left=chunk_count(size, cs),
                                          entry=entries[bo_id])
            if error is not None:
                raise error
            for t in todo:
                self._queue(self.bos[t.bo_id])
        except VramdError as e:
            self._fail(e)
            raise

    def _check_complete(self) -> None:
        missing = [bo.id for bo in self.manifest.bos if bo.id not in self.bos]
        if missing and not self.allow_partial:
            raise IncompleteRestoreError(
                f"{len(missing)} BO(s) of the image were given no target (first: {missing[0]})", bo_id=missing[0])
