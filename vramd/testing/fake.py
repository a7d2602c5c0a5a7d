"""A fake asynchronous DMA backend: submit, then completion from an "engine" thread, with faults on demand.

It copies with pread/pwrite on whatever fd a BO names (a memfd, a file),
so it needs no GPU and no privileges, but it completes the way a DMA
engine does: `submit_many` queues the batch to a per-GPU engine thread and
returns a future that the engine resolves later from its own thread.  Tests
use it to drive the pipeline through asynchronous completion, through
faults (`fail_at`), and through slow engines (`delay`).
"""
from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Self

from ..backends.base import (
    Backend,
    BackendOptions,
    BoHandle,
    BoRef,
    Capabilities,
    CopyItem,
    Direction,
    FdMemo,
)
from ..errors import BackendError, TargetTooSmallError
from ..hostmem.staging import StagingBuffer

_Work = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]", Sequence[CopyItem]]


class FakeDmaBackend(Backend):
    name = "fake"

    def __init__(self, *, delay: float = 0.0) -> None:
        self.delay = delay                            # seconds each batch takes on the engine
        self.fail_at: set[tuple[int, int]] = set()    # (bo_id, bo_offset) of copies that fault
        self.submissions = 0                          # batches submitted (one per submit_many)
        self._engines: dict[int, tuple[queue.SimpleQueue[_Work | None], threading.Thread]] = {}
        self._lock = threading.Lock()

    @classmethod
    def create(cls, options: BackendOptions) -> Self:
        return cls()

    def capabilities(self) -> Capabilities:
        return Capabilities(name=self.name, can_read=True, can_write=True, preferred_chunk=1 << 20, max_inflight=8,
                            asynchronous_dma=True, description="fake DMA engine (tests): pread/pwrite on the fd")

    def open(self, bo_id: int, ref: BoRef, size: int, gpu_id: int, direction: Direction,
             checked: FdMemo | None = None) -> BoHandle:
        st = self.check(ref.fd, direction, bo_id=bo_id, checked=checked)
        if ref.offset + size > st.st_size:
            raise TargetTooSmallError(f"the fd of BO {bo_id} holds {st.st_size} bytes; the BO needs {size} at "
                                      f"{ref.offset:#x}",
                                      bo_id=bo_id, offset=max(0, st.st_size - ref.offset))
        return BoHandle(bo_id, ref, size, gpu_id, direction)

    def submit(self, handle: BoHandle, bo_offset: int, buf: StagingBuffer, buf_offset: int,
               length: int) -> asyncio.Future[None]:
        return self.submit_many([(handle, bo_offset, buf, buf_offset, length)])

    def submit_many(self, items: Sequence[CopyItem]) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self.submissions += 1
        self._engine(items[0][0].gpu_id).put((loop, fut, list(items)))
        return fut

    def _engine(self, gpu_id: int) -> queue.SimpleQueue[_Work | None]:
        with self._lock:
            engine = self._engines.get(gpu_id)
            if engine is None:
                q: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
                t = threading.Thread(target=self._run, args=(q,), name=f"fake-dma-{gpu_id:x}", daemon=True)
                t.start()
                engine = self._engines[gpu_id] = (q, t)
            return engine[0]

    def _run(self, q: queue.SimpleQueue[_Work | None]) -> None:
        while (work := q.get()) is not None:
            loop, fut, items = work
            error: BaseException | None = None
            if self.delay:
                time.sleep(self.delay)
            try:
                for item in items:  # in order; the first fault stops the batch, like a guilty context
                    self._copy(*item)
            except BaseException as e:
                error = e
            loop.call_soon_threadsafe(_settle, fut, error)

    def _copy(self, h: BoHandle, bo_offset: int, buf: StagingBuffer, buf_offset: int, length: int) -> None:
        if (h.bo_id, bo_offset) in self.fail_at:
            raise BackendError("fake DMA fault (injected)", bo_id=h.bo_id, offset=bo_offset)
        view = buf.view[buf_offset:buf_offset + length]
        try:
            done = 0
            while done < length:
                at = h.ref.offset + bo_offset + done
                part = view[done:]
                if h.direction is Direction.READ:
                    n = os.preadv(h.ref.fd, [part], at)
                else:
                    n = os.pwritev(h.ref.fd, [part], at)
                if n <= 0:
                    raise BackendError(f"fake DMA: the fd of BO {h.bo_id} ended at {at:#x}", bo_id=h.bo_id,
                                       offset=bo_offset + done)
                done += n
        finally:
            view.release()

    def close(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for q, t in engines:
            q.put(None)
            t.join()


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
