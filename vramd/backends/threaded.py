"""Base of the CPU-copy backends: a copy is a blocking call run in a per-GPU worker thread pool."""
from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Self

from ..hostmem.staging import StagingBuffer
from .base import Backend, BackendOptions, BoHandle, CopyItem


class ThreadedBackend(Backend):
    """Base for CPU-copy backends: a submit runs in a per-GPU worker thread pool."""

    def __init__(self, workers_per_gpu: int = 2) -> None:
        self.workers_per_gpu = workers_per_gpu
        self._pools: dict[int, ThreadPoolExecutor] = {}

    @classmethod
    def create(cls, options: BackendOptions) -> Self:
        return cls(options.workers_per_gpu)

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
        if len(items) == 1:
            return self.submit(*items[0])
        loop = asyncio.get_running_loop()
        if not items:
            fut: asyncio.Future[None] = loop.create_future()
            fut.set_result(None)
            return fut
        return loop.run_in_executor(self._executor(items[0][0].gpu_id), self._copy_many, items)

    def _copy_many(self, items: Sequence[CopyItem]) -> None:
        copy = self._copy
        for handle, bo_offset, buf, buf_offset, length in items:
            copy(handle, bo_offset, buf, buf_offset, length)

    @abstractmethod
    def _copy(self, handle: BoHandle, bo_offset: int, buf: StagingBuffer, buf_offset: int, length: int) -> None:
        """Blocking copy, run in a worker thread."""

    def close(self) -> None:
        for ex in self._pools.values():
            ex.shutdown(wait=True)
        self._pools.clear()
