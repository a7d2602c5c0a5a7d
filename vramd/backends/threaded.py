"""Base of the CPU-copy backends: copies are CPU copies, a batch is one blocking call in a worker thread.

A batch's copies run as one `vramd.hostmem.batchcopy.copy_batch` call (one C
call without the GIL where the C module is built), in a per-GPU worker pool
when they come through `submit_many`.  The engine can also run such copies
itself, in its own copy threads, fused with the rest of a batch's work: a
subclass only says where each BO's bytes are (`endpoint`) and what a failed
copy means (`copy_error`): `CpuCopies`, the CPU-copier half it hands the
engine (`cpu_copier`).
"""
from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Self

from ..errors import VramdError
from ..hostmem.batchcopy import Copy, copy_batch
from ..hostmem.staging import StagingBuffer
from .base import Backend, BackendOptions, BoHandle, CopyItem, CpuCopier, Direction, holding


class CpuCopies(ABC):
    """The CPU copier (base.CpuCopier) of a backend: where each BO's bytes are and what a failed copy means."""

    @abstractmethod
    def endpoint(self, handle: BoHandle, bo_offset: int, length: int) -> tuple[int, int]:
        """CpuCopier.endpoint."""

    def plan(self, handle: BoHandle, bo_offset: int, address: int, length: int) -> Copy:
        fd, pos = self.endpoint(handle, bo_offset, length)
        if handle.direction is Direction.READ:
            return Copy(fd, pos, -1, address, length)
        return Copy(-1, address, fd, pos, length)

    @abstractmethod
    def copy_error(self, handle: BoHandle, bo_offset: int, err: int) -> VramdError:
        """CpuCopier.copy_error."""

    def after_copy(self, handle: BoHandle, bo_offset: int, length: int) -> None:
        """Nothing to do after a copy (CpuCopier.after_copy)."""

    def write_lock(self, handle: BoHandle) -> threading.Lock | None:
        """Copies into a BO run side by side (CpuCopier.write_lock)."""
        return None


class ThreadedBackend(CpuCopies, Backend):
    """Base for CPU-copy backends: a submit runs in a per-GPU worker thread pool, and the engine may run
    copies itself, through the backend's CPU copier (itself)."""

    def cpu_copier(self) -> CpuCopier:
        return self

    def __init__(self, workers_per_gpu: int = 2) -> None:
        self.workers_per_gpu = workers_per_gpu  # threads per GPU for copies that come through submit
        self._pools: dict[int, ThreadPoolExecutor] = {}

    @classmethod
    def create(cls, options: BackendOptions) -> Self:
        return cls(options.copy_threads or options.workers_per_gpu)

    def _executor(self, gpu_id: int) -> ThreadPoolExecutor:
        ex = self._pools.get(gpu_id)
        if ex is None:
            ex = self._pools[gpu_id] = ThreadPoolExecutor(
                self.workers_per_gpu, thread_name_prefix=f"vramd-{self.name}-gpu{gpu_id:x}"
            )
        return ex

    def submit(self, handle: BoHandle, bo_offset: int, buf: StagingBuffer, buf_offset: int,
               length: int) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor(handle.gpu_id), self._copy, handle, bo_offset, buf, buf_offset,
                                    length)

    def submit_many(self, items: Sequence[CopyItem]) -> asyncio.Future[None]:
        """All copies in one executor call, one after another in one worker thread; the first error stops them."""
        items = list(items)
        loop = asyncio.get_running_loop()
        if not items:
            fut: asyncio.Future[None] = loop.create_future()
            fut.set_result(None)
            return fut
        return loop.run_in_executor(self._executor(items[0][0].gpu_id), self._copy_many, items)

    def _copy_many(self, items: Sequence[CopyItem]) -> None:
        copies = [self.plan(h, bo_off, buf.address + buf_off, n) for h, bo_off, buf, buf_off, n in items]
        with holding(self.write_lock(item[0]) for item in items):
            outcomes, failed = copy_batch(copies)
        for h, bo_off, _, _, n in items[:failed if failed >= 0 else len(items)]:
            self.after_copy(h, bo_off, n)
        if failed >= 0:
            h, bo_off = items[failed][0], items[failed][1]
            raise self.copy_error(h, bo_off + outcomes[failed].done, outcomes[failed].err)

    def _copy(self, handle: BoHandle, bo_offset: int, buf: StagingBuffer, buf_offset: int, length: int) -> None:
        """One blocking copy (what a submit runs in a worker thread)."""
        self._copy_many([(handle, bo_offset, buf, buf_offset, length)])

    def close(self) -> None:
        for ex in self._pools.values():
            ex.shutdown(wait=True)
        self._pools.clear()
