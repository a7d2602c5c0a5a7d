"""What a session sees of a job (dump, restore or verify): the `Job` protocol, and the `Intake` of one AddBos.

A session (vramd.service) drives any job through this interface alone: the
files the job needs from the client and their attaching, a dump's own data
files, the BOs of each AddBos made into the job's items (`Job.intake`),
sealing, progress, the first error, cancelling and the end (`finish`).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

from ...backends import BoRef
from ...image.writer import DataFileWriter
from ...pb import image_pb2 as pb
from ...pb import rpc_pb2 as rpc
from ..pipeline import Progress
from .common import Ahead, BoSpec, ItemT, JobContext, RestoreTarget, check_gpu

ItemC = TypeVar("ItemC", BoSpec, RestoreTarget, contravariant=True)


class BoIntake(Protocol):
    """One AddBos message's BOs made into what the job takes: checked and made first (no fd taken: `take`),
    then the fds they name opened in a worker thread (`open_ahead`), then given to the job a few at a time
    (`feed`); `drop` releases what the job did not take."""

    chunks: int      # the chunks they make (a dump's), for max_chunks_per_session
    chunk_size: int  # (a dump's chunk size; 0 for a job that stores none)

    def take(self, bo: rpc.Bo, ref: BoRef) -> None: ...

    def __len__(self) -> int: ...

    async def open_ahead(self) -> None: ...

    def feed(self, start: int, stop: int) -> None: ...

    def drop(self) -> None: ...


class Job(Protocol):
    """What a session needs of any job (dump, restore or verify); JobBase has the defaults."""

    @property
    def progress(self) -> Progress: ...

    @property
    def error(self) -> BaseException | None: ...

    @property
    def data_files_per_gpu(self) -> int: ...

    @property
    def manifest_name(self) -> str | None: ...

    @property
    def ready(self) -> bool: ...

    def files_needed(self) -> list[tuple[int, str]]: ...

    async def attach_file(self, image: int, name: str, fd: int, direct: int | None) -> None: ...

    def attach_data_file(self, image: int, name: str, gpu: int, stripe: int, fd: int,
                         direct: int | None) -> DataFileWriter: ...

    def publish_data_files(self, files: Sequence[DataFileWriter]) -> None: ...

    def detach_data_files(self, files: Sequence[DataFileWriter]) -> None: ...

    def intake(self, gpu_ids: frozenset[int]) -> BoIntake: ...

    def seal(self, manifest_fd: int | None) -> None: ...

    def on_fail(self, callback: Callable[[BaseException], None]) -> None: ...

    def cancel(self, reason: str = "job cancelled") -> None: ...

    async def finish(self) -> pb.Manifest: ...


class ItemSink(Protocol[ItemC]):
    """What an Intake needs of the job that takes its items (DumpJob: BoSpec; RestoreJob: RestoreTarget)."""

    ctx: JobContext

    def bo_gpu(self, bo: rpc.Bo) -> int | None: ...

    def bo_chunks(self, bo: rpc.Bo) -> int: ...

    def precheck(self, refs: Iterable[tuple[int, BoRef]]) -> None: ...

    def open_ahead(self, todo: Sequence[ItemC]) -> Ahead: ...

    def add(self, todo: Sequence[ItemC], ahead: Ahead | None = None) -> None: ...

    @staticmethod
    def drop_ahead(ahead: Ahead) -> None: ...


class Intake(Generic[ItemT]):
    """BoIntake for a job whose items are `ItemT`, made from each rpc.Bo by `make`."""

    def __init__(self, job: ItemSink[ItemT], make: Callable[[rpc.Bo, BoRef], ItemT], gpu_ids: frozenset[int],
                 chunk_size: int = 0) -> None:
        self.job: ItemSink[ItemT] = job
        self.make: Callable[[rpc.Bo, BoRef], ItemT] = make
        self.gpu_ids = gpu_ids
        self.items: list[ItemT] = []
        self.chunks = 0
        self.chunk_size = chunk_size
        self.ahead = Ahead()

    def __len__(self) -> int:
        return len(self.items)

    def take(self, bo: rpc.Bo, ref: BoRef) -> None:
        """Check one BO (its GPU, and what the job checks with no syscall) and make its item."""
        job = self.job
        gpu = job.bo_gpu(bo)
        if gpu is not None and gpu not in self.gpu_ids:
            check_gpu(gpu, self.gpu_ids, bo.id)  # raises
        self.chunks += job.bo_chunks(bo)
        self.items.append(self.make(bo, ref))

    async def open_ahead(self) -> None:
        """In the job's io thread: check the fds of many BOs, and open the BOs the job can open there (its syscalls,
        procmem probes and fd checks, off the event loop)."""
        items, job = self.items, self.job

        def prepare() -> Ahead:
            refs = {item.ref.fd: (item[0], item.ref) for item in items}
            if len(refs) > 1:
                job.precheck(refs.values())
            return job.open_ahead(items)
        self.ahead = await asyncio.get_running_loop().run_in_executor(job.ctx.io, prepare)

    def feed(self, start: int, stop: int) -> None:
        """Give the job the items [start, stop) (a session feeds them in steps, yielding between them)."""
        self.job.add(self.items[start:stop], self.ahead)

    def drop(self) -> None:
        """Release what `open_ahead` opened and the job did not take (it failed, or stopped early)."""
        self.job.drop_ahead(self.ahead)
