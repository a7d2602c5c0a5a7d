"""The one pipeline: per-GPU worker pools moving batches of chunks through three stages.

A job (dump, restore or verify) supplies *ends* (vramd.engine.stages): how
to `fill` a staging buffer (dump: backend copy from the BO; restore: read
the records from the image), how to `transform` it in a CPU thread (dump:
hole detection, compression, checksum; restore: checksum verification,
decompression) and how to `drain` it (dump: write the records; restore:
backend copy into the BO).  Everything else is shared: lanes per GPU,
`workers_per_gpu` batches in flight per lane, one staging budget across all
lanes and jobs, the first error winning and stopping the job.  With several
batches in flight per GPU, the fill of batch n+1, the transform of batch n
and the drain of batch n-1 run at once.

Each end is called once per batch (stages.py says what a batch is), so a
batch costs one thread hand-off per stage however many pieces it holds;
progress, `bo_done` and errors stay per piece.

Ends whose every piece is a CPU copy may run a whole batch as one blocking
call (`InlineEnds.run`) in one of the engine's copy threads: fill, transform
and drain of one batch together, with one thread hand-off per batch and the
bytes still in that core's cache from one step to the next.  On a machine
with few cores that beats handing each stage to another thread.  A batch
that `run` declines (its read would wait on a device) takes the three
stages, and its lane then adds `device_workers` batches in flight, once, so
that reads keep waiting on the device while other batches copy out.

A job whose bytes arrive while it runs (a streamed restore) sets a `Gate`:
a worker waits for its first chunk to be ready before it takes staging, and
a batch takes beside it only chunks that are ready.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from ..errors import JobCancelledError, JobError, VramdError
from ..hostmem.staging import StagingBuffer, StagingPool, buffer_unit
from .stages import (
    DECLINED,
    HEAD_PAGE,
    MAX_BATCH,
    SLOT_ALIGN,
    BoT,
    ChunkTask,
    Clock,
    Declined,
    Ends,
    FilledT,
    Gate,
    InlineEnds,
    PipelineBo,
    ProductT,
    Progress,
    ProgressCallback,
    StageTimes,
    blame,
    settle,
    slot_size,
    unpin,
)

__all__ = ["DECLINED", "HEAD_PAGE", "MAX_BATCH", "SLOT_ALIGN", "ChunkTask", "Clock", "Declined", "Ends", "Gate",
           "InlineEnds", "Pipeline", "PipelineBo", "Progress", "ProgressCallback", "StageTimes", "blame", "settle",
           "slot_size"]

log = logging.getLogger(__name__)


class _Stopped(enum.Enum):
    """What Pipeline._run_inline returns for a batch it did not start: the job had stopped while it was queued."""

    STOPPED = "stopped"


_B = TypeVar("_B", bound=PipelineBo)
_BoIn = TypeVar("_BoIn", bound=PipelineBo, contravariant=True)


class Shape(Protocol[_BoIn]):
    """What the pipeline itself asks of a job's ends, whatever their stages pass each other."""

    chunk_size: int
    buffers_per_chunk: int

    def bo_done(self, bo: _BoIn) -> None: ...


@dataclass(eq=False)
class _Lane(Generic[BoT]):
    gpu_id: int
    grown: bool = False  # Pipeline._grow ran for it (its device workers were added, if any)
    pending: collections.deque[Iterator[ChunkTask[BoT]]] = field(default_factory=collections.deque)
    carry: ChunkTask[BoT] | None = None  # taken from pending but did not fit a batch: the next one to go
    workers: list[asyncio.Task[None]] = field(default_factory=list)
    changed: asyncio.Future[None] | None = None


class _ThreeStages(Generic[BoT, FilledT, ProductT]):
    """A batch through a job's three stages: fill (on the loop), transform (in a CPU thread), drain (on the loop),
    each stage's output typed as the next one takes it.  (It holds no pipeline: the pipeline holds it, and a
    cycle between them would leave a finished job to the cyclic GC.)"""

    def __init__(self, ends: Ends[BoT, FilledT, ProductT]) -> None:
        self.ends = ends

    async def run(self, p: Pipeline[BoT], tasks: list[ChunkTask[BoT]], bufs: list[StagingBuffer]) -> None:
        # Its own frame: what the stages hand on (views into `bufs`) dies with it.
        ends = self.ends
        clock = Clock(p.times)
        filled = await ends.fill(tasks, bufs)
        clock.lap("fill")
        product = await settle(asyncio.get_running_loop().run_in_executor(
            p.cpu, self.transform, p, tasks, bufs, filled))
        clock.lap("transform")
        if p.error is not None:  # stopped meanwhile: nothing more of this batch is written
            raise p.dropped(tasks[0])
        await ends.drain(tasks, bufs, product)
        clock.lap("drain")

    def transform(self, p: Pipeline[BoT], tasks: list[ChunkTask[BoT]], bufs: list[StagingBuffer],
                  filled: FilledT) -> ProductT:
        """`ends.transform` in a CPU thread, unless the job stopped while the batch was queued for one."""
        if p.error is not None:
            raise p.dropped(tasks[0])
        return self.ends.transform(tasks, bufs, filled)


class Pipeline(Generic[BoT]):
    def __init__(self, ends: Ends[BoT, FilledT, ProductT], pool: StagingPool, cpu: Executor, *, workers_per_gpu: int,
                 device_workers: int = 0, on_progress: ProgressCallback | None = None,
                 copier: Executor | None = None, times: StageTimes | None = None) -> None:
        """`workers_per_gpu`: batches in flight per GPU lane.  `device_workers`: batches a lane adds the
        first time a copy thread declines one of its batches (it would wait on a device: `_grow`).
        `copier`: the copy threads that run inline batches (None: always the three stages).  `times`:
        where to add stage timings."""
        self.ends: Shape[BoT] = ends
        self.pool = pool
        self.cpu = cpu
        self.copier = copier
        self.times = times
        self._three: Callable[[Pipeline[BoT], list[ChunkTask[BoT]], list[StagingBuffer]], Awaitable[None]] = \
            _ThreeStages(ends).run
        # ends that can run a batch whole (InlineEnds: what their run hands `landed` is theirs alone)
        self._inline: InlineEnds[BoT, object] | None = \
            ends if copier is not None and isinstance(ends, InlineEnds) else None
        self.workers_per_gpu = max(1, workers_per_gpu)
        self.device_workers = max(0, device_workers)
        self.on_progress = on_progress
        # called once, with the first error (e.g. to end an RPC session at once)
        self.on_fail: Callable[[BaseException], None] | None = None
        self.progress = Progress()
        # what holds chunks back until they may be read (a streamed restore's supply); None: nothing does
        self.gate: Gate[BoT] | None = None
        self._lanes: dict[int, _Lane[BoT]] = {}
        self._closed = False
        self.error: BaseException | None = None

    @property
    def lane_count(self) -> int:
        """Lanes opened so far (each runs `workers_per_gpu` worker tasks)."""
        return len(self._lanes)

    # --- feeding -----------------------------------------------------------

    def add_covered(self, nbytes: int) -> None:
        """A BO whose bytes another BO of the job moves (the same dmabuf given twice): done on arrival."""
        if self.error is not None:
            raise self.error
        if self._closed:
            raise JobError("the job takes no more BOs")
        self.progress.bos_total += 1
        self.progress.bos_done += 1
        self.progress.bytes_total += nbytes
        self.progress.bytes_done += nbytes

    def add(self, gpu_id: int, chunks: Iterator[ChunkTask[BoT]], nbytes: int) -> None:
        """Queue one BO's chunks (generated lazily) on its GPU's lane."""
        if self.error is not None:
            raise self.error
        if self._closed:
            raise JobError("the job takes no more BOs")
        if nbytes == 0:  # nothing to copy: done on arrival
            self.progress.bos_total += 1
            self.progress.bos_done += 1
            return
        lane = self._lanes.get(gpu_id)
        if lane is None:
            lane = self._lanes[gpu_id] = _Lane[BoT](gpu_id)
            self._start_workers(lane, self.workers_per_gpu)
        lane.pending.append(chunks)
        self.progress.bos_total += 1
        self.progress.bytes_total += nbytes
        self._poke(lane)

    def close_input(self) -> None:
        self._closed = True
        for lane in self._lanes.values():
            self._poke(lane)

    def fail(self, exc: BaseException) -> None:
        """Record the first error; every lane stops taking new chunks."""
        first = self.error is None
        if first:
            self.error = exc
        for lane in self._lanes.values():
            self._poke(lane)
        if self.gate is not None:
            self.gate.stop()
        if first and self.on_fail is not None:
            self.on_fail(exc)

    def cancel(self, reason: str = "job cancelled") -> None:
        self.fail(JobCancelledError(reason))

    def stopped(self) -> bool:
        """Whether the job has failed or been cancelled: no more bytes should move.  Cheap and thread-safe
        (one attribute read): the ends look at it between the pieces of a batch, in the copy threads."""
        return self.error is not None

    @staticmethod
    def dropped(task: ChunkTask[_B]) -> JobCancelledError:
        """The error a batch raises that is dropped because the job has stopped: never the job's own
        (the first error wins, and there is one already), only how the worker knows the batch did not land."""
        return JobCancelledError("the job has stopped: batch dropped", bo_id=task.bo.id, offset=task.offset)

    async def wait(self) -> Progress:
        """The barrier: returns when every queued chunk has landed; raises the first error."""
        self.close_input()
        try:
            while True:
                workers = [w for lane in self._lanes.values() for w in lane.workers]
                outcomes = await asyncio.gather(*workers, return_exceptions=True)
                for out in outcomes:  # a worker that died unreported must not pass for success
                    if isinstance(out, Exception) and self.error is None:
                        self.fail(JobError(f"internal error: a pipeline worker died: {out!r}"))
                if all(w.done() for lane in self._lanes.values() for w in lane.workers):
                    break
        finally:
            # The pipeline is over: drop the callbacks, which close over their owner (a session),
            # so that owner and job are freed by reference counting, not left to the cyclic GC.
            self.on_fail = None
            self.on_progress = None
        if self.error is not None:
            raise self.error
        return self.progress

    # --- workers -----------------------------------------------------------

    def _poke(self, lane: _Lane[BoT]) -> None:
        if lane.changed is not None and not lane.changed.done():
            lane.changed.set_result(None)
        lane.changed = None

    def _take(self, lane: _Lane[BoT]) -> ChunkTask[BoT] | None:
        """The lane's next chunk, if one is ready now (never waits)."""
        task = lane.carry
        if task is not None:
            lane.carry = None
            return task
        while lane.pending:
            task = next(lane.pending[0], None)
            if task is not None:
                return task
            lane.pending.popleft()
        return None

    async def _next(self, lane: _Lane[BoT]) -> ChunkTask[BoT] | None:
        while self.error is None:
            task = self._take(lane)
            if task is not None:
                return task
            if self._closed:
                return None
            if lane.changed is None:
                lane.changed = asyncio.get_running_loop().create_future()
            await asyncio.wait([lane.changed])  # wait() never cancels the shared future
        return None

    def _batch(self, lane: _Lane[BoT], first: ChunkTask[BoT]) -> list[ChunkTask[BoT]]:
        """`first` plus whatever ready chunks of the lane fit beside it in one staging buffer."""
        first.buf_offset = HEAD_PAGE
        tasks = [first]
        limit = buffer_unit(self.ends.chunk_size)  # a whole chunk and its head page fill a buffer
        end = slot_size(first.length)
        while end < limit and len(tasks) < MAX_BATCH:
            task = self._take(lane)
            if task is None:
                break
            slot = slot_size(task.length)
            if end + slot > limit or (self.gate is not None and not self.gate.is_ready(task)):
                lane.carry = task  # too big, or held back by the gate: the lane's next batch starts with it
                self._poke(lane)
                break
            task.buf_offset = end + HEAD_PAGE
            end += slot
            tasks.append(task)
        return tasks

    def _start_workers(self, lane: _Lane[BoT], n: int) -> None:
        first = len(lane.workers)
        lane.workers += [asyncio.create_task(self._worker(lane), name=f"vramd-gpu{lane.gpu_id:x}-w{first + i}")
                         for i in range(n)]

    def _grow(self, lane: _Lane[BoT]) -> None:
        """A copy thread declined one of the lane's batches: its reads wait on a device, in the io threads
        (the three stages).  The lane's batches would then take turns between those reads and their
        copy-outs, and the device would idle while they copy out; `device_workers` more batches in flight
        keep reads waiting on it meanwhile (docs/engine.md).  Once per lane: a lane that never waits on a
        device (tmpfs, the page cache) keeps its own count, and its staging stays warm in the caches."""
        if lane.grown:
            return
        lane.grown = True
        if self.device_workers and self.error is None:
            self._start_workers(lane, self.device_workers)

    async def _stages(self, lane: _Lane[BoT], tasks: list[ChunkTask[BoT]], bufs: list[StagingBuffer]) -> None:
        inline = self._inline
        if inline is not None and inline.inline(tasks):
            assert self.copier is not None
            queued = time.perf_counter() if self.times is not None else 0.0
            product = await settle(asyncio.get_running_loop().run_in_executor(
                self.copier, self._run_inline, inline, tasks, bufs, queued))
            if product is _Stopped.STOPPED:
                raise self.dropped(tasks[0])
            if product is not DECLINED:
                inline.landed(tasks, product)
                return
            self._grow(lane)
        await self._three(self, tasks, bufs)

    def _run_inline(self, inline: InlineEnds[BoT, object], tasks: list[ChunkTask[BoT]], bufs: list[StagingBuffer],
                    queued: float) -> object:
        if self.times is not None:
            self.times.add("queue", time.perf_counter() - queued)
        if self.error is not None:  # queued behind other batches, and the job stopped meanwhile: never started
            return _Stopped.STOPPED
        return inline.run(tasks, bufs, self.times)

    async def _worker(self, lane: _Lane[BoT]) -> None:
        ends = self.ends
        while (first := await self._next(lane)) is not None:
            tasks: list[ChunkTask[BoT]] = [first]
            clock = Clock(self.times)
            try:  # e.g. a chunk larger than the whole budget: the job fails with it, never silently
                if self.gate is not None and not self.gate.is_ready(first):
                    await self.gate.ready(first)  # before taking staging: a chunk held back holds none
                    clock.lap("supply")
                    if self.error is not None:
                        break
                bufs = await self.pool.acquire(ends.chunk_size, ends.buffers_per_chunk)
            except VramdError as e:
                self.fail(e)
                break
            except asyncio.CancelledError:
                self.fail(JobCancelledError("job cancelled while copying", bo_id=first.bo.id, offset=first.offset))
                raise
            except Exception as e:
                log.exception("internal error in pipeline")
                self.fail(JobError(f"internal error: {e!r}", bo_id=first.bo.id, offset=first.offset))
                break
            clock.lap("staging")
            try:
                if self.error is not None:
                    break
                tasks = self._batch(lane, first)
                if self.times is not None:
                    self.times.batches += 1
                    self.times.pieces += len(tasks)
                    self.times.largest = max(self.times.largest, len(tasks))
                await self._stages(lane, tasks, bufs)
            except VramdError as e:
                unpin(e)
                self.fail(e)
            except asyncio.CancelledError:
                self.fail(JobCancelledError("job cancelled while copying", bo_id=first.bo.id, offset=first.offset))
                raise
            except Exception as e:  # a bug, not bad input: still a typed error for the client
                log.exception("internal error in pipeline")
                unpin(e)
                task = getattr(e, "vramd_task", first)
                self.fail(JobError(f"internal error: {e!r}", bo_id=task.bo.id, offset=task.offset))
            else:
                if self.gate is not None:
                    self.gate.read(tasks)
                if self.on_progress is None:  # nobody watches each piece land: count the batch at once
                    self.progress.landed_batch(lane.gpu_id, tasks, self.ends.bo_done)
                else:
                    for task in tasks:
                        self.progress.landed(lane.gpu_id, task, self.ends.bo_done)
                        self.on_progress(self.progress)
            finally:
                self.pool.release(bufs)
