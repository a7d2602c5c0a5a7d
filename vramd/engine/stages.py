"""What a job hands the pipeline (vramd.engine.pipeline), and what it gets back.

A batch is one staging buffer's worth of work: a full chunk alone, or as
many small chunks (pieces of small BOs, tails of big ones) as fit, each in
its own page-aligned slot of the buffer (`ChunkTask.buf_offset`).  A job
supplies the `Ends` a batch goes through (fill, transform, drain; or, for
`InlineEnds`, the whole batch as one blocking call in a copy thread) and
the pipeline reports its `Progress`; `StageTimes` and `Clock` time the
stages where asked.

Every piece's slot starts with one free page (its *head page*) before its
bytes: a dump puts the record's head there, right before the payload, so a
record can go to the image file in one aligned write (O_DIRECT), and a
restore reads a whole record into a slot in one call.
"""
from __future__ import annotations

import asyncio
import enum
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, Generic, Protocol, TypedDict, TypeVar, runtime_checkable

from ..backends import Backend
from ..hostmem.staging import StagingBuffer
from ..image.reader import Loc
from ..units import PAGE, round_up

SLOT_ALIGN = PAGE  # pieces of a batch start at page-aligned offsets of the staging buffer
HEAD_PAGE = PAGE  # free bytes before every piece in its slot (a record's head goes there)
# At most this many pieces per batch: a dump writes a batch's records with one
# pwritev of two iovecs (head, payload) per piece, which must stay under IOV_MAX (1024).
MAX_BATCH = 256


class Declined(enum.Enum):
    """What InlineEnds.run returns for a batch it leaves to the three stages (it has done nothing to it)."""

    DECLINED = "declined"


DECLINED: Final = Declined.DECLINED


def slot_size(length: int) -> int:
    """The bytes of staging buffer a piece of `length` bytes occupies in a batch (its head page included)."""
    return HEAD_PAGE + round_up(length, SLOT_ALIGN)


T = TypeVar("T")


async def settle(fut: Awaitable[T]) -> T:
    """Await a copy that cannot be interrupted.

    If the awaiting task is cancelled, keep waiting until the copy has
    landed before propagating the cancellation, so no staging buffer is
    reused or unmapped while a thread or DMA engine still uses it.
    """
    task = asyncio.ensure_future(fut)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                pass
        raise


class PipelineBo(Protocol):
    """What the pipeline needs of a job's per-BO record (dump, restore and verify each have their own)."""

    id: int
    chunks_left: int  # chunks not yet landed; the pipeline counts it down

    @property
    def backend(self) -> Backend | None: ...  # None: the job copies to no BO (verify)


BoT = TypeVar("BoT", bound=PipelineBo)


@dataclass(eq=False)
class ChunkTask(Generic[BoT]):
    bo: BoT          # the job's per-BO record
    index: int       # chunk number within the BO
    offset: int      # byte offset within the BO
    length: int      # raw bytes
    record_offset: int = 0  # restore: where the record is in its data file
    record_length: int = 0
    loc: Loc | None = None  # restore: the record (None: a format v2 hole, no record)
    buf_offset: int = HEAD_PAGE  # where in the batch's staging buffer(s) this piece's bytes go (after its head page)


def blame(exc: BaseException, task: ChunkTask[BoT]) -> BaseException:
    """Mark an unexpected (non-VramdError) exception with the piece it happened on."""
    if not hasattr(exc, "vramd_task"):
        try:
            exc.vramd_task = task  # type: ignore[attr-defined]  # read back by the worker's bug report
        except AttributeError:  # an exception type that takes no attributes
            pass
    return exc


def unpin(exc: BaseException | None) -> None:
    """Drop the locals of the finished frames an error passed through.

    They can hold views into the staging buffers (a batch's payloads, an
    iovec), and the job's error outlives the job: kept, it would keep the
    pool from ever unmapping those buffers.  The traceback itself stays.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


FilledT = TypeVar("FilledT")    # what a job's fill hands its transform
ProductT = TypeVar("ProductT")  # what its transform hands its drain
LandedT = TypeVar("LandedT")    # what its inline run hands `landed`


class Ends(Protocol[BoT, FilledT, ProductT]):
    """The job-specific stages; each is called once per batch, with the batch's pieces in slot order.

    Every piece's bytes live at its `buf_offset` in the staging buffers.  A
    stage that fails raises the error of the first piece that failed, naming
    that piece's BO and offset.
    """

    chunk_size: int
    buffers_per_chunk: int

    async def fill(self, tasks: list[ChunkTask[BoT]], bufs: list[StagingBuffer]) -> FilledT: ...
    def transform(self, tasks: list[ChunkTask[BoT]], bufs: list[StagingBuffer], filled: FilledT) -> ProductT: ...
    async def drain(self, tasks: list[ChunkTask[BoT]], bufs: list[StagingBuffer], product: ProductT) -> None: ...
    def bo_done(self, bo: BoT) -> None: ...


@runtime_checkable
class InlineEnds(Protocol[BoT, LandedT]):
    """What ends that can also run a whole batch as one blocking call in a copy thread have besides `Ends`."""

    def inline(self, tasks: list[ChunkTask[BoT]]) -> bool:
        """True when `run` can do this batch (every piece a CPU copy); else the three stages do it."""

    def run(self, tasks: list[ChunkTask[BoT]], bufs: list[StagingBuffer],
            times: StageTimes | None) -> LandedT | Declined:
        """Fill, transform and drain the batch (blocking, in a copy thread); returns what `landed` takes, or
        DECLINED, having done nothing, for a batch the three stages serve better (e.g. one that would wait on
        a device: the copy thread would wait with it)."""

    def landed(self, tasks: list[ChunkTask[BoT]], product: LandedT) -> None:
        """Back on the event loop after `run`: record what the batch produced."""


class Gate(Protocol[BoT]):
    """What holds a job's chunks back until their bytes may be read (a streamed restore's supply: a chunk's
    record is read only once the client said it is final).  The pipeline asks before it takes staging for a
    chunk, so that a chunk held back holds no staging memory."""

    def is_ready(self, task: ChunkTask[BoT]) -> bool:
        """Whether `task` may be read now (never waits: a batch takes only ready chunks beside its first)."""

    async def ready(self, task: ChunkTask[BoT]) -> None:
        """Return once `task` may be read, or once the gate is stopped; raise (typed) if it never may be."""

    def read(self, tasks: list[ChunkTask[BoT]]) -> None:
        """These chunks have landed: each has read and checked its bytes (none reads them again)."""

    def stop(self) -> None:
        """The job has stopped: every wait returns, and none waits from now on."""


class StageTimes:
    """Where a job's batches spend their time, per stage: wall and thread-CPU seconds, summed over batches.

    Off by default (EngineConfig.stage_times): when on, each stage is timed
    with two clock reads.  Stages: `supply` (a streamed restore's chunk waiting for its bytes: `Gate`),
    `staging` (waiting for a staging buffer),
    `fill`, `transform`, `drain` (the three-stage path, wall time on the event
    loop for fill/drain); `queue` (an inline batch waiting for a copy thread),
    `copy` (batchcopy: copy + zero scan + xxh3, GIL released), `python`
    (per-piece Python work of an inline batch: heads, checks; its wall time
    beyond its CPU time is time spent waiting for the GIL), `write`/`read`
    (file I/O of an inline batch), `out` (restore: staging -> BO).
    """

    def __init__(self) -> None:
        self.batches = 0   # batches run
        self.pieces = 0    # pieces in them
        self.largest = 0   # pieces in the largest batch
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, stage: str, wall: float, cpu: float = 0.0) -> None:
        with self._lock:
            self.wall[stage] = self.wall.get(stage, 0.0) + wall
            self.cpu[stage] = self.cpu.get(stage, 0.0) + cpu

    def as_dict(self) -> StageTimesDict:
        with self._lock:
            return {"batches": self.batches, "pieces": self.pieces, "largest": self.largest,
                    "wall": dict(self.wall), "cpu": dict(self.cpu)}


class StageTimesDict(TypedDict):
    """StageTimes as plain data (bench/throughput.py reports it)."""

    batches: int
    pieces: int
    largest: int
    wall: dict[str, float]
    cpu: dict[str, float]


class Clock:
    """Times consecutive steps of one thread into a StageTimes (nothing at all when `times` is None)."""

    __slots__ = ("cpu", "times", "wall")

    def __init__(self, times: StageTimes | None) -> None:
        self.times = times
        if times is not None:
            self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def lap(self, stage: str) -> None:
        if self.times is not None:
            wall, cpu = time.perf_counter(), time.thread_time()
            self.times.add(stage, wall - self.wall, cpu - self.cpu)
            self.wall, self.cpu = wall, cpu


@dataclass
class Progress:
    bos_total: int = 0
    bos_done: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    chunks_done: int = 0
    per_gpu_bytes: dict[int, int] = field(default_factory=dict)
    per_backend_bytes: dict[str, int] = field(default_factory=dict)  # BO bytes each backend copied

    def landed(self, gpu_id: int, task: ChunkTask[BoT], bo_done: Callable[[BoT], None]) -> None:
        """Count one piece that landed on GPU `gpu_id`'s lane; `bo_done(bo)` once its BO's last chunk has."""
        self.bytes_done += task.length
        self.chunks_done += 1
        self.per_gpu_bytes[gpu_id] = self.per_gpu_bytes.get(gpu_id, 0) + task.length
        backend = task.bo.backend  # None: verify copies nowhere
        if backend is not None:
            self.per_backend_bytes[backend.name] = self.per_backend_bytes.get(backend.name, 0) + task.length
        task.bo.chunks_left -= 1
        if task.bo.chunks_left == 0:
            self.bos_done += 1
            bo_done(task.bo)  # e.g. unmap it now, not at the end of the job

    def landed_batch(self, gpu_id: int, tasks: list[ChunkTask[BoT]], bo_done: Callable[[BoT], None]) -> None:
        """`landed` of every piece of a batch, with the totals added once (the same sums)."""
        nbytes = 0
        by_backend: dict[str, int] = {}
        for task in tasks:
            nbytes += task.length
            backend = task.bo.backend  # None: verify copies nowhere
            if backend is not None:
                by_backend[backend.name] = by_backend.get(backend.name, 0) + task.length
            task.bo.chunks_left -= 1
            if task.bo.chunks_left == 0:
                self.bos_done += 1
                bo_done(task.bo)  # e.g. unmap it now, not at the end of the job
        self.bytes_done += nbytes
        self.chunks_done += len(tasks)
        self.per_gpu_bytes[gpu_id] = self.per_gpu_bytes.get(gpu_id, 0) + nbytes
        for name, n in by_backend.items():
            self.per_backend_bytes[name] = self.per_backend_bytes.get(name, 0) + n


ProgressCallback = Callable[[Progress], None]


