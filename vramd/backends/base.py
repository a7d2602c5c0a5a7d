"""The copy-backend interface, shaped for asynchronous DMA engines.

A backend moves bytes between a BO and a staging buffer.  The engine
attaches the staging pool once (a DMA backend registers/pins every buffer
there, once), opens each BO once per job (a DMA backend imports it there),
then `submit`s copies; each submit returns an awaitable that completes when
the copy has landed.  A DMA backend completes from a fence; the CPU
backends below complete from a worker thread.  Either way the engine keeps
several copies in flight and never blocks its event loop.
"""
from __future__ import annotations

import asyncio
import enum
import fcntl
import os
import stat
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

from ..errors import BadDescriptorError
from ..staging import StagingBuffer, StagingPool


class Direction(enum.Enum):
    READ = "read"    # BO -> staging (dump)
    WRITE = "write"  # staging -> BO (restore)


@dataclass(frozen=True)
class BoRef:
    """Where a BO's bytes are reached: a caller-passed fd plus an offset.

    procmem: fd of /proc/<pid>/mem, offset = virtual address in that process.
    mmap:    fd of a dmabuf / render node / memfd / file, offset = mmap offset.
    sdma:    fd of a dmabuf, offset = byte offset inside it.
    """

    kind: str
    fd: int
    offset: int = 0


@dataclass(frozen=True)
class Capabilities:
    name: str
    can_read: bool
    can_write: bool
    preferred_chunk: int   # the chunk size this backend moves best
    max_inflight: int      # copies worth keeping in flight per GPU
    asynchronous_dma: bool  # True for an engine that completes from a fence
    description: str


@dataclass(eq=False)
class BoHandle:
    """One BO opened by a backend for one job; backends may subclass it."""

    bo_id: int
    ref: BoRef
    size: int
    gpu_id: int
    direction: Direction


class Backend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    def attach(self, pool: StagingPool) -> None:
        """Called once per job with the staging pool, before any submit."""

    @abstractmethod
    def open(self, bo_id: int, ref: BoRef, size: int, gpu_id: int, direction: Direction) -> BoHandle:
        """Validate (and import) a BO; raises a typed error naming what is wrong."""

    @abstractmethod
    def submit(
        self, handle: BoHandle, bo_offset: int, buf: StagingBuffer, buf_offset: int, length: int
    ) -> asyncio.Future:
        """Start one copy of `length` bytes; the future completes when it has landed."""

    def release(self, handle: BoHandle) -> None:
        """The job is done with this BO."""

    def close(self) -> None:
        """The job is over; drop per-job resources."""


def check_fd(fd: int, direction: Direction, *, bo_id: int, write_needs_rdwr: bool = False) -> os.stat_result:
    """fstat a caller-passed fd and check its access mode suits the direction.

    `write_needs_rdwr`: writing needs O_RDWR, not just O_WRONLY (a MAP_SHARED
    writable mapping does).
    """
    try:
        st = os.fstat(fd)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        raise BadDescriptorError(f"fd {fd} is not usable: {e.strerror}", bo_id=bo_id) from None
    if stat.S_ISDIR(st.st_mode):
        raise BadDescriptorError(f"fd {fd} is a directory, not a BO", bo_id=bo_id)
    acc = flags & os.O_ACCMODE
    if direction is Direction.READ and acc == os.O_WRONLY:
        raise BadDescriptorError(f"fd {fd} is write-only; dumping needs read access", bo_id=bo_id)
    if direction is Direction.WRITE and acc == os.O_RDONLY:
        raise BadDescriptorError(f"fd {fd} is read-only; restoring needs write access", bo_id=bo_id)
    if direction is Direction.WRITE and write_needs_rdwr and acc != os.O_RDWR:
        raise BadDescriptorError(f"fd {fd} must be open read-write to map it for writing", bo_id=bo_id)
    return st


class ThreadedBackend(Backend):
    """Base for CPU-copy backends: a submit runs in a per-GPU worker thread pool."""

    def __init__(self, workers_per_gpu: int = 2):
        self.workers_per_gpu = workers_per_gpu
        self._pools: dict[int, ThreadPoolExecutor] = {}

    def _executor(self, gpu_id: int) -> ThreadPoolExecutor:
        ex = self._pools.get(gpu_id)
        if ex is None:
            ex = self._pools[gpu_id] = ThreadPoolExecutor(
                self.workers_per_gpu, thread_name_prefix=f"vramd-{self.name}-gpu{gpu_id:x}"
            )
        return ex

    def submit(self, handle, bo_offset, buf, buf_offset, length):
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor(handle.gpu_id), self._copy, handle, bo_offset, buf, buf_offset, length)

    @abstractmethod
    def _copy(self, handle: BoHandle, bo_offset: int, buf: StagingBuffer, buf_offset: int, length: int) -> None:
        """Blocking copy, run in a worker thread."""

    def close(self) -> None:
        for ex in self._pools.values():
            ex.shutdown(wait=True)
        self._pools.clear()
